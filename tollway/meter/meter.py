"""The meter: every step's engine time attributed to the requests in it (attribution.py),
summed per request, and settled into the ledger when the request ends.

Steps kept short for a fast lane that had no request in them leave idle capacity with no one
in the step to pay for it. That readiness is what gives the next fast arrival its short wait,
so it is held as `readiness_seconds` and charged to the next fast requests to run.

`on_step` runs on the engine thread before the step's outputs are handed out, so a request's
engine seconds (its tab, tab.py) are complete by the time its handler sees it finish.
"""
from __future__ import annotations

import threading

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
        self._lock = threading.Lock()  # over the totals below, which metrics read from other threads
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
        # Readiness held for the fast lane goes to the next fast requests that run with a tab.
        fast = [s.request_id for s in plan.seqs if s.tier == "fast" and s.tab is not None]
        with self._lock:
            self.busy_seconds += result.seconds
            self.readiness_seconds = carry_readiness(shares, self.readiness_seconds, fast)
            self.attributed_seconds += sum(shares.values())
            for s in plan.seqs:
                seconds = shares.get(s.request_id, 0.0)
                self.tier_seconds[s.tier] += seconds
                if s.tab is not None:
                    s.tab.seconds += seconds

    def cost(self, engine_seconds: float) -> float:
        return engine_seconds * self.price_card.price_per_second

    def settle(self, row: LedgerRow) -> None:
        """Record a finished request (durably, before its response ends), count it against its
        budgets and release what they held for it. Blocking: call it off the event loop."""
        self.budgets.settle(row)
