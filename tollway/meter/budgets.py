"""Spending limits per API key or tag, per UTC day or calendar month, on billed dollars, held
for a whole fleet of servers that share one database (a single server is a fleet of one).

A hard-capped budget is never overspent. Admission holds the most a request could be billed
(its prompt and max_tokens at its lane's price) against every hard-capped budget it falls
under, refusing it if settled spend plus the holds of requests still running plus its own
would pass the limit; the check and the hold are one transaction in the database, so two
servers cannot both take the last dollar. When the request ends its ledger row, its billed
price added to the budgets' spend and the release of its hold are one transaction too.

A server renews its holds while it runs; those of a server that died lapse after HOLD_TTL,
giving their room back. Spend per budget and period is a row in the database, seeded from the
ledger the first time any server needs it. Money is kept in integer nano-dollars, as in the
ledger, so sums are exact: ten requests at $0.10 fill a $1.00 cap. Alerts at 50%, 80% and 100%
are claimed in the ledger, so each fires once per period across restarts and servers; they are
logged and POSTed to the webhook. Budgets without a hard cap only count and alert.
"""
from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable

from tollway.config import ALERT_THRESHOLDS, BudgetSpec
from tollway.meter.ledger import Ledger, LedgerRow, migrate_float_money, to_dollars, to_nanos
from tollway.meter.webhook import Webhook
from tollway.storage.database import Connection

_log = logging.getLogger(__name__)

HOLD_TTL = 120.0  # seconds a hold outlives its server's last renewal
_RENEW_EVERY = HOLD_TTL / 4

_SCHEMA = """
CREATE TABLE IF NOT EXISTS budget_spend (  -- settled (billed) money per budget and period
    budget TEXT NOT NULL,
    period_start REAL NOT NULL,
    spent_nanos BIGINT NOT NULL,
    PRIMARY KEY (budget, period_start)
);
CREATE TABLE IF NOT EXISTS budget_holds (  -- the most each running request can still be billed
    request_id TEXT NOT NULL,
    budget TEXT NOT NULL,
    period_start REAL NOT NULL,
    held_nanos BIGINT NOT NULL,
    owner TEXT NOT NULL,              -- the server holding it, which renews `expires` while it runs
    expires REAL NOT NULL,
    PRIMARY KEY (request_id, budget)
);
CREATE INDEX IF NOT EXISTS budget_holds_budget ON budget_holds(budget, period_start);
"""


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
        self.database = ledger.database
        self.database.create_schema(_SCHEMA)
        # Budgets written before money was exact kept dollars as floats.
        with self.database.schema_transaction() as db:
            migrate_float_money(db, "budget_spend", {"spent": "spent_nanos"})
            migrate_float_money(db, "budget_holds", {"dollars": "held_nanos"})
        self.owner = uuid.uuid4().hex  # this server, in the holds it takes
        self._held: dict[str, dict[str, float]] = {}  # request id -> {budget: period start} held for it
        self._claimed: set[tuple[str, float, float]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def applicable(self, key: str, tags: Iterable[str]) -> list[BudgetSpec]:
        tags = set(tags)
        return [b for b in self.specs if (b.key is not None and b.key == key) or (b.tag is not None and b.tag in tags)]

    def reserve(self, request_id: str, key: str, tags: Iterable[str], dollars: float) -> None:
        """Hold `dollars`, the most the request can be billed, against each hard-capped budget
        it falls under; raise BudgetExceeded (holding nothing) if one cannot take it."""
        capped = sorted((b for b in self.applicable(key, tags) if b.hard_cap), key=budget_name)
        if not capped:
            return
        now = self.clock()
        nanos = to_nanos(dollars)
        held = {}
        with self.database.transaction() as db:
            for spec in capped:  # in name order: two servers lock the same budgets in the same order
                name = budget_name(spec)
                start, end = period_bounds(spec.period, now)
                spent = self._spent(db, spec, start, end)
                db.execute("DELETE FROM budget_holds WHERE budget = ? AND period_start = ? AND expires <= ?",
                           (name, start, now))  # lapsed: their server died
                # Not counting a hold of this request's own: a fleet retrying a call on another
                # replica takes over the hold the first one left (see settle).
                holding = int(db.execute("SELECT COALESCE(SUM(held_nanos), 0) FROM budget_holds WHERE budget = ? "
                                         "AND period_start = ? AND request_id <> ?",
                                         (name, start, request_id)).fetchone()[0])
                limit = to_nanos(spec.limit)
                if spent >= limit or spent + holding + nanos > limit:
                    raise _refusal(spec, spent, holding, nanos, end, now)
                db.execute("INSERT INTO budget_holds (request_id, budget, period_start, held_nanos, owner, expires) "
                           "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (request_id, budget) DO UPDATE SET "
                           "period_start = excluded.period_start, held_nanos = excluded.held_nanos, "
                           "owner = excluded.owner, expires = excluded.expires",
                           (request_id, name, start, nanos, self.owner, now + HOLD_TTL))
                held[name] = start
        with self._lock:
            self._held[request_id] = held
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew_while_open, name="budget holds", daemon=True)
                self._renewer.start()

    def release(self, request_id: str) -> None:
        """Give back a request's holds: it was refused before it ran."""
        with self._lock:
            held = self._held.pop(request_id, None)
        if held:
            self.database.run("DELETE FROM budget_holds WHERE request_id = ?", (request_id,))

    def settle(self, row: LedgerRow) -> None:
        """Write a finished request's ledger row, add its price to its budgets' spend and
        release its holds, in one transaction; then send the alerts it crossed. A request whose
        row is there already is not billed again: a fleet gives a call the same id on every
        replica it tries, and retries it when a replica fails before answering, which may be
        after that replica billed it."""
        with self._lock:
            held = self._held.pop(row.id, {})
        now = self.clock()
        price = to_nanos(row.price)
        crossed = []
        with self.database.transaction() as db:
            billed = self.ledger.has(db, row.id)
            for spec in [] if billed else sorted(self.applicable(row.key, row.tags), key=budget_name):
                name = budget_name(spec)
                # A held request counts in the period it was admitted in.
                start, end = period_bounds(spec.period, held.get(name, now))
                before = self._spent(db, spec, start, end)  # read before the row is in the ledger
                db.execute("UPDATE budget_spend SET spent_nanos = spent_nanos + ? "
                           "WHERE budget = ? AND period_start = ?", (price, name, start))
                crossed += [(spec, start, t, before + price) for t in ALERT_THRESHOLDS
                            if before + price >= to_nanos(t * spec.limit)]
            if held:
                db.execute("DELETE FROM budget_holds WHERE request_id = ?", (row.id,))
            if not billed:
                self.ledger.write(db, row)
        for spec, start, threshold, spent in crossed:
            claim = (budget_name(spec), start, threshold)
            with self._lock:
                if claim in self._claimed:
                    continue
                self._claimed.add(claim)
            if self.ledger.claim_alert(*claim, now):
                self._alert(spec, start, threshold, to_dollars(spent))

    def burn(self) -> list[dict]:
        """Every budget's spend in its current period, against its limit (end: when it resets)."""
        now = self.clock()
        out = []
        with self.database.connect() as db:
            for spec in self.specs:
                start, end = period_bounds(spec.period, now)
                row = db.execute("SELECT spent_nanos FROM budget_spend WHERE budget = ? AND period_start = ?",
                                 (budget_name(spec), start)).fetchone()
                scope, name = spec.scope
                spent = row[0] if row else self.ledger.spent_nanos(db, scope, name, start, end)
                out.append({"budget": budget_name(spec), "scope": scope, "name": name, "period": spec.period,
                            "spent": to_dollars(spent),
                            "limit": spec.limit, "hard_cap": spec.hard_cap, "end": end})
        return out

    def close(self) -> None:
        """Stop renewing holds (those still taken lapse after HOLD_TTL)."""
        self._stop.set()

    def _spent(self, db: Connection, spec: BudgetSpec, start: float, end: float) -> int:
        """The budget's settled nano-dollars in the period starting at `start`, its row locked
        until the transaction ends; the row is first seeded from the ledger if no server has yet."""
        name = budget_name(spec)
        select = f"SELECT spent_nanos FROM budget_spend WHERE budget = ? AND period_start = ?{db.for_update}"
        row = db.execute(select, (name, start)).fetchone()
        if row is None:
            # Every ledger write for this budget seeds or updates this row first, and a second
            # server's seed waits on ours and then does nothing: no request counts twice.
            db.execute("INSERT INTO budget_spend (budget, period_start, spent_nanos) VALUES (?, ?, ?) "
                       "ON CONFLICT DO NOTHING", (name, start, self.ledger.spent_nanos(db, *spec.scope, start, end)))
            row = db.execute(select, (name, start)).fetchone()
        return row[0]

    def renew(self) -> None:
        """Push back the expiry of every hold this server has (its thread does, every 30 s)."""
        self.database.run("UPDATE budget_holds SET expires = ? WHERE owner = ?", (self.clock() + HOLD_TTL, self.owner))

    def _renew_while_open(self) -> None:
        while not self._stop.wait(_RENEW_EVERY):
            with self._lock:
                holding = bool(self._held)
            if holding:
                try:
                    self.renew()
                except Exception as e:  # noqa: BLE001 -- the database is away: try again next round
                    _log.warning("could not renew budget holds (retrying in %d s): %s", _RENEW_EVERY, e)

    def _alert(self, spec: BudgetSpec, start: float, threshold: float, spent: float) -> None:
        scope, name = spec.scope
        payload = {"type": "budget_alert", "budget": budget_name(spec), "scope": scope, "name": name,
                   "period": spec.period, "period_start": dt.datetime.fromtimestamp(start, dt.timezone.utc).isoformat(),
                   "threshold": threshold, "spent": round(spent, 6), "limit": spec.limit, "hard_cap": spec.hard_cap}
        _log.warning("budget %s reached %d%%: $%.4f of $%.4f", payload["budget"], round(threshold * 100), spent, spec.limit)
        if self.webhook is not None:
            self.webhook.send(payload)


def _refusal(spec: BudgetSpec, spent_nanos: int, holding_nanos: int, nanos: int, end: float,
             now: float) -> BudgetExceeded:
    limit = to_nanos(spec.limit)
    spent, holding, dollars = to_dollars(spent_nanos), to_dollars(holding_nanos), to_dollars(nanos)
    scope, name = spec.scope
    budget = f"the {spec.period} budget of {scope} {name!r}"
    resets = dt.datetime.fromtimestamp(end, dt.timezone.utc).isoformat()
    until_reset = max(1, int(end - now))
    if spent_nanos >= limit:
        return BudgetExceeded(f"{budget} is spent (${spent:.6f} of ${spec.limit:.6f}); it resets at {resets}",
                              until_reset)
    if spent_nanos + nanos > limit:
        return BudgetExceeded(f"{budget} has ${to_dollars(limit - spent_nanos):.6f} left of ${spec.limit:.6f}, "
                              f"and this request may cost up to ${dollars:.6f} (its prompt and max_tokens at its "
                              f"lane's price); lower max_tokens, or wait for the reset at {resets}", until_reset)
    return BudgetExceeded(f"{budget} is held by requests in flight (${spent:.6f} spent and ${holding:.6f} held, of "
                          f"${spec.limit:.6f}); this request may cost up to ${dollars:.6f}: retry when they finish", 1)
