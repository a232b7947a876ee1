"""The canary through a real server and the openai client: the promoted share is the setting's
within binomial error, by the seeded hash; un-entitled keys and explicit tiers are never in it;
promoted requests are billed as standard with the difference as the canary's cost; `tollway
report --canary`, /v1/usage/canary and /dashboard/data agree with figures recomputed from the
ledger's SQLite file, and the dashboard shows that comparison in headless Chromium."""
from __future__ import annotations

import math
import sqlite3

import httpx
import numpy as np
import openai
import pytest

from dashboard_browser import ARTIFACTS, dashboard_page, shown_values
from live_server import MODEL, make_meter, running_server
from tollway.cli import main
from tollway.config import CanaryConfig, KeySpec, load_server_config
from tollway.meter.bootstrap import ratio_interval
from tollway.server.canary import promoted
from tollway.server.keys import Gatekeeper

SHARE, SEED = 0.3, 7
ALL, NO_FAST, ADMIN = "sk-all", "sk-no-fast", "sk-admin"
MESSAGES = [{"role": "user", "content": "Count: one, two, three,"}]


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    ledger = tmp_path_factory.mktemp("canary") / "ledger.sqlite"
    keys = Gatekeeper([KeySpec(ALL, "all"), KeySpec(NO_FAST, "no-fast", ["standard", "batch"]),
                       KeySpec(ADMIN, "ops", admin=True)])
    canary = CanaryConfig(share=SHARE, seed=SEED, keys=["all", "no-fast"])
    meter = make_meter(ledger)
    for details in running_server(make_engine(), gatekeeper=keys, meter=meter, canary=canary):
        yield {**details, "ledger": ledger, "meter": meter}


def _client(server, key):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=key, max_retries=0, timeout=60)


def _ledger(server, where: str = "1", args=()) -> list[dict]:
    with sqlite3.connect(server["ledger"]) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute(f"SELECT * FROM requests WHERE {where} ORDER BY created", args)]


@pytest.fixture(scope="module")
def cheap_calls(server):
    """Many one-token calls from a fast-entitled key, half with service_tier auto, half with none."""
    with _client(server, ALL) as client:
        return [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0,
                                               **({"service_tier": "auto"} if i % 2 else {})) for i in range(240)]


def test_the_promoted_share_is_the_setting_within_binomial_error(server, cheap_calls):
    served = {r.id: r.service_tier for r in cheap_calls}
    # Each call's lane is its seeded hash's verdict, and the response says which lane served it.
    assert all(tier == ("priority" if promoted(SEED, rid, SHARE) else "default") for rid, tier in served.items())
    n, k = len(served), sum(tier == "priority" for tier in served.values())
    assert abs(k / n - SHARE) <= 3 * math.sqrt(SHARE * (1 - SHARE) / n), (k, n)
    rows = {r["id"]: r for r in _ledger(server, "key = 'all' AND completion_tokens = 1")}
    assert {rid: rows[rid]["canary"] for rid in served} == \
        {rid: "promoted" if tier == "priority" else "control" for rid, tier in served.items()}
    assert all(rows[rid]["tier"] == ("fast" if tier == "priority" else "standard") for rid, tier in served.items())


def test_promoted_calls_are_billed_as_standard_and_the_difference_is_the_canarys_cost(server, cheap_calls):
    tiers = server["meter"].price_card.tiers
    for row in _ledger(server, "key = 'all' AND canary IS NOT NULL"):
        billed = {t: round((row["prompt_tokens"] * tiers[t].price_input_per_m
                            + row["completion_tokens"] * tiers[t].price_output_per_m) / 1e6 * 1e9)
                  for t in ("fast", "standard")}
        assert row["price_nanos"] == billed["standard"]
        assert row["canary_cost_nanos"] == (billed["fast"] - billed["standard"] if row["canary"] == "promoted" else 0)
    assert any(r["canary_cost_nanos"] > 0 for r in _ledger(server, "canary = 'promoted'"))


def test_un_entitled_keys_and_chosen_tiers_are_never_promoted(server):
    with _client(server, NO_FAST) as client:
        calls = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, service_tier="auto",
                                                extra_headers={"x-tollway-tags": "no-fast"}) for _ in range(30)]
    with _client(server, ALL) as client:
        chosen = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                                 service_tier="default", extra_headers={"x-tollway-tags": "chosen"}) for _ in range(30)]
    # Thirty calls at 0.3: had they been eligible, some would have been promoted (0.7^30 < 0.0001).
    assert sum(promoted(SEED, c.id, SHARE) for c in calls + chosen) > 0
    assert {c.service_tier for c in calls + chosen} == {"default"}
    rows = _ledger(server, "tags LIKE '%no-fast%' OR tags LIKE '%chosen%'")
    assert len(rows) == 60 and {(r["tier"], r["canary"]) for r in rows} == {("standard", None)}


def _recomputed(rows: list[dict], arm: str) -> dict:
    """The report's figures for one arm, straight from the ledger's columns."""
    rows = [r for r in rows if r["canary"] == arm]
    ttft = [r["ttft_seconds"] for r in rows]
    tpot = [(r["e2e_seconds"] - r["ttft_seconds"]) / (r["completion_tokens"] - 1) for r in rows
            if r["completion_tokens"] >= 2]
    tokens = sum(r["completion_tokens"] for r in rows)
    return {"ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99),
            "tpot_p50": np.percentile(tpot, 50), "tpot_p99": np.percentile(tpot, 99),
            "e2e_p50": np.percentile([r["e2e_seconds"] for r in rows], 50),
            "e2e_p99": np.percentile([r["e2e_seconds"] for r in rows], 99),
            "cost_per_request": np.mean([r["cost_nanos"] / 1e9 for r in rows]),
            "price_per_request": np.mean([r["price_nanos"] / 1e9 for r in rows]),
            "cost_per_m_output": sum(r["cost_nanos"] for r in rows) / 1e9 / tokens * 1e6,
            "price_per_m_output": sum(r["price_nanos"] for r in rows) / 1e9 / tokens * 1e6,
            "n": len(rows), "n_tpot": len(tpot)}


def test_the_report_equals_figures_recomputed_from_the_ledger(server, cheap_calls, capsys):
    with _client(server, ALL) as client:  # calls with several tokens, so each has a TPOT
        for i in range(40):
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, seed=i)
    rows = _ledger(server, "canary IS NOT NULL")
    figures = {arm: _recomputed(rows, arm) for arm in ("promoted", "control")}
    comparison = httpx.get(server["url"] + "/v1/usage/canary", headers={"Authorization": f"Bearer {ALL}"}).json()
    assert comparison["requests"] == {arm: figures[arm]["n"] for arm in figures}
    for name, figure in comparison["metrics"].items():
        for arm in figures:
            assert figure[arm] == pytest.approx(figures[arm][name], rel=1e-9), (name, arm)
        assert figure["ratio"] == pytest.approx(figures["promoted"][name] / figures["control"][name], rel=1e-9)
        counted = "n_tpot" if name.startswith("tpot") else "n"
        assert figure["n"] == {arm: figures[arm][counted] for arm in figures}
        lo, hi = figure["ci"]
        assert lo <= hi and figure["significant"] == (not lo <= 1 <= hi)
    assert comparison["canary_cost"] == pytest.approx(sum(r["canary_cost_nanos"] for r in rows) / 1e9)

    assert main(["report", "--canary", "--ledger", str(server["ledger"])]) == 0
    printed = capsys.readouterr().out
    assert comparison["summary"] in printed and comparison["summary"].startswith("fast mode ")
    tpot_line = next(line for line in printed.splitlines() if line.startswith("tpot_p50"))
    assert f"{figures['promoted']['tpot_p50']:.6f}" in tpot_line and f"{figures['control']['tpot_p50']:.6f}" in tpot_line

    # The dashboard shows the same comparison (its window, the last hour, holds every row here).
    data = httpx.get(server["url"] + "/dashboard/data", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert data["canary"]["share"] == SHARE and data["canary"]["requests"] == comparison["requests"]


def test_the_dashboard_shows_the_canary_comparison_in_chromium(server, cheap_calls):
    data = httpx.get(server["url"] + "/dashboard/data", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert data["canary"]["summary"].startswith("fast mode ")
    with dashboard_page(server["url"], ADMIN) as (view, problems):
        shown = shown_values(view)["canary"]
        view.screenshot(path=str(ARTIFACTS / "dashboard-canary.png"), full_page=True)
    assert problems == {"errors": [], "elsewhere": [], "failed": []}
    # No traffic meanwhile, and the bootstrap is seeded: the page shows the very comparison fetched.
    assert shown == f"canary, 30% of eligible requests promoted, last 1.0 h: {data['canary']['summary']}"


def test_usage_canary_refuses_a_bad_window(server):
    response = httpx.get(server["url"] + "/v1/usage/canary?start=yesterday", headers={"Authorization": f"Bearer {ALL}"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "start"


def test_the_bootstrap_interval_is_seeded_and_holds_the_true_ratio():
    rng = np.random.default_rng(1)
    a, b = rng.exponential(2.0, 400), rng.exponential(1.0, 400)
    median = lambda x: np.median(x, axis=-1)  # noqa: E731
    interval = ratio_interval((a,), (b,), median, seed=3)
    assert interval == ratio_interval((a,), (b,), median, seed=3)
    assert interval[0] < 2.0 < interval[1] and interval[1] - interval[0] < 1.0
    assert ratio_interval((a,), (np.zeros(10),), median) is None  # nothing to divide by


def test_the_canary_table_and_its_bad_values(tmp_path):
    config = tmp_path / "tollway.toml"
    config.write_text('[canary]\nshare = 0.1\nseed = 3\ntags = ["team=chat"]\nbill_promoted = true\n')
    assert load_server_config(config).canary == CanaryConfig(0.1, 3, [], ["team=chat"], True)
    config.write_text("[canary]\nshare = 1.5\n")
    with pytest.raises(ValueError, match="canary share must be in"):
        load_server_config(config)
    config.write_text("[canary]\nportion = 0.1\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_server_config(config)


def test_bill_promoted_bills_the_fast_price_with_no_canary_cost(make_engine, tmp_path):
    meter = make_meter(tmp_path / "ledger.sqlite")
    for details in running_server(make_engine(), meter=meter,
                                  canary=CanaryConfig(share=1.0, bill_promoted=True)):
        with _client(details, "unused") as client:
            calls = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2) for _ in range(5)]
    assert {c.service_tier for c in calls} == {"priority"}
    fast = meter.price_card.tiers["fast"]
    for row in meter.ledger.rows():
        assert (row.tier, row.canary, row.canary_cost) == ("fast", "promoted", 0.0)
        assert row.price == pytest.approx((row.prompt_tokens * fast.price_input_per_m
                                           + row.completion_tokens * fast.price_output_per_m) / 1e6)


def test_a_ledger_from_before_the_canary_gains_its_columns(tmp_path):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:  # the requests table as it was, with one row
        db.execute("CREATE TABLE requests (id TEXT PRIMARY KEY, created REAL NOT NULL, key TEXT NOT NULL, "
                   "tier TEXT NOT NULL, model TEXT NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens "
                   "INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, queue_seconds REAL, ttft_seconds REAL, "
                   "e2e_seconds REAL NOT NULL, engine_seconds REAL NOT NULL, cost_nanos BIGINT NOT NULL, "
                   "price_nanos BIGINT NOT NULL, finish_reason TEXT, tags TEXT NOT NULL)")
        db.execute("INSERT INTO requests VALUES ('old', 1.0, 'k', 'standard', 'm', 1, 1, 0, NULL, NULL, 1.0, 0.5, "
                   "10, 20, 'stop', '[]')")
    ledger = make_meter(path).ledger
    (row,) = ledger.rows()
    assert (row.id, row.canary, row.canary_cost, row.price) == ("old", None, 0.0, 20e-9)
    assert ledger.canary_rows() == []
