"""A replica's steps as running sums, so a coasting request's cost and token times over its
whole coast come out of two lookups instead of one entry per step it ran in."""
from __future__ import annotations

from array import array

from tollway.meter.attribution import Shares, decode_work


class StepLog:
    """Per step id: when it ended, and running sums of what a coasting decode paid in it. A
    decode at position p pays rate * (a + b * p) (attribution.decode_work with one decode at
    p + 1 pairs: a = per_token + per_row + per_pair / 1000, b = per_pair / 1000); with
    p = offset + step, a coast's cost is a difference of three sums, per rate class."""

    def __init__(self):
        self.ends = array("d", [0.0])  # step ids start at 1
        # (rate * a, rate * b, rate * b * step), running, for outside the fast lane and in it
        self._sums = {fast: [array("d", [0.0]) for _ in range(3)] for fast in (False, True)}

    def record(self, step_id: int, end: float, shares: Shares, coefficients: list[float]) -> None:
        """A step ended. Steps are recorded in id order but for a suspended step, which ends
        after the fast steps beside it: its sums then go into theirs too."""
        a, b = decode_work(coefficients, 1, 1), decode_work(coefficients, 0, 1)  # one decode at p: a + b * p
        while len(self.ends) <= step_id:  # and ids of plans that ran nothing: nothing coasts through them
            self.ends.append(self.ends[-1])
            for sums in self._sums.values():
                for running in sums:
                    running.append(running[-1])
        self.ends[step_id] = end
        for fast, rate in ((False, shares.rate), (True, shares.fast_rate)):
            for running, add in zip(self._sums[fast], (rate * a, rate * b, rate * b * step_id)):
                for i in range(step_id, len(running)):
                    running[i] += add

    def charge(self, first: int, last: int, offset: int, fast: bool) -> float:
        """What a decode at position offset + step paid over steps first..last."""
        ra, rb, rbs = self._sums[fast]
        lo = first - 1
        return (ra[last] - ra[lo]) + offset * (rb[last] - rb[lo]) + (rbs[last] - rbs[lo])

    def times(self, first: int, last: int) -> array:
        return self.ends[first:last + 1]
