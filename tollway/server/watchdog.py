"""The watchdog: work that holds engine capacity but makes no progress for longer than any step
could take is stuck (a leak, or a hung engine), and is reported rather than left to hide.

Two cases are checked, from what the engine thread publishes after every change:
  - a running request that has not been in a step for `bound` seconds: it holds a slot and
    KV blocks that nothing will give back (a hung engine thread ages them all, since it
    publishes nothing more);
  - KV blocks in use while no request is running or waiting, for `bound` seconds: blocks that
    no request owns.

The bound: a running request is in every step unless a time target caps the step, and then
the requests left out go first in the next one, so it waits a few steps at most; a step is at
most as long as the longest step measured so far. STALL_STEPS of those leave room for that
rotation and for this machine's 2-3x hiccups; STALL_FLOOR_SECONDS covers the first steps, before
there is a measure (and the warm-up of kernels in them).
"""
from __future__ import annotations

import time

STALL_STEPS = 8
STALL_FLOOR_SECONDS = 30.0


class Watchdog:
    def __init__(self, engine, floor: float = STALL_FLOOR_SECONDS):
        """`engine`: an AsyncEngine. Checked from the event loop (/health, /metrics)."""
        self.engine, self.floor = engine, floor
        self.stalls = 0  # stalled requests (and stretches of held idle KV) found so far
        self._reported: set[str] = set()  # stalled now and counted already
        self._held_idle_since: float | None = None

    @property
    def bound(self) -> float:
        """Seconds without progress after which work is stuck."""
        return max(self.floor, STALL_STEPS * self.engine.longest_step)

    def check(self) -> list[str]:
        """What is stuck now, in words (empty when all is well); each case is counted once."""
        now, bound, occupancy = time.monotonic(), self.bound, self.engine.occupancy
        stuck = {r.request_id: f"request {r.request_id} has run {now - r.last_planned:.0f} s without progress"
                 for r in self.engine.running if r.last_planned is not None and now - r.last_planned > bound}
        if occupancy.idle and occupancy.kv_blocks_used:
            self._held_idle_since = self._held_idle_since or now
            if now - self._held_idle_since > bound:
                stuck["idle KV"] = f"{occupancy.kv_blocks_used} KV blocks held with no request for " \
                                   f"{now - self._held_idle_since:.0f} s"
        else:
            self._held_idle_since = None
        self.stalls += len(stuck.keys() - self._reported)
        self._reported = set(stuck)
        return list(stuck.values())
