"""The meter through a real server: cost and price in every response, ledger rows on disk before
the response ends, /v1/usage, budgets end to end, and no lost rows after a SIGKILL."""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tollway.config import BudgetSpec, KeySpec, default_tiers
from tollway.meter.ledger import MONEY, NANOS
from tollway.meter.webhook import Webhook
from tollway.server.call_ids import CALL_ID, FLEET_SECRET, new_call_id
from tollway.server.keys import Gatekeeper

from live_server import MODEL, free_port, make_meter, running_server, wait_until_up
from webhook_receiver import Receiver

PROMPT = list(range(1000, 1010))  # 10 tokens, whatever the tokenizer
NEW = 5
STANDARD = default_tiers()["standard"]
NANO = 1 / NANOS
PRICE = (len(PROMPT) * STANDARD.price_input_per_m + NEW * STANDARD.price_output_per_m) / 1e6
# The budgets' clock; a test moves it a day on. The ledger dates requests by the real clock, and a
# new day's spend is seeded from it: set when the module's server starts, at noon of that UTC day,
# so that a suite collected before midnight and run after it does not count today's requests twice.
NOW = [0.0]


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def metered(make_engine, tmp_path_factory, receiver):
    ledger = tmp_path_factory.mktemp("meter") / "ledger.sqlite"
    NOW[0] = time.time() // 86400 * 86400 + 43200
    # Five requests' worth, a hair under: 50% at the 3rd, 80% at the 4th, the cap at the 5th.
    budget = BudgetSpec(limit=5 * PRICE * (1 - 1e-9), key="capped", period="daily")
    meter = make_meter(ledger, [budget], Webhook(receiver.url, backoff=0.01), clock=lambda: NOW[0])
    keys = [KeySpec("sk-alice", "alice"), KeySpec("sk-bob", "bob"), KeySpec("sk-capped", "capped")]
    for details in running_server(make_engine(), gatekeeper=Gatekeeper(keys), meter=meter):
        yield {**details, "meter": meter, "ledger": ledger}
    meter.budgets.webhook.close()


def _client(server, key):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=key)


def _row(ledger, rid):
    """The request's ledger row as on disk, its money in dollars (stored as nano-dollars)."""
    db = sqlite3.connect(ledger)  # a fresh connection: what is on disk
    db.row_factory = sqlite3.Row
    row = db.execute("SELECT * FROM requests WHERE id = ?", (rid,)).fetchone()
    if row is None:
        return None
    row = dict(row)
    for name in MONEY:
        row[name] = row.pop(f"{name}_nanos") / NANOS
    return row


def test_a_response_carries_its_cost_and_its_row_is_already_on_disk(metered):
    raw = httpx.post(metered["url"] + "/v1/completions", headers={"Authorization": "Bearer sk-alice"},
                     json={"model": MODEL, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True})
    body = raw.json()
    row = _row(metered["ledger"], body["id"])  # read right after the response, no waiting
    assert row is not None and row["key"] == "alice" and row["tier"] == "standard"
    assert (row["prompt_tokens"], row["completion_tokens"]) == (len(PROMPT), NEW)
    assert body["usage"]["price"] == pytest.approx(PRICE) == row["price"]
    assert 0 < row["engine_seconds"] <= row["e2e_seconds"]
    # the ledger keeps whole nano-dollars
    assert row["cost"] == pytest.approx(row["engine_seconds"] * 0.001, abs=NANO)  # 3.6 $/h
    assert body["usage"]["cost"] == pytest.approx(row["cost"], abs=NANO)
    assert float(raw.headers["x-tollway-cost"]) == pytest.approx(row["cost"], abs=NANO)
    assert row["ttft_seconds"] is not None and row["queue_seconds"] is not None


def test_a_stream_reports_cost_in_its_usage_chunk(metered):
    chunks = list(_client(metered, "sk-alice").completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    row = _row(metered["ledger"], chunks[-1].id)
    assert row is not None and row["cost"] > 0
    assert usage.model_extra["cost"] == pytest.approx(row["cost"], abs=NANO)
    assert usage.model_extra["price"] == pytest.approx(PRICE)


def test_usage_groups_by_tier_tag_and_key_and_each_key_sees_its_own(metered):
    bob = _client(metered, "sk-bob")
    bob.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                service_tier="priority", metadata={"team": "search"},
                                extra_headers={"x-tollway-tags": "nightly, eval"})
    bob.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_headers={"x-tollway-tags": "eval"})
    get = lambda params, key="sk-bob": httpx.get(metered["url"] + "/v1/usage", params=params,  # noqa: E731
                                                 headers={"Authorization": f"Bearer {key}"})
    by_tag = {r["tag"]: r for r in get({"group_by": "tag"}).json()["data"]}
    assert by_tag["eval"]["requests"] == 2 and by_tag["nightly"]["requests"] == 1
    assert by_tag["team=search"]["requests"] == 1
    by_tier = get({"group_by": "tier"}).json()
    assert by_tier["object"] == "list"
    assert {r["tier"]: r["requests"] for r in by_tier["data"]} == {"fast": 1, "standard": 1}
    fast = next(r for r in by_tier["data"] if r["tier"] == "fast")
    assert fast["margin"] == pytest.approx(fast["price"] - fast["cost"])
    assert [r["key"] for r in get({"group_by": "key"}).json()["data"]] == ["bob"]  # not alice's
    assert get({"group_by": "tier", "start": "2999-01-01"}).json()["data"] == []
    bad = get({"group_by": "colour"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"
    assert get({"start": "soon"}).status_code == 400
    assert get({"group_by": "key"}, key="sk-nobody").status_code == 401


def test_budget_alerts_cap_and_reset_end_to_end(metered, receiver):
    capped = _client(metered, "sk-capped")

    def ask():
        return capped.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                         extra_body={"ignore_eos": True})

    thresholds = []
    for _ in range(5):
        ask()
        time.sleep(0.3)  # alerts are POSTed from a background thread
        thresholds.append([a["threshold"] for a in receiver.received if a["name"] == "capped"])
    assert thresholds == [[], [], [0.5], [0.5, 0.8], [0.5, 0.8, 1.0]]
    with pytest.raises(openai.RateLimitError) as refused:
        ask()
    assert refused.value.code == "insufficient_quota" and "daily budget of key 'capped'" in refused.value.message
    assert int(refused.value.response.headers["retry-after"]) > 0
    assert refused.value.response.headers["x-should-retry"] == "false"  # nor did the client retry it
    assert refused.value.body["type"] == "insufficient_quota"
    _client(metered, "sk-alice").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)  # others go on
    NOW[0] += 86400  # the next day
    ask()
    time.sleep(0.3)
    assert [a["threshold"] for a in receiver.received if a["name"] == "capped"] == [0.5, 0.8, 1.0]


def test_a_fast_call_is_admitted_while_standard_ones_hold_every_worker_thread(metered, monkeypatch):
    """Admission's database work under a burst: standard calls whose budget hold is slow fill
    every thread of the server's default pool; a fast call's hold does not queue behind them."""
    budgets = metered["meter"].budgets
    gate, held = threading.Event(), threading.Semaphore(0)
    reserve = budgets.reserve

    def slow_reserve(request_id, key, tags, dollars):
        if "hold" in tags:
            held.release()
            gate.wait(120)
        return reserve(request_id, key, tags, dollars)

    monkeypatch.setattr(budgets, "reserve", slow_reserve)
    workers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    results: list[str] = []

    def standard() -> None:
        reply = _client(metered, "sk-bob").completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"x-tollway-tags": "hold"})
        results.append(reply.service_tier)

    threads = [threading.Thread(target=standard) for _ in range(workers + 2)]
    try:
        for t in threads:
            t.start()
        for _ in range(workers):
            assert held.acquire(timeout=60), "the standard calls never reached their budget hold"
        fast = _client(metered, "sk-alice").with_options(timeout=60, max_retries=0).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"service_tier": "priority"})
        assert fast.service_tier == "priority" and not gate.is_set() and results == []
    finally:
        gate.set()
        for t in threads:
            t.join(120)
    assert results == ["default"] * (workers + 2)


def test_a_fleet_call_retried_on_another_replica_is_billed_once(make_engine, tmp_path):
    """Two replicas on one ledger: the ingress names a call, and the replica it retries the call
    on (after the first billed it and failed to answer) answers it without billing it again.
    Without the fleet's secret, a named id is not taken."""
    ledger = tmp_path / "ledger.sqlite"
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0}
    call = new_call_id()
    for a in running_server(make_engine(), meter=make_meter(ledger), fleet_secret="s3cret"):
        for b in running_server(make_engine(), meter=make_meter(ledger), fleet_secret="s3cret"):
            named = {CALL_ID: call, FLEET_SECRET: "s3cret"}
            first = httpx.post(a["url"] + "/v1/completions", json=body, headers=named, timeout=60).json()
            retried = httpx.post(b["url"] + "/v1/completions", json=body, headers=named, timeout=60).json()
            assert first["id"] == retried["id"] == f"cmpl-{call}"
            assert first["choices"][0]["text"] == retried["choices"][0]["text"]
            forged = [httpx.post(b["url"] + "/v1/completions", json=body, headers={CALL_ID: call, **secret},
                                 timeout=60).json()["id"] for secret in ({FLEET_SECRET: "guess"}, {})]
            assert f"cmpl-{call}" not in forged and all(_row(ledger, rid) for rid in forged)
    db = sqlite3.connect(ledger)
    assert db.execute("SELECT COUNT(*) FROM requests WHERE id = ?", (f"cmpl-{call}",)).fetchone()[0] == 1
    assert db.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 3


@pytest.mark.slow  # a process of its own
def test_sigkill_under_load_loses_no_completed_row(tmp_path):
    """Every response that completed before the kill has its row in the ledger afterwards."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ledger = tmp_path / "ledger.sqlite"
    proc = subprocess.Popen([sys.executable, "-m", "tollway", "serve", "--port", str(port), "--data-dir",
                             str(tmp_path), "--keys-db", str(tmp_path / "keys.sqlite")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until_up(proc, url)
        deadline = time.time() + 300
        completed, lock, stop = [], threading.Lock(), threading.Event()

        def load(worker: int):
            with httpx.Client(timeout=60) as http:
                i = 0
                while not stop.is_set():
                    i += 1
                    try:
                        r = http.post(url + "/v1/completions",
                                      json={"model": MODEL, "prompt": [1000 + worker, 1001 + i], "max_tokens": 2 + i % 5})
                    except httpx.HTTPError:
                        return  # the server is gone
                    if r.status_code == 200:
                        with lock:
                            completed.append(r.json()["id"])

        workers = [threading.Thread(target=load, args=(w,)) for w in range(8)]
        for w in workers:
            w.start()
        while len(completed) < 20:
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        stop.set()
        for w in workers:
            w.join(60)
        proc.wait(10)
    finally:
        proc.kill()
        proc.wait(10)
    db = sqlite3.connect(ledger)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    ids = {r[0] for r in db.execute("SELECT id FROM requests")}
    assert len(completed) >= 20 and not set(completed) - ids
