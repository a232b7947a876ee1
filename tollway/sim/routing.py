"""Which replica a new request goes to. A rule sees each replica's scheduler and the work it
holds (`outstanding_tokens`: prompt plus max_tokens of its unfinished requests) at the
request's arrival: what a router in front of real replicas would poll."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

ROUTINGS = ("round_robin", "least_outstanding", "tier_aware")


def make_router(rule: str) -> Callable[[Sequence, str], int]:
    """router(replicas, tier) -> the index of the replica to send to."""
    if rule not in ROUTINGS:
        raise ValueError(f"--routing: expected one of {', '.join(ROUTINGS)}, got {rule!r}")
    if rule == "round_robin":
        turn = itertools.count()
        return lambda replicas, tier: next(turn) % len(replicas)
    if rule == "least_outstanding":
        return lambda replicas, tier: min(range(len(replicas)), key=lambda i: (replicas[i].outstanding_tokens, i))

    def tier_aware(replicas: Sequence, tier: str) -> int:
        # fast: where the fast lane is emptiest; batch: where standard is lightest, so that it
        # rides on spare capacity; standard: least outstanding work.
        def load(i: int, lane: str) -> int:
            s = replicas[i].scheduler
            return s.running_in(lane) + len(s.waiting[lane])

        lane = {"fast": "fast", "batch": "standard"}.get(tier)
        if lane is None:
            return min(range(len(replicas)), key=lambda i: (replicas[i].outstanding_tokens, i))
        return min(range(len(replicas)), key=lambda i: (load(i, lane), replicas[i].outstanding_tokens, i))
    return tier_aware
