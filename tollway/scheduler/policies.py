"""The three scheduling policies: each answers the few questions the scheduler core asks.

  fcfs      one queue in arrival order; preempt the newest (vLLM's default)
  priority  admission and preemption by tier priority only (vLLM --scheduling-policy priority)
  lanes     tiers with reserved capacity, and steps shaped by predicted time: while a fast
            request runs, each step is the largest that meets the fast TPOT target; otherwise
            the largest that keeps standard within its TPOT SLO. Batch fills what is left, and
            runs as standard once its completion window is closing.

The questions: what a step considers, in what order (`phases`); whom a request may preempt
(`victims`); what time the step must meet (`time_target`); and a running request's place in
its phase (`turn`). A policy belongs to one scheduler and reads its state through the view
scheduler_view.py describes.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable

from tollway.request import Request
from tollway.scheduler.deadlines import Deadlines
from tollway.scheduler.scheduler_view import SchedulerView
from tollway.scheduler.step_budget import TimeTarget
from tollway.scheduler.step_model import StepShape


class Policy:
    name = ""
    coasts = True  # plain decodes may coast in the simulator (sim/coasting.py)

    def __init__(self, scheduler: SchedulerView):
        self.s = scheduler

    def phases(self, now: float) -> Iterable[tuple[str, list[Request], str | None]]:
        """What the step considers, in order: ("run", running requests to continue, the
        coasting group it takes) and ("admit", waiting requests in admission order; the first
        that does not fit stops it, None)."""
        raise NotImplementedError

    def victims(self, request: Request, others: list[Request]) -> list[Request]:
        """Which of the running `others` `request` may preempt for room, first choice first."""
        raise NotImplementedError

    def time_target(self, now: float) -> TimeTarget | None:
        return None

    def turn(self, last_step: int, admitted: int) -> tuple[int, ...]:
        """A running request's place in its run phase, from the step it last ran in and its
        admission counter: by admission."""
        return (admitted,)

    def coast_group(self, request: Request) -> str:
        """The coasting group (the run phase) that takes a request: fcfs has one."""
        return "all"

    def fast_lane(self, tier: str) -> bool:
        """Whether the tier's requests go into every step, past the time target (at least a
        block's worth of a prompt), with drafts to speed their decodes."""
        return False

    def preemptible(self, request: Request) -> bool:
        """Whether a request that cannot grow gives up its own blocks (else it waits a step)."""
        return True

    def may_admit_decode(self, request: Request) -> bool:
        return True

    def queued(self, request: Request) -> None:
        """A request (re)joins its queue."""

    def left_queue(self, request: Request) -> None:
        """A request left its queue: admitted, or finished while waiting."""

    def due(self, request: Request) -> float | None:
        """From when the request runs ahead of its own tier; None: never."""
        return None

    def is_due(self, request: Request, now: float) -> bool:
        return False

    def _rank(self) -> dict[str, int]:
        return {t: spec.priority for t, spec in self.s.tiers.items()}


class Fcfs(Policy):
    name = "fcfs"

    def phases(self, now):
        s = self.s
        yield "run", sorted(s.stepping(), key=s.turn_of), "all"
        yield "admit", sorted((r for q in s.waiting.values() for r in q), key=s.arrival), None

    def victims(self, request, others):
        return sorted(others, key=lambda r: -self.s.admitted(r))


class Priority(Policy):
    """Sorts all running requests as one list, so it does not coast."""

    name = "priority"
    coasts = False

    def phases(self, now):
        s, rank = self.s, self._rank()
        yield "run", sorted(s.running.values(), key=lambda r: (rank[r.tier], s.admitted(r))), None
        yield "admit", sorted((r for q in s.waiting.values() for r in q), key=lambda r: (rank[r.tier], s.arrival(r))), None

    def victims(self, request, others):
        rank, s = self._rank(), self.s
        mine = rank[request.tier]
        return sorted((r for r in others if rank[r.tier] >= mine), key=lambda r: (-rank[r.tier], -s.admitted(r)))


class Lanes(Policy):
    name = "lanes"

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self._deadlines = Deadlines()  # waiting batch requests not yet due
        self._late: dict[str, Request] = {}  # waiting batch requests that are due: they go as standard
        self._fast_seen: float | None = None  # when fast work was last waiting or running
        self._decode_shape: StepShape | None = None  # the running requests' decode step, in this plan

    def phases(self, now):
        s = self.s
        self._decode_shape = None  # built again when it caps admission (may_admit_decode)

        def by_turn(requests):  # skipped requests go first next time, so a capped step rotates fairly
            return sorted(requests, key=s.turn_of)

        running = list(s.stepping())
        for rid in self._deadlines.pop_due(now):
            self._late[rid] = s.get(rid)
        urgent = {r.request_id for r in running if self.is_due(r, now)}
        # No step admits more than max_num_seqs: look no further into a queue than that (an
        # overloaded server's queues are long, and this runs every step).
        cap = s.config.max_num_seqs
        yield "run", by_turn(r for r in running if r.tier == "fast"), "fast"
        yield "admit fast", list(itertools.islice(s.waiting["fast"], cap)), None
        yield "run", by_turn(r for r in running if r.tier == "standard" or r.request_id in urgent), "standard"
        late_batch = sorted(self._late.values(), key=lambda r: r.arrival_time)
        yield "admit", list(itertools.islice(itertools.chain(late_batch, s.waiting["standard"]), cap)), None
        yield "run", by_turn(r for r in running if r.tier == "batch" and r.request_id not in urgent), "batch"
        if not s.waiting["standard"]:  # batch takes only what standard leaves
            on_time = (r for r in s.waiting["batch"] if r.request_id not in self._late)
            yield "admit", list(itertools.islice(on_time, cap)), None

    def victims(self, request, others):
        """Batch before standard; the newest, least-progressed first. Fast is never a victim."""
        rank, s = self._rank(), self.s
        mine = rank[request.tier]
        return sorted((r for r in others if s.tiers[r.tier].preemptible and rank[r.tier] >= mine),
                      key=lambda r: (-rank[r.tier], len(r.output_token_ids), -s.admitted(r)))

    def time_target(self, now):
        """The fast target while fast work is about, planned at the p98 overrun so that 95% of
        measured steps meet it (at the p97, 94% did in lanes.py: fast steps miss by more than
        the steps around them); else standard's SLO at the p90 overrun, and half of fast's TTFT
        target for the wait of a fast request that arrives mid-step: for one layer of the step
        where steps stop between layers for it, else for the whole step while the fast lane is
        warm. Rarer overruns are this machine's hiccups (steps taking 2-3x for reasons outside
        the plan): planning for them would shrink every step and could not prevent them."""
        s = self.s
        if s.step_model is None:
            return None
        fast, standard = s.tiers["fast"], s.tiers["standard"]
        if s.waiting["fast"] or s.running_in("fast"):
            self._fast_seen = now
            return TimeTarget(fast.tpot_target, 0.98, "fast") if fast.tpot_target else None
        targets = [TimeTarget(standard.tpot_target, 0.9, "standard")] if standard.tpot_target else []
        layers = s.config.pause_layers
        if fast.ttft_target and layers:
            targets.append(TimeTarget(fast.ttft_target / 2 * layers, 0.97, "fast"))
        elif fast.ttft_target and fast.warm_for and self._fast_seen is not None and now - self._fast_seen <= fast.warm_for:
            targets.append(TimeTarget(fast.ttft_target / 2, 0.97, "fast"))
        return min(targets) if targets else None

    def turn(self, last_step, admitted):
        """The longest-skipped first, then by admission."""
        return (last_step, admitted)

    def coast_group(self, request):
        return request.tier

    def fast_lane(self, tier):
        return tier == "fast"

    def preemptible(self, request):
        return self.s.tiers[request.tier].preemptible

    def may_admit_decode(self, request):
        """Standard's SLO caps the batch: admit only if the decode step with this request added
        would still be predicted within it."""
        s = self.s
        slo = s.tiers["standard"].tpot_target
        if s.step_model is None or slo is None or request.tier == "fast":
            return True
        if self._decode_shape is None:  # built once per plan, then grown with each admission
            self._decode_shape = s.decode_shape()
        shape = self._decode_shape.plus(request.num_tokens, 1, 1)
        if s.fastest(shape)[1] > slo:
            return False
        # Counted from here on even if its admission then fails, and preempted requests stay
        # counted until the next plan: both only err on the safe side.
        self._decode_shape = shape
        return True

    def queued(self, request):
        due = self.due(request)
        if due is not None:
            self._deadlines.set(request.request_id, due)

    def left_queue(self, request):
        self._deadlines.discard(request.request_id)
        self._late.pop(request.request_id, None)

    def due(self, request):
        """When a batch request's window is closing, from which on it runs as standard: when
        what is left, at standard's per-token SLO, would take it to within a half of its window,
        or at half its window. None for requests without a window."""
        window = self.s.tiers[request.tier].window
        if request.tier != "batch" or window is None:
            return None
        per_token = self.s.tiers["standard"].tpot_target or 1.0
        left = request.params.max_tokens - len(request.output_token_ids) + 1
        return min(request.arrival_time + window - 1.5 * left * per_token, request.arrival_time + window / 2)

    def is_due(self, request, now):
        due = self.due(request)
        return due is not None and now >= due


POLICY_TYPES = {p.name: p for p in (Fcfs, Priority, Lanes)}
