"""Budgets on a real ledger, in SQLite and in PostgreSQL: periods, thresholds, once-per-period
alerts (across restarts), the hard cap with holds for requests in flight, holds of a server that
died lapsing, the cap holding for two servers spending at once from many threads, and webhook
delivery with retry to a real local receiver."""
from __future__ import annotations

import datetime as dt
import gc
import random
import threading
import time
import warnings

import pytest

from tollway.config import BudgetSpec
from tollway.meter.budgets import HOLD_TTL, BudgetExceeded, Budgets, period_bounds
from tollway.meter.ledger import NANOS, Ledger, LedgerRow
from tollway.meter.webhook import Webhook
from tollway.storage.database import Database

from webhook_receiver import Receiver


def utc(*args) -> float:
    return dt.datetime(*args, tzinfo=dt.timezone.utc).timestamp()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def spend(rid, price, key="alice", tags=(), created=0.0):
    return LedgerRow(rid, created, key, "standard", "m", 10, 10, 0, None, None, 1.0, 0.1, 0.0001, price, "stop",
                     list(tags))


def test_period_bounds():
    assert period_bounds("daily", utc(2026, 11, 29, 13, 5)) == (utc(2026, 11, 29), utc(2026, 11, 30))
    assert period_bounds("monthly", utc(2026, 12, 31, 23, 59)) == (utc(2026, 12, 1), utc(2027, 1, 1))
    assert period_bounds("monthly", utc(2027, 2, 10)) == (utc(2027, 2, 1), utc(2027, 3, 1))


def test_alerts_fire_once_each_the_cap_refuses_and_the_next_period_restores(store_target, receiver):
    now = [utc(2026, 11, 29, 10)]
    webhook = Webhook(receiver.url, backoff=0.01)
    budgets = Budgets([BudgetSpec(limit=1.0, key="alice", period="daily")], Ledger(store_target), webhook,
                      clock=lambda: now[0])

    def run(rid, price, key="alice", at_most=None):
        budgets.reserve(rid, key, [], price if at_most is None else at_most)
        budgets.settle(spend(rid, price, key, created=now[0]))

    run("r1", 0.3)
    assert receiver.wait_for(0) == []
    run("r2", 0.3)  # 0.6: crosses 50%
    run("r3", 0.1, at_most=0.2)  # 0.7: nothing new; billed less than it held
    run("bob", 5.0, key="bob")  # another key's spend counts against nothing here
    run("r4", 0.15)  # 0.85: crosses 80%
    with pytest.raises(BudgetExceeded, match=r"has \$0.150000 left of \$1.000000, and this request may cost up to"):
        budgets.reserve("r5", "alice", [], 0.2)
    run("r5", 0.15)  # exactly the rest: 1.0, crosses 100%
    alerts = receiver.wait_for(3)
    assert [a["threshold"] for a in alerts] == [0.5, 0.8, 1.0]
    assert alerts[0]["name"] == "alice" and alerts[0]["period"] == "daily" and alerts[0]["limit"] == 1.0
    assert alerts[2]["spent"] == pytest.approx(1.0)
    with pytest.raises(BudgetExceeded, match="daily budget of key 'alice' is spent") as refused:
        budgets.reserve("r6", "alice", [], 0.0)
    assert refused.value.retry_after == 14 * 3600
    assert [b["spent"] for b in budgets.burn()] == [pytest.approx(1.0)]

    # A restart (a fresh store on the same database) knows the spend and does not repeat the alerts.
    restarted = Budgets(budgets.specs, Ledger(store_target), webhook, clock=lambda: now[0])
    with pytest.raises(BudgetExceeded):
        restarted.reserve("r6", "alice", [], 0.01)
    restarted.settle(spend("r6", 0.1, created=now[0]))  # a request no hold covered still counts
    time.sleep(0.2)
    assert len(receiver.received) == 3

    # The next day the budget is fresh, and its alerts can fire again.
    now[0] = utc(2026, 11, 30, 0, 0, 1)
    restarted.reserve("r7", "alice", [], 0.6)
    restarted.settle(spend("r7", 0.6, created=now[0]))
    assert [a["threshold"] for a in receiver.wait_for(4)] == [0.5, 0.8, 1.0, 0.5]
    budgets.close()
    restarted.close()
    webhook.close()


def test_tag_budgets_and_soft_budgets(store_target):
    budgets = Budgets([BudgetSpec(limit=1.0, tag="team=x"), BudgetSpec(limit=1.0, key="carol", hard_cap=False)],
                      Ledger(store_target), clock=lambda: utc(2026, 11, 29))
    for rid, key, tags in (("a", "alice", ["team=x"]), ("c", "carol", [])):
        budgets.settle(spend(rid, 2.0, key, tags, created=utc(2026, 11, 29)))
    with pytest.raises(BudgetExceeded, match="tag 'team=x'"):
        budgets.reserve("d", "dave", ["other", "team=x"], 0.01)
    budgets.reserve("e", "alice", [], 0.5)  # the tag's budget, not alice's
    budgets.reserve("f", "carol", [], 5.0)  # over, but alerts only


def test_holds_count_until_their_request_settles_or_is_released(store_target):
    budgets = Budgets([BudgetSpec(limit=1.0, key="alice")], Ledger(store_target))
    budgets.reserve("r1", "alice", [], 0.6)
    with pytest.raises(BudgetExceeded, match="held by requests in flight") as refused:
        budgets.reserve("r2", "alice", [], 0.6)
    assert refused.value.retry_after == 1
    budgets.release("r1")  # refused further on (say, a rate limit): it never ran
    budgets.reserve("r2", "alice", [], 0.6)
    budgets.settle(spend("r2", 0.5, created=time.time()))  # ended early: billed less than held
    budgets.reserve("r3", "alice", [], 0.5)  # 0.5 spent, nothing else held
    budgets.close()  # r3 is still held: stop its renewals before the database goes


def test_a_call_a_fleet_retries_is_held_and_billed_once(store_target):
    """Replica A billed call r1, then died before answering; the ingress retried r1 on B.
    Replica A also died holding r2; its retry on B takes that hold over."""
    spec = BudgetSpec(limit=1.0, key="alice")
    a, b = Budgets([spec], Ledger(store_target)), Budgets([spec], Ledger(store_target))
    now = time.time()
    a.reserve("r1", "alice", [], 0.6)
    a.settle(spend("r1", 0.4, created=now))
    b.reserve("r1", "alice", [], 0.6)  # 0.4 spent: fits
    b.settle(spend("r1", 0.4, created=now))
    assert [r.id for r in Ledger(store_target).rows()] == ["r1"]
    assert b.burn()[0]["spent"] == pytest.approx(0.4)
    a.reserve("r2", "alice", [], 0.5)
    a.close()  # A is gone: its hold on r2 stays until it lapses
    b.reserve("r2", "alice", [], 0.5)  # counted once: 0.4 + 0.5 fits, where 0.4 + 0.5 + 0.5 would not
    with pytest.raises(BudgetExceeded):
        b.reserve("r3", "alice", [], 0.2)  # r2's one hold still counts
    b.settle(spend("r2", 0.5, created=now))
    assert sorted(r.id for r in Ledger(store_target).rows()) == ["r1", "r2"]
    assert b.burn()[0]["spent"] == pytest.approx(0.9)
    b.reserve("r4", "alice", [], 0.1)  # r2's hold is gone with its settling, A's with it
    b.close()


def test_a_dead_servers_holds_lapse_and_a_live_one_keeps_them(store_target):
    now = [utc(2026, 11, 29, 10)]
    spec = BudgetSpec(limit=1.0, key="alice", period="daily")
    alive, dead = (Budgets([spec], Ledger(store_target), clock=lambda: now[0]) for _ in range(2))
    alive.reserve("a", "alice", [], 0.4)
    dead.reserve("d", "alice", [], 0.5)
    dead.close()  # it never settles "d"
    later = Budgets([spec], Ledger(store_target), clock=lambda: now[0])
    with pytest.raises(BudgetExceeded, match="held by requests in flight"):
        later.reserve("x", "alice", [], 0.2)
    now[0] += HOLD_TTL / 2
    alive.renew()  # as its thread does while it runs
    now[0] += HOLD_TTL / 2 + 1
    later.reserve("x", "alice", [], 0.6)  # the dead server's 0.5 lapsed; the live one's 0.4 did not
    with pytest.raises(BudgetExceeded, match="held by requests in flight"):
        later.reserve("y", "alice", [], 0.01)
    alive.close()
    later.close()


def test_ten_dimes_fill_a_dollar_cap_exactly(store_target):
    """Summed as floats, ten holds or spends of $0.10 are $0.9999999999999999: short of the cap,
    so a request for a nano-dollar or nothing would pass it and the 100% alert would not fire."""
    assert sum([0.1] * 10) != 1.0  # the trap
    now = utc(2026, 11, 29, 10)
    ledger = Ledger(store_target)
    budgets = Budgets([BudgetSpec(limit=1.0, key="alice", period="daily")], ledger, clock=lambda: now)
    for i in range(10):
        budgets.reserve(f"r{i}", "alice", [], 0.1)
    with pytest.raises(BudgetExceeded, match="held by requests in flight"):
        budgets.reserve("nano", "alice", [], 1e-9)  # ten holds are the whole dollar
    for i in range(10):
        budgets.settle(spend(f"r{i}", 0.1, created=now))
    with pytest.raises(BudgetExceeded, match=r"is spent \(\$1.000000 of \$1.000000\)"):
        budgets.reserve("r10", "alice", [], 0.1)
    with pytest.raises(BudgetExceeded, match="is spent"):
        budgets.reserve("free", "alice", [], 0.0)
    assert budgets.burn()[0]["spent"] == 1.0
    assert ledger.database.query("SELECT spent_nanos FROM budget_spend") == [(NANOS,)]
    assert ledger.database.query("SELECT threshold FROM alerts ORDER BY threshold") == [(0.5,), (0.8,), (1.0,)]
    budgets.close()


# The budgets' tables as tollway wrote them before money was exact: dollars as floats.
_FLOAT_MONEY_SCHEMA = """
CREATE TABLE budget_spend (budget TEXT NOT NULL, period_start REAL NOT NULL, spent REAL NOT NULL,
    PRIMARY KEY (budget, period_start));
CREATE TABLE budget_holds (request_id TEXT NOT NULL, budget TEXT NOT NULL, period_start REAL NOT NULL,
    dollars REAL NOT NULL, owner TEXT NOT NULL, expires REAL NOT NULL, PRIMARY KEY (request_id, budget));
CREATE INDEX budget_holds_budget ON budget_holds(budget, period_start);
"""


def test_budgets_with_float_money_are_migrated_with_their_spend_and_holds(store_target):
    now = utc(2026, 11, 29, 10)
    start, _ = period_bounds("daily", now)
    old = Database(store_target)
    old.create_schema(_FLOAT_MONEY_SCHEMA)
    old.run("INSERT INTO budget_spend VALUES ('key:alice:daily', ?, 0.7)", (start,))
    old.run("INSERT INTO budget_holds VALUES ('r1', 'key:alice:daily', ?, 0.2, 'old server', ?)", (start, now + 60))
    old.close()
    spec = BudgetSpec(limit=1.0, key="alice", period="daily")
    budgets = Budgets([spec], Ledger(store_target), clock=lambda: now)  # its ledger is empty: nothing to re-seed from
    assert budgets.burn()[0]["spent"] == 0.7
    budgets.reserve("r2", "alice", [], 0.1)  # 0.7 spent + r1's 0.2 held + 0.1: the dollar, exactly
    with pytest.raises(BudgetExceeded, match=r"\$0.700000 spent and \$0.300000 held"):
        budgets.reserve("r3", "alice", [], 1e-9)
    reopened = Budgets([spec], Ledger(store_target), clock=lambda: now)  # migrated once: nothing changes
    assert reopened.database.query("SELECT spent_nanos FROM budget_spend") == [(700_000_000,)]
    assert sorted(reopened.database.query("SELECT request_id, held_nanos, owner FROM budget_holds")) == [
        ("r1", 200_000_000, "old server"), ("r2", 100_000_000, budgets.owner)]
    with reopened.database.connect() as db:
        assert "spent" not in db.columns("budget_spend") and "dollars" not in db.columns("budget_holds")
    reopened.settle(spend("r1", 0.2, created=now))  # the old server's request, retried here
    assert reopened.burn()[0]["spent"] == 0.9
    budgets.close()
    reopened.close()


PRICE = 0.125  # exact in binary: the sums below are exact too
ADMITTED = 40


def test_two_servers_spending_at_once_never_pass_the_cap(store_target):
    """Two servers (two stores, two connection pools, one database) spend against one key's cap
    from eight threads each; each request holds its price while it "runs", then settles."""
    servers = [Budgets([BudgetSpec(limit=ADMITTED * PRICE, key="alice", period="daily")], Ledger(store_target))
               for _ in range(2)]
    outcomes, lock = [], threading.Lock()

    def client(budgets: Budgets, worker: int) -> None:
        rng = random.Random(worker)
        for i in range(8):
            rid = f"w{worker}-{i}"
            try:
                budgets.reserve(rid, "alice", [], PRICE)
            except BudgetExceeded:
                with lock:
                    outcomes.append("refused")
                continue
            time.sleep(rng.uniform(0, 0.02))  # generating: the hold is all that stands for it
            budgets.settle(spend(rid, PRICE, created=time.time()))
            with lock:
                outcomes.append("served")

    threads = [threading.Thread(target=client, args=(servers[w % 2], w)) for w in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert outcomes.count("served") == ADMITTED and outcomes.count("refused") == 16 * 8 - ADMITTED
    ledger = Ledger(store_target)
    rows = ledger.rows()
    assert len(rows) == ADMITTED and sum(r.price for r in rows) == ADMITTED * PRICE
    assert [b["spent"] for b in servers[0].burn()] == [ADMITTED * PRICE]
    assert ledger.database.query("SELECT COUNT(*) FROM budget_holds") == [(0,)]
    for budgets in servers:
        budgets.close()


def test_webhook_retries_until_delivered():
    receiver = Receiver(failures=2)
    gc.collect()  # what earlier tests left for the collector is not this test's
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            webhook = Webhook(receiver.url, attempts=4, backoff=0.01)
            webhook.send({"hello": 1})
            assert receiver.wait_for(1) == [{"hello": 1}]
            assert receiver.attempts == 3
            webhook.close()
            gc.collect()
        # The refused attempts' connections were closed, not left to the garbage collector.
        assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        receiver.close()


def test_webhook_gives_up_and_logs(caplog):
    webhook = Webhook("http://127.0.0.1:9/nothing-listens", attempts=2, backoff=0.01, timeout=1)
    webhook.send({"hello": 1})
    webhook.close()
    assert "gave up after 2 attempts" in caplog.text
