"""The tier-aware routing policy: which replica serves a request, from each replica's latest
load report plus what the router has sent it since.

- fast: the replica with the most free fast slots (its reserved fast slots less the fast
  requests it holds), then the least outstanding tokens. Fast steps are capped to fast's
  TPOT target, so a replica's other lanes barely slow fast work; how many fast requests
  share those capped steps does.
- standard: the least outstanding tokens, unless a replica holds the prompt's prefix in its
  prefix cache (affinity.py) and its extra outstanding work is no more than the prefill the
  cache hit saves: then that replica.
- batch: only a replica with spare sequence slots (no fast or standard request waiting, room
  past the fast lane's reserve); with none, the request waits (in the ingress) until one frees.

Reports lag (Serve polls them, serve_router.py passes them on), so everything sent to a
replica after its latest report was measured counts on top of that report; it drops out once
a newer report covers it. Pure Python, no Ray: it is tested on its own.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tollway.fleet.affinity import CHARS_PER_TOKEN, PrefixAffinity
from tollway.fleet.load import ReplicaLoad


@dataclass
class ReplicaState:
    index: int  # the fleet's name for it: replicas are numbered as they join (at their first report)
    url: str  # its own tollway API
    load: ReplicaLoad  # its latest report
    asked: float  # when `load` was measured (router clock)
    alive: bool = True
    draining: bool = False
    sent: list[tuple[float, str, int]] = field(default_factory=list)  # (when, tier, tokens) since `asked`
    replica_id: str = ""  # Serve's id of the replica
    actor_name: str = ""  # its Ray actor's name, in Serve's namespace

    @property
    def routable(self) -> bool:
        return self.alive and not self.draining

    @property
    def state(self) -> str:
        return "dead" if not self.alive else "draining" if self.draining else "serving"

    @property
    def outstanding_tokens(self) -> int:
        return self.load.outstanding_tokens + sum(s[2] for s in self.sent)

    @property
    def fast_free(self) -> int:
        return self.load.fast_slots - self.load.fast_busy - sum(1 for s in self.sent if s[1] == "fast")

    @property
    def spare_slots(self) -> int:
        return self.load.spare_slots - len(self.sent)


@dataclass(frozen=True)
class RoutingHint:
    """What the router needs to know of a request to place it. Sent with each call to the
    replicas' deployment, where Serve's request router reads it (serve_router.py)."""

    tier: str = "standard"
    prompt_text: str = ""
    tokens: int = 0
    exclude: frozenset[int] = frozenset()  # replicas that did not serve it already
    replica: int | None = None  # this replica and no other (drain, resume)


class Router:
    # Wall-clock time: the replicas time their reports, and on a cluster they are other machines.
    def __init__(self, replicas: list[ReplicaState], clock=time.time):
        self.replicas = replicas
        self.clock = clock
        self.affinity = PrefixAffinity()
        self._changed: asyncio.Event | None = None  # set (and replaced) when room may have freed

    def choose(self, tier: str, prompt_text: str, exclude: set[int] = frozenset()) -> tuple[ReplicaState, str] | None:
        """(replica, why) for a request of `tier`, or None: no replica can take it now (none
        routable, or for batch, none with spare capacity)."""
        candidates = [r for r in self.replicas if r.routable and r.index not in exclude]
        if not candidates:
            return None
        if tier == "fast":
            return max(candidates, key=lambda r: (r.fast_free, -r.outstanding_tokens)), "fast_capacity"
        if tier == "batch":
            spare = [r for r in candidates if r.spare_slots > 0]
            return (max(spare, key=lambda r: r.spare_slots), "spare_capacity") if spare else None
        least = min(candidates, key=lambda r: r.outstanding_tokens)
        owner, saved = self.affinity.lookup(prompt_text)
        cached = next((r for r in candidates if r.index == owner), None)
        if cached is not None and cached.outstanding_tokens - least.outstanding_tokens <= saved:
            return cached, "prefix"
        return least, "least_outstanding"

    async def wait_for_capacity(self, timeout: float) -> None:
        """Until a report or a finished request may have freed room (or `timeout` passes)."""
        if self._changed is None:  # made on first use: it binds to the running loop
            self._changed = asyncio.Event()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            pass

    def sent(self, replica: ReplicaState, tier: str, prompt_text: str, tokens: int) -> None:
        replica.sent.append((self.clock(), tier, tokens))
        self.affinity.record(prompt_text, replica.index)

    def reported(self, replica: ReplicaState, load: ReplicaLoad, asked: float) -> None:
        replica.load, replica.asked = load, asked
        replica.sent = [s for s in replica.sent if s[0] > asked]
        self.notify()

    def died(self, replica: ReplicaState) -> None:
        replica.alive = False
        self.affinity.forget(replica.index)
        self.notify()

    def notify(self) -> None:
        """Wake the requests waiting for capacity (call from the event loop)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()


def estimated_tokens(prompt_text: str, max_tokens: int, choices: int) -> int:
    """A request's work in tokens before anyone tokenizes it: its prompt, estimated from its
    length, and every choice's output allowance."""
    return len(prompt_text) // CHARS_PER_TOKEN + max_tokens * choices
