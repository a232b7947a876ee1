"""Budgets on a real ledger: periods, thresholds, once-per-period alerts (across restarts),
the hard cap, and webhook delivery with retry to a real local receiver."""
from __future__ import annotations

import datetime as dt
import time

import pytest

from tollway.config import BudgetSpec
from tollway.meter.budgets import BudgetExceeded, Budgets, period_bounds
from tollway.meter.ledger import Ledger, LedgerRow
from tollway.meter.webhook import Webhook

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


def test_alerts_fire_once_each_the_cap_refuses_and_the_next_period_restores(tmp_path, receiver):
    now = [utc(2026, 11, 29, 10)]
    ledger = Ledger(tmp_path / "ledger.sqlite")
    webhook = Webhook(receiver.url, backoff=0.01)
    budgets = Budgets([BudgetSpec(limit=1.0, key="alice", period="daily")], ledger, webhook, clock=lambda: now[0])

    def record(rid, price, key="alice"):
        row = spend(rid, price, key, created=now[0])
        ledger.record(row)
        budgets.add(row)

    record("r1", 0.3)
    budgets.check("alice", [])
    assert receiver.wait_for(0) == []
    record("r2", 0.3)  # 0.6: crosses 50%
    record("r3", 0.1)  # 0.7: nothing new
    record("bob", 5.0, key="bob")  # another key's spend counts against nothing here
    record("r4", 0.15)  # 0.85: crosses 80%
    budgets.check("alice", [])  # still under the cap
    record("r5", 0.5)  # 1.35: crosses 100% (a request that was running ends above the cap)
    alerts = receiver.wait_for(3)
    assert [a["threshold"] for a in alerts] == [0.5, 0.8, 1.0]
    assert alerts[0]["name"] == "alice" and alerts[0]["period"] == "daily" and alerts[0]["limit"] == 1.0
    assert alerts[2]["spent"] == pytest.approx(1.35)
    with pytest.raises(BudgetExceeded, match="daily budget of key 'alice' is spent") as refused:
        budgets.check("alice", [])
    assert refused.value.retry_after == 14 * 3600
    budgets.check("bob", [])  # no budget for bob

    # A restart reads the spend back from the ledger and does not repeat the alerts.
    restarted = Budgets(budgets.specs, ledger, webhook, clock=lambda: now[0])
    with pytest.raises(BudgetExceeded):
        restarted.check("alice", [])
    row = spend("r6", 0.1, created=now[0])
    ledger.record(row)
    restarted.add(row)
    time.sleep(0.2)
    assert len(receiver.received) == 3

    # The next day the budget is fresh, and its alerts can fire again.
    now[0] = utc(2026, 11, 30, 0, 0, 1)
    restarted.check("alice", [])
    row = spend("r7", 0.6, created=now[0])
    ledger.record(row)
    restarted.add(row)
    assert [a["threshold"] for a in receiver.wait_for(4)] == [0.5, 0.8, 1.0, 0.5]
    webhook.close()


def test_tag_budgets_and_soft_budgets(tmp_path):
    ledger = Ledger(tmp_path / "ledger.sqlite")
    budgets = Budgets([BudgetSpec(limit=1.0, tag="team=x"), BudgetSpec(limit=1.0, key="carol", hard_cap=False)],
                      ledger, clock=lambda: utc(2026, 11, 29))
    for rid, key, tags in (("a", "alice", ["team=x"]), ("c", "carol", [])):
        row = spend(rid, 2.0, key, tags, created=utc(2026, 11, 29))
        ledger.record(row)
        budgets.add(row)
    with pytest.raises(BudgetExceeded, match="tag 'team=x'"):
        budgets.check("dave", ["other", "team=x"])
    budgets.check("alice", [])  # the tag's budget, not alice's
    budgets.check("carol", [])  # over, but alerts only


def test_webhook_retries_until_delivered():
    receiver = Receiver(failures=2)
    try:
        webhook = Webhook(receiver.url, attempts=4, backoff=0.01)
        webhook.send({"hello": 1})
        assert receiver.wait_for(1) == [{"hello": 1}]
        assert receiver.attempts == 3
        webhook.close()
    finally:
        receiver.close()


def test_webhook_gives_up_and_logs(caplog):
    webhook = Webhook("http://127.0.0.1:9/nothing-listens", attempts=2, backoff=0.01, timeout=1)
    webhook.send({"hello": 1})
    webhook.close()
    assert "gave up after 2 attempts" in caplog.text
