"""Spending limits per API key or tag, per UTC day or calendar month, on billed dollars.

Spend is read from the ledger once per budget and period, then kept up to date as requests
are recorded. Alerts at 50%, 80% and 100% are claimed in the ledger, so each fires once per
period even across restarts; they are logged and POSTed to the webhook. A hard cap refuses
new requests once spend reaches the limit; a request already running always finishes, so
spend can end a little above it.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterable

from tollway.config import ALERT_THRESHOLDS, BudgetSpec
from tollway.meter.ledger import Ledger, LedgerRow
from tollway.meter.webhook import Webhook

_log = logging.getLogger(__name__)


class BudgetExceeded(Exception):
    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """[start, end) of the UTC day or calendar month holding `now` (unix seconds)."""
    t = dt.datetime.fromtimestamp(now, dt.timezone.utc)
    if period == "daily":
        start = t.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start + dt.timedelta(days=1)
    else:
        start = t.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (start + dt.timedelta(days=32)).replace(day=1)
    return start.timestamp(), end.timestamp()


def budget_name(spec: BudgetSpec) -> str:
    scope, name = spec.scope
    return f"{scope}:{name}:{spec.period}"


class Budgets:
    def __init__(self, specs: list[BudgetSpec], ledger: Ledger, webhook: Webhook | None = None,
                 clock: Callable[[], float] = time.time):
        self.specs, self.ledger, self.webhook, self.clock = specs, ledger, webhook, clock
        self._spent: dict[tuple[str, float], float] = {}  # (budget, period start) -> dollars
        self._claimed: set[tuple[str, float, float]] = set()
        self._lock = threading.Lock()

    def applicable(self, key: str, tags: Iterable[str]) -> list[BudgetSpec]:
        tags = set(tags)
        return [b for b in self.specs if (b.key is not None and b.key == key) or (b.tag is not None and b.tag in tags)]

    def check(self, key: str, tags: Iterable[str]) -> None:
        """Refuse a new request whose key or a tag has reached a hard-capped budget."""
        now = self.clock()
        for spec in self.applicable(key, tags):
            if not spec.hard_cap:
                continue
            start, end = period_bounds(spec.period, now)
            with self._lock:
                spent = self._current(spec, start)
            if spent >= spec.limit:
                scope, name = spec.scope
                resets = dt.datetime.fromtimestamp(end, dt.timezone.utc).isoformat()
                raise BudgetExceeded(f"the {spec.period} budget of {scope} {name!r} is spent (${spent:.4f} of "
                                     f"${spec.limit:.4f}); it resets at {resets}", retry_after=max(1, int(end - now)))

    def add(self, row: LedgerRow) -> None:
        """Count a request against its budgets, and send the alerts it crosses. The row is
        already in the ledger: a period read from the ledger here counts it."""
        now = self.clock()
        for spec in self.applicable(row.key, row.tags):
            start, _ = period_bounds(spec.period, now)
            name = budget_name(spec)
            with self._lock:
                known = (name, start) in self._spent
                spent = self._current(spec, start) + (row.price if known else 0.0)
                self._spent[(name, start)] = spent
                crossed = [t for t in ALERT_THRESHOLDS if spent >= t * spec.limit and (name, start, t) not in self._claimed]
                self._claimed.update((name, start, t) for t in crossed)
            for threshold in crossed:
                if self.ledger.claim_alert(name, start, threshold, now):
                    self._alert(spec, start, threshold, spent)

    def burn(self) -> list[dict]:
        """Every budget's spend in its current period, against its limit (end: when it resets)."""
        now = self.clock()
        out = []
        for spec in self.specs:
            start, end = period_bounds(spec.period, now)
            with self._lock:
                spent = self._current(spec, start)
            scope, name = spec.scope
            out.append({"budget": budget_name(spec), "scope": scope, "name": name, "period": spec.period,
                        "spent": spent, "limit": spec.limit, "hard_cap": spec.hard_cap, "end": end})
        return out

    def _current(self, spec: BudgetSpec, start: float) -> float:
        key = (budget_name(spec), start)
        if key not in self._spent:
            self._spent = {k: v for k, v in self._spent.items() if k[0] != key[0]}  # earlier periods are done
            self._spent[key] = self.ledger.spent(*spec.scope, since=start)
        return self._spent[key]

    def _alert(self, spec: BudgetSpec, start: float, threshold: float, spent: float) -> None:
        scope, name = spec.scope
        payload = {"type": "budget_alert", "budget": budget_name(spec), "scope": scope, "name": name,
                   "period": spec.period, "period_start": dt.datetime.fromtimestamp(start, dt.timezone.utc).isoformat(),
                   "threshold": threshold, "spent": round(spent, 6), "limit": spec.limit, "hard_cap": spec.hard_cap}
        _log.warning("budget %s reached %d%%: $%.4f of $%.4f", payload["budget"], round(threshold * 100), spent, spec.limit)
        if self.webhook is not None:
            self.webhook.send(payload)
