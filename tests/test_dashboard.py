"""The live /dashboard and the Grafana board: an admin key opens the page and its data; under
mixed-lane traffic the page renders every panel in headless Chromium and its numbers move;
its figures agree with /metrics and the meter; the Grafana board queries only series that
/metrics serves."""
from __future__ import annotations

import json
import re
import statistics
import threading
import time

import httpx
import openai
import pytest
import yaml
from fastapi.testclient import TestClient

from dashboard_browser import ARTIFACTS, ROOT, dashboard_page, shown_values
from live_server import MODEL, make_meter, running_server
from tollway.config import TIERS, BudgetSpec, KeySpec, default_tiers
from tollway.server.app import create_app
from tollway.server.keys import Gatekeeper
from tollway.server.live_stats import MAX_STEPS
from tollway.server.metrics import Metrics

ADMIN, USER = "sk-admin", "sk-user"
# A shared opening, two KV blocks long, so later prompts find it in the prefix cache.
OPENING = "You are a terse assistant for an operations team. Answer in one short sentence, no lists. "


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    budgets = [BudgetSpec(limit=0.002, key="user", period="daily", hard_cap=False),
               BudgetSpec(limit=0.01, tag="team=search", period="monthly", hard_cap=False)]
    meter = make_meter(tmp_path_factory.mktemp("dashboard") / "ledger.sqlite", budgets)
    keys = Gatekeeper([KeySpec(ADMIN, "ops", admin=True), KeySpec(USER, "user")])
    tiers = default_tiers()
    # Off: on a busy machine the step model's overrun can leave no standard work fitting the
    # readiness cap, so the other lanes would wait out its whole minute.
    tiers["fast"].warm_for = None
    # The step model shapes steps to the fast lane's target (this small config's profile is
    # shared with test_step_profile); a small KV pool shows on the gauge.
    engine = make_engine(profile_steps=True, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64,
                         tiers=tiers)
    for details in running_server(engine, Metrics(MODEL), gatekeeper=keys, meter=meter):
        # before any request: what a Prometheus scraping a fresh server gets
        yield {**details, "meter": meter, "fresh_metrics": httpx.get(details["url"] + "/metrics").text}


class Traffic:
    """Clients in threads until stopped: one streaming fast (with pauses), two standard, one batch (flex)."""

    def __init__(self, url: str):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key=USER, max_retries=0, timeout=60)
        self.stop = threading.Event()
        self.errors: list[str] = []
        lanes = [("priority", 8, True), ("default", 20, False), ("default", 14, True), ("flex", 12, False)]
        self.threads = [threading.Thread(target=self._loop, args=(i, *lane), daemon=True)
                        for i, lane in enumerate(lanes)]
        for t in self.threads:
            t.start()

    def _loop(self, worker: int, tier: str, max_tokens: int, stream: bool) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                question = f"{OPENING}Question {worker}.{n}: name a river."
                resp = self.client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": question}],
                    max_tokens=max_tokens, temperature=0, service_tier=tier, stream=stream,
                    extra_body={"ignore_eos": True}, extra_headers={"x-tollway-tags": "team=search"})
                if stream:
                    list(resp)
            except openai.OpenAIError as e:
                self.errors.append(f"{tier}: {e}")
            if tier == "priority":  # gaps between fast requests: while one runs, its steps may hold the rest out
                self.stop.wait(0.5)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


@pytest.fixture
def traffic(server):
    traffic = Traffic(server["url"])
    yield traffic
    traffic.close()
    assert traffic.errors == []


def data(server, **auth) -> dict:
    r = httpx.get(server["url"] + "/dashboard/data", headers={"Authorization": f"Bearer {ADMIN}"}, **auth)
    assert r.status_code == 200
    return r.json()


def wait_for(server, ready, timeout=60.0) -> dict:
    deadline = time.time() + timeout
    while True:
        d = data(server)
        if ready(d):
            return d
        assert time.time() < deadline, f"the dashboard's data never got there: {d['tiers']}"
        time.sleep(0.3)


def every_lane_finished_some(d: dict) -> bool:
    return all(d["tiers"][t]["tpot"]["p50"] is not None for t in TIERS)


def test_the_dashboard_and_its_data_need_an_admin_key(server):
    for path in ("/dashboard", "/dashboard/data"):
        url = server["url"] + path
        missing = httpx.get(url)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        assert missing.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url, params={"key": "sk-nobody"}).status_code == 401
        for auth in ({"headers": {"Authorization": f"Bearer {USER}"}}, {"params": {"key": USER}}):
            refused = httpx.get(url, **auth)
            assert refused.status_code == 403, auth
            assert refused.json()["error"] | {"message": None} == {
                "message": None, "type": "permission_error", "param": None, "code": "admin_required"}
        for auth in ({"headers": {"Authorization": f"Bearer {ADMIN}"}}, {"params": {"key": ADMIN}}):
            assert httpx.get(url, **auth).status_code == 200, auth
    page = httpx.get(server["url"] + "/dashboard", params={"key": ADMIN})
    assert page.headers["content-type"].startswith("text/html") and page.headers["referrer-policy"] == "no-referrer"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "unsafe" not in csp
    # The admin key is a key like any other: it may call the API too.
    assert httpx.get(server["url"] + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200


def test_an_open_server_opens_its_dashboard(server):
    with TestClient(create_app(server["engine"], MODEL)) as open_app:
        assert open_app.get("/dashboard").status_code == 200
        body = open_app.get("/dashboard/data").json()
    # No meter behind this app: no cost figures, no budgets, economics in engine seconds.
    assert body["budgets"] == [] and body["price_per_hour"] is None and body["economics"]["unit"] == "s"
    assert all(body["tiers"][t]["cost_per_m_tokens"] is None for t in TIERS)


def test_the_dashboard_renders_live_mixed_lane_traffic_in_chromium(server, traffic):
    # Every lane has finished requests in the window and the fast lane has capped a step.
    wait_for(server, lambda d: every_lane_finished_some(d) and sum(d["timeline"]["capped"]) > 0)
    with dashboard_page(server["url"], ADMIN) as (view, problems):
        first = shown_values(view)
        time.sleep(3.2)  # two polls later
        second = shown_values(view)
        panels = view.eval_on_selector_all("[data-panel]", """panels => panels.map(p => ({
            name: p.dataset.panel,
            svgs: [...p.querySelectorAll('svg')].map(s => ({w: s.getBoundingClientRect().width,
                h: s.getBoundingClientRect().height, shapes: s.querySelectorAll('rect, path, circle, line').length,
                text: s.textContent}))}))""")
        capped_marks = view.eval_on_selector_all("#seqs-chart rect[fill='#ff5d5d']", "rs => rs.length")
        budget_bars = view.eval_on_selector_all("#budgets-chart rect:not(.track)", "rs => rs.length")
        steps_drawn = view.eval_on_selector_all("#economics-chart circle", "cs => cs.length")
        prefill_lines = view.eval_on_selector_all("#economics-chart line.prefill", "ls => ls.length")
        view.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert problems == {"errors": [], "elsewhere": [], "failed": []}
    # The numbers move between two reads while traffic runs.
    assert first["steps"] != second["steps"] and first["generated"] != second["generated"]
    for values in (first, second):
        for tier in TIERS:
            for field in ("cost", "ttft-p50", "ttft-p99", "tpot-p50", "tpot-p99", "tok-s", "running", "waiting"):
                assert values[f"{tier}-{field}"] not in ("", "—"), (tier, field, values)
        assert values["fast-cost"].startswith("$") and values["fast-ttft-p50"].endswith(("ms", " s"))
        header = ("tokens-per-s", "steps-per-s", "busy", "steps", "price", "prefix-detail")
        assert all(values[k] != "—" for k in header)
        assert values["canary"] == "canary off"  # its live figures: test_canary.py
    assert {p["name"] for p in panels} == {"lanes", "steps", "cache", "budgets", "economics"}
    for panel in panels:
        assert panel["svgs"], panel["name"]
        for svg in panel["svgs"]:
            assert svg["w"] > 150 and svg["h"] > 40 and svg["shapes"] >= 2 and svg["text"], panel
    assert capped_marks > 0 and budget_bars == 2 and steps_drawn > 10 and prefill_lines == 1


def test_live_figures_agree_with_metrics_and_the_meter(server, traffic):
    meter = server["meter"]
    wait_for(server, every_lane_finished_some)
    traffic.close()
    d = wait_for(server, lambda d: all(d["tiers"][t]["running"] + d["tiers"][t]["waiting"] == 0 for t in TIERS))
    exposition = httpx.get(server["url"] + "/metrics").text
    total = lambda name: sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", exposition, re.M))
    assert d["totals"]["steps"] == total("tollway:step_seconds_count") > 0
    assert d["totals"]["generated_tokens"] == total("tollway:generation_tokens_total") > 0
    # The lanes' charges are the meter's: together, all the engine time it attributed.
    assert total("tollway:engine_seconds_total") == pytest.approx(meter.attributed_seconds)
    assert total("tollway:cost_dollars_total") == pytest.approx(meter.cost(meter.attributed_seconds))
    for tier in TIERS:
        t = d["tiers"][tier]
        assert 0 < t["cost"] <= meter.cost(meter.tier_seconds[tier]) * (1 + 1e-9)
        assert t["cost_per_m_tokens"] == pytest.approx(t["cost"] / t["tokens"] * 1e6)
    # Budgets: each one's spend is the billed price the ledger holds for its key or tag.
    burn = {b["budget"]: b for b in d["budgets"]}
    assert set(burn) == {"key:user:daily", "tag:team=search:monthly"}
    billed = sum(row.price for row in meter.ledger.rows())
    assert burn["key:user:daily"]["spent"] == pytest.approx(billed) == burn["tag:team=search:monthly"]["spent"]
    assert billed > 0 and burn["key:user:daily"]["limit"] == 0.002
    # Batch economics: every retained step that decoded in exactly one size bin, bins in size
    # order; the step model split every step, and prefill took some of the engine's time.
    e = d["economics"]
    bins = e["bins"]
    assert e["steps"] == min(d["totals"]["steps"], MAX_STEPS) and e["unsplit"] == 0
    assert 0 < sum(b["steps"] for b in bins) < e["steps"]  # some steps only prefilled
    assert [b["seqs_max"] for b in bins] == sorted(b["seqs_max"] for b in bins) and all(b["median"] > 0 for b in bins)
    assert all(any(b["seqs_min"] <= s <= b["seqs_max"] for b in bins) for s, _ in e["points"])
    assert e["prefill"]["median"] > 0 and 0 < e["prefill"]["share"] < 1
    assert max(d["timeline"]["seqs"]) <= 8 and 0 <= d["kv_usage"] <= 1
    assert d["prefix_cache"]["hits"] > 0 or d["prefix_cache"]["queried"] == 0


def _queried_metrics(node) -> set[str]:
    """Every tollway:* series name in the board's queries (panel targets and variables)."""
    if isinstance(node, dict):
        found = set()
        for k, v in node.items():
            if k in ("expr", "query", "definition") and isinstance(v, str):
                found |= set(re.findall(r"tollway:[A-Za-z0-9_:]+", v))
            else:
                found |= _queried_metrics(v)
        return found
    if isinstance(node, list):
        return set().union(*map(_queried_metrics, node)) if node else set()
    return set()


def test_every_series_the_board_queries_is_served_from_the_start(server):
    """Counted from zero, not from a first event: a rate() over a series not yet exported is no
    data, and its panel stays empty on a fresh server (preemptions, speculation)."""
    board = json.loads((ROOT / "deploy/grafana/dashboards/tollway.json").read_text())
    samples = {line.split("{")[0].split(" ")[0] for line in server["fresh_metrics"].splitlines()
               if line and not line.startswith("#")}
    queried = _queried_metrics(board)
    assert {"tollway:num_preemptions_total", "tollway:spec_decode_num_draft_tokens_total"} <= queried
    assert queried <= samples, sorted(queried - samples)
    zero = re.search(r'^tollway:num_preemptions_total\{model_name="gemma3-270m",tier="fast"\} (\S+)$',
                     server["fresh_metrics"], re.M)
    assert zero and float(zero.group(1)) == 0.0


def test_the_grafana_board_queries_only_what_metrics_serves(server):
    board = json.loads((ROOT / "deploy/grafana/dashboards/tollway.json").read_text())
    exposition = httpx.get(server["url"] + "/metrics").text
    # The series each family is queried by: a counter's end in _total, a histogram's in _bucket/_sum/_count.
    served = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M):
        if kind == "counter":
            served.add(name if name.endswith("_total") else name + "_total")
        else:
            served.update(name + s for s in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",)))
    queried = _queried_metrics(board)
    assert queried and queried <= served, sorted(queried - served)
    # It covers the lanes, the steps, the cache and the bill.
    for family in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "num_requests_running",
                   "num_requests_waiting", "step_num_sequences_sum", "step_num_tokens_bucket", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "cost_dollars_total", "budget_spent_dollars"):
        assert f"tollway:{family}" in queried, family
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"]) and len(panels) >= 20
    assert all(t["expr"] for p in panels for t in p["targets"])
    # The provisioned datasource is the one the board's variable picks, scraping tollway's /metrics.
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    variable = next(v for v in board["templating"]["list"] if v["name"] == "datasource")
    assert source["datasources"][0]["uid"] == variable["current"]["value"]
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())["scrape_configs"]
    assert [(s["job_name"], s["metrics_path"]) for s in scrape] == [("tollway", "/metrics")]


def test_a_profile_fitted_to_the_servers_own_steps_simulates_its_run(server, default_tokenizer, tmp_path):
    """tollway bench serves a closed loop; `tollway profile --from` fits the machine to the steps
    the server kept; the simulator, on that profile and the server's scheduler settings, runs the
    same workload at about the same throughput and TPOT: a loose bound (the benchmark,
    sim_fidelity.py, holds the tight one)."""
    import copy

    from tollway.bench.run import BenchConfig, run_bench
    from tollway.cli import main
    from tollway.scheduler.machine_profile import MachineProfile
    from tollway.scheduler.step_model import StepShape
    from tollway.sim.live_profile import MIN_STEPS
    from tollway.sim.simulator import simulate
    from tollway.traffic.patterns import Limits, LoadPattern
    from tollway.traffic.workload import Lengths, Workload

    assert httpx.get(server["url"] + "/dashboard/steps", headers={"Authorization": f"Bearer {USER}"}).status_code == 403
    workload = Workload(Lengths(24, 0, 24, 24), Lengths(16, 0, 16, 16), True, {"fast": 0.25, "standard": 0.75}, None, 5)
    load, limits = LoadPattern("concurrency 6", concurrency=6), Limits(max_requests=40, warmup=1.0)
    served = run_bench(BenchConfig(server["url"], MODEL, workload, limits, [load], api_key=USER), default_tokenizer,
                       show=False)["stages"][0]["summary"]["all"]
    body = httpx.get(server["url"] + "/dashboard/steps", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert len(body["steps"]) >= MIN_STEPS
    path = tmp_path / "served-profile.json"
    assert main(["profile", "--from", server["url"] + "/v1", "--admin-key", ADMIN, "--output", str(path)]) == 0
    profile = MachineProfile.load(path)
    # One sample a shape (the median of its steps), and the noise around each shape as jitter.
    assert 0 < len(profile.samples) < len(body["steps"]) and profile.hardware.endswith(", served")
    assert 0 < len(profile.jitter) <= len(body["steps"]) and statistics.median(profile.jitter) == pytest.approx(1.0, abs=0.05)
    assert all(part >= 0 for part in profile.overhead) and sum(profile.overhead) > 0
    # Each streamed call's time in the server beside the engine, per lane, which the simulator draws.
    assert set(body["calls"]) == {"fast", "standard"} and profile.calls == body["calls"]
    calls = [c for lane in body["calls"].values() for c in lane]
    assert len(calls) >= 40 and all(0 < intake < 1 and 0 <= delivery < 1 and 0 <= held <= 6
                                    for intake, delivery, held in calls)
    assert max(held for *_, held in calls) >= 3  # a closed loop of 6 users keeps the engine busy
    model = profile.step_model(adaptive=False)
    # The served steps' time as the simulator draws it (the fit to each shape's median, times the
    # noise around the medians on average), step by step, within 15% in all.
    predicted = sum(model.predict(StepShape(*step[1:6])) for step in body["steps"]) * statistics.fmean(profile.jitter)
    assert predicted == pytest.approx(sum(step[7] for step in body["steps"]), rel=0.15)

    config = copy.deepcopy(server["sync"].scheduler.config)
    sim = simulate(config, profile, workload, [load], limits, progress=False)["stages"][0]["summary"]["all"]
    assert sim["output_tok_s"] == pytest.approx(served["output_tok_s"], rel=0.5)
    # Not TPOT yet: in this small config (8 sequences, 64-token steps) the simulated TPOT p50
    # runs 40-65% over the served one, an open gap of issue 58 (sim_fidelity_served.py holds the
    # default config within 5-26% at 60-90% load).


def test_profile_from_a_server_it_cannot_read_is_one_line(capsys):
    from tollway.cli import main

    assert main(["profile", "--from", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tollway: error: profile --from: cannot reach http://127.0.0.1:9/dashboard/steps") \
        and err.count("\n") == 1
