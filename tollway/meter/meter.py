"""The meter: every step's engine time attributed to the requests in it (attribution.py),
summed per request, and settled into the ledger when the request ends.

Steps kept short for a fast lane that had no request in them leave idle capacity with no one
in the step to pay for it. That readiness is what gives the next fast arrival its short wait,
so it is held as `readiness_seconds` and charged to the next fast requests to run.

`on_step` runs on the engine thread before the step's outputs are handed out, so a request's
engine seconds are complete by the time its handler sees it finish.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable

from tollway.config import TIERS
from tollway.meter.attribution import attribute, carry_readiness
from tollway.meter.budgets import Budgets
from tollway.meter.ledger import Ledger, LedgerRow
from tollway.meter.price_card import PriceCard
from tollway.step_report import StepReport

# Without a step model (profiling off), a step is split by tokens alone.
_TOKENS_ONLY = [0.0, 1.0, 0.0, 0.0, 0.0]


class Meter:
    def __init__(self, price_card: PriceCard, ledger: Ledger, budgets: Budgets | None = None):
        self.price_card, self.ledger = price_card, ledger
        self.budgets = budgets or Budgets([], ledger)
        self._seconds: dict[str, float] = {}  # engine request id -> attributed seconds, while watched
        self._lock = threading.Lock()
        self.busy_seconds = 0.0  # every step's measured time
        # Handed out to requests; with readiness_seconds, equal to busy_seconds but for rounding.
        self.attributed_seconds = 0.0
        self.readiness_seconds = 0.0  # idle capacity held for the fast lane, not yet charged
        self.tier_seconds = dict.fromkeys(TIERS, 0.0)  # attributed_seconds by the lane charged

    def on_step(self, report: StepReport) -> None:
        if not report.ran:  # requests aborted between steps: every step they were in is charged already
            return
        plan, result, model = report.plan, report.result, report.step_model
        coefficients = model.coefficients.get(plan.kernel, _TOKENS_ONLY) if model is not None else _TOKENS_ONLY
        # A request's own work (its grammar's mask) is its alone; the rest of the step is shared.
        own = result.own_seconds
        shares = attribute(plan, result.seconds - sum(own.values()), coefficients, 1.0)
        for rid, seconds in own.items():
            shares[rid] = shares.get(rid, 0.0) + seconds
        with self._lock:
            self.busy_seconds += result.seconds
            fast = [s.request_id for s in plan.seqs if s.tier == "fast" and s.request_id in self._seconds]
            self.readiness_seconds = carry_readiness(shares, self.readiness_seconds, fast)
            self.attributed_seconds += sum(shares.values())
            tiers = {s.request_id: s.tier for s in plan.seqs}
            for rid, seconds in shares.items():
                self.tier_seconds[tiers[rid]] += seconds
                if rid in self._seconds:
                    self._seconds[rid] += seconds

    def watch(self, request_ids: Iterable[str]) -> None:
        """Start summing these engine requests' seconds (before they are submitted)."""
        with self._lock:
            for rid in request_ids:
                self._seconds.setdefault(rid, 0.0)

    def release(self, request_ids: Iterable[str]) -> float:
        """Stop watching these requests; their engine seconds so far, summed."""
        with self._lock:
            return sum(self._seconds.pop(rid, 0.0) for rid in request_ids)

    def cost(self, engine_seconds: float) -> float:
        return engine_seconds * self.price_card.price_per_second

    def settle(self, row: LedgerRow) -> None:
        """Record a finished request (durably, before its response ends), count it against its
        budgets and release what they held for it. Blocking: call it off the event loop."""
        self.budgets.settle(row)
