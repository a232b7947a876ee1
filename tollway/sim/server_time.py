"""The server's own time per call beside the engine, as a simulated call draws it: from the calls
a served profile kept (MachineProfile.calls) of its lane, made while the engine held about as
many requests. Reading, tokenizing and checking a call and writing its tokens to the wire run on
the server's event loop, which also streams every other running request, so they take longer
the busier the server is (sim_fidelity_served.py reports them by load)."""
from __future__ import annotations

import random

MIN_CALLS = 8  # a busyness with fewer calls kept draws from the nearest one with enough


class ServerTime:
    def __init__(self, calls: dict[str, list[list[float]]], seed: int):
        self._draws = random.Random(seed)
        self._lanes = {tier: _by_busyness(lane) for tier, lane in calls.items() if lane}
        self._any = _by_busyness([call for lane in calls.values() for call in lane])  # for a lane with none

    def draw(self, tier: str, held: int) -> tuple[float, float]:
        """(intake, delivery) seconds for a call of `tier` reaching a server whose engine holds
        `held` requests; (0, 0) where the profile kept no calls."""
        bins = self._lanes.get(tier) or self._any
        if not bins:
            return 0.0, 0.0
        want = held.bit_length()
        enough = [b for b, kept in bins.items() if len(kept) >= MIN_CALLS] or list(bins)
        intake, delivery, _ = self._draws.choice(bins[min(enough, key=lambda b: (abs(b - want), b))])
        return intake, delivery


def _by_busyness(calls: list[list[float]]) -> dict[int, list[list[float]]]:
    """The calls by the requests the engine held, in powers of two (0, 1, 2-3, 4-7, ...)."""
    bins: dict[int, list[list[float]]] = {}
    for call in calls:
        bins.setdefault(int(call[2]).bit_length(), []).append(call)
    return bins
