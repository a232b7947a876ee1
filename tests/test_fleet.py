"""tollway serve --replicas: the routing policy, the merged metrics and the merged dashboard on
their own, then a real local Ray instance with two replicas of the default model as a Ray Serve
deployment whose request router is the tier-aware policy, driven by the official openai client.
One fleet for the module; the test that kills a replica runs after the others but the two that
look at the dead replica's dashboard and at the replica Serve starts in its place."""
from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import sqlite3
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tollway.cli import main, server_parts
from tollway.config import TIERS, EngineConfig, KeySpec, MeterConfig, SchedulerConfig, ServerConfig
from tollway.fleet.conversations import Conversations
from tollway.fleet.dashboard import merge
from tollway.fleet.fleet import Fleet, replica_resources, serve_logging
from tollway.fleet.ingress import create_ingress
from tollway.fleet.load import ReplicaLoad
from tollway.fleet.metrics import FleetMetrics
from tollway.fleet.replica import ReplicaSpec
from tollway.fleet.router import ReplicaState, Router, RoutingHint
from tollway.fleet.stream_end import ResponsesStreamEnd
from tollway.server import errors
from tollway.server.dashboard import dashboard_router
from tollway.server.keep_alive import COMMENT
from tollway.server.keys import Gatekeeper, KeyDatabase
from tollway.server.live_stats import LiveStats
from tollway.server.log_level import uvicorn_logging
from tollway.traffic.stats import percentile

from dashboard_browser import ARTIFACTS, dashboard_page, shown_values
from live_server import MODEL, free_port, serving

# Small steps keep runs short on two cores: 8 sequences (one slot reserved for fast), prefill
# chunks of 64 tokens, and a fast target that caps the steps fast work rides in. Without
# warm_for, steps after fast traffic are not kept short: standard prefills at full chunks.
SCHEDULER = dict(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=256)
FAST = dict(tpot_target=0.05, warm_for=None)


def load(running=None, waiting=None, outstanding=0, fast_slots=1, max_num_seqs=8) -> ReplicaLoad:
    return ReplicaLoad({t: 0 for t in TIERS} | (running or {}), {t: 0 for t in TIERS} | (waiting or {}),
                       200, 256, outstanding, fast_slots, max_num_seqs)


def router(*loads: ReplicaLoad) -> Router:
    return Router([ReplicaState(i, f"http://replica{i}", lo, 0.0) for i, lo in enumerate(loads)], clock=lambda: 1.0)


def test_fast_goes_where_fast_slots_are_free():
    r = router(load(running={"fast": 1}, outstanding=10), load(running={"standard": 7}, outstanding=900))
    assert r.choose("fast", "")[0].index == 1  # replica 0's one fast slot is taken
    r.sent(r.replicas[1], "fast", "", 50)  # counted at once, before the next report
    assert r.choose("fast", "")[0].index == 0  # both full now: the lighter one


def test_standard_goes_by_outstanding_tokens_unless_its_prefix_is_cached_nearby():
    r = router(load(outstanding=100), load(outstanding=40))
    shared = "You are a helpful assistant. " * 40  # 1160 characters: four chunks, about 290 tokens
    assert r.choose("standard", shared) == (r.replicas[1], "least_outstanding")
    r.sent(r.replicas[0], "standard", shared + "First question?", 300)  # replica 0 now holds the prefix
    r.reported(r.replicas[0], load(outstanding=250), asked=2.0)
    # 210 tokens more work there, but the cached prefix saves more prefill than that.
    assert r.choose("standard", shared + "Second question?") == (r.replicas[0], "prefix")
    r.reported(r.replicas[0], load(outstanding=600), asked=3.0)
    assert r.choose("standard", shared + "Third question?") == (r.replicas[1], "least_outstanding")
    assert r.choose("standard", "short prompt")[1] == "least_outstanding"  # no whole chunk: no affinity


def test_batch_goes_only_where_there_is_spare_capacity():
    busy = load(running={"standard": 7}, waiting={"standard": 3})
    r = router(busy, load(running={"standard": 5}))
    assert r.choose("batch", "") == (r.replicas[1], "spare_capacity")  # 8 - 5 - 1 fast reserve = 2 spare
    r.sent(r.replicas[1], "batch", "", 20)
    r.sent(r.replicas[1], "batch", "", 20)
    assert r.choose("batch", "") is None  # it waits in the router
    r.reported(r.replicas[1], load(running={"standard": 4, "batch": 2}), asked=2.0)
    assert r.choose("batch", "")[0].index == 1
    r.replicas[1].draining = True
    assert r.choose("batch", "") is None and r.choose("standard", "")[0].index == 0


def test_metrics_of_replicas_merge_with_a_replica_label():
    texts = {}
    for replica, n in (("0", 3), ("1", 5)):
        registry = CollectorRegistry()
        Counter("tollway:request_success", "Finished requests.", ["tier"], registry=registry).labels("fast").inc(n)
        texts[replica] = generate_latest(registry).decode()
    lines = FleetMetrics(router(load(), load())).exposition(texts).decode().splitlines()
    assert lines.count("# TYPE tollway:request_success_total counter") == 1
    assert 'tollway:request_success_total{replica="0",tier="fast"} 3.0' in lines
    assert 'tollway:request_success_total{replica="1",tier="fast"} 5.0' in lines
    assert 'tollway:replica_up{replica="1",state="serving"} 1.0' in lines


def test_replicas_without_ray_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails
    assert main(["serve", "--replicas", "2"]) == 2
    assert "pip install 'tollway[ray]'" in capsys.readouterr().err


@pytest.mark.parametrize("level, serve_level, access_log", [("warning", "WARNING", False), ("debug", "DEBUG", True),
                                                          ("trace", "DEBUG", True)])
def test_log_level_reaches_the_replicas_serve_and_the_ingress(monkeypatch, level, serve_level, access_log):
    """`tollway serve --replicas 2 --log-level LEVEL`: the replicas' spec carries the level (each
    replica runs its uvicorn by it), Serve logs at it, and the ingress's uvicorn runs at it."""
    import uvicorn

    from tollway.fleet import fleet as fleet_module

    seen = {}
    monkeypatch.setattr(fleet_module, "import_ray", lambda: None)  # no Ray here: nothing starts
    monkeypatch.setattr(Fleet, "start", lambda self: seen.update(spec=self.spec))
    monkeypatch.setattr(Fleet, "shutdown", lambda self: None)
    monkeypatch.setattr(uvicorn, "run", lambda app, **settings: seen.update(ingress=settings))
    assert main(["serve", "--replicas", "2", "--log-level", level]) == 0
    assert seen["spec"].log_level == level
    settings = uvicorn_logging(seen["spec"].log_level)
    assert (settings["log_level"], settings["access_log"]) == (level, access_log)
    # each call's timing line (call_timing.py) goes with the access log
    assert settings["log_config"]["loggers"]["tollway.access"]["level"] == ("INFO" if access_log else "WARNING")
    assert serve_logging(seen["spec"].log_level) == {"log_level": serve_level, "enable_access_log": False}
    assert (seen["ingress"]["log_level"], seen["ingress"]["access_log"]) == (level, access_log)


def test_a_replica_asks_ray_for_a_gpu_only_when_it_runs_on_cuda():
    def asks(device: str, gpus: float) -> dict:
        return replica_resources(EngineConfig(device=device, num_threads=4), {"CPU": 16.0, "GPU": gpus}, 2)

    assert asks("cpu", 8) == {"num_cpus": 4, "num_gpus": 0}
    assert asks("cuda", 0)["num_gpus"] == 1  # Ray then says it cannot place it, rather than running on CPU
    assert asks("auto", 2)["num_gpus"] == 1 and asks("auto", 1)["num_gpus"] == 0
    assert replica_resources(EngineConfig(device="cpu", num_threads=8), {"CPU": 4.0}, 2)["num_cpus"] == 2


def replica_data(timeline: dict | None = None, **tpot: list[float]) -> dict:
    """A replica's /dashboard/data?samples=1 with these TPOT samples per tier (and timeline)."""
    body = {"model": MODEL, "now": 0.0, "price_per_hour": None, **LiveStats().snapshot(samples=True), "budgets": []}
    body["samples"]["tpot"] |= tpot
    if timeline:
        body["timeline"] = {"bin_seconds": 1.0, "capped": [0] * len(timeline["t"]), "tokens": timeline["seqs"],
                            "waiting": {t: [0] * len(timeline["t"]) for t in TIERS},
                            "running": {t: timeline.get(t, [0] * len(timeline["t"])) for t in TIERS}} | timeline
    return body


def test_fleet_dashboard_merges_percentiles_from_samples_and_keeps_idle_replicas_state():
    quick = replica_data({"t": [-1.5, -0.5], "steps": [2, 1], "seqs": [4, 2], "standard": [3, 0],
                          "kv_usage": [0.5, 0.1]}, fast=[0.01] * 9)
    slow = replica_data({"t": [-1.5], "steps": [1], "seqs": [1], "standard": [1], "kv_usage": [0.2]}, fast=[0.1])
    d = merge(router(load(), load()).replicas, {0: quick, 1: slow})
    # The fleet's median is over its requests (10 ms), not the mean of the replicas' medians (55 ms).
    assert d["tiers"]["fast"]["tpot"] == {"p50": 0.01, "p99": percentile([0.01] * 9 + [0.1], 0.99)}
    assert d["tiers"]["fast"]["tok_s_per_user"]["p50"] == pytest.approx(100)
    assert d["tiers"]["standard"]["tpot"]["p50"] is None
    tl = d["timeline"]
    assert tl["t"] == [-1.5, -0.5] and tl["steps"] == [3, 1] and tl["seqs"] == [3, 2]  # (4*2 + 1) / 3 per step
    # Replica 1 did not step in the last bin: its queue and KV use stay those of its latest step.
    assert tl["running"]["standard"] == [4, 1] and tl["kv_usage"] == [pytest.approx(0.35), pytest.approx(0.15)]
    assert [r["state"] for r in d["replicas"]] == ["serving", "serving"]


class Rayless(Fleet):
    """A Fleet over replicas that are plain servers: no Ray, no Serve (the loads stay as given)."""

    def __init__(self, urls: list[str]):
        super().__init__(None, len(urls))
        self.router = router(*(load() for _ in urls))
        for replica, url in zip(self.router.replicas, urls):
            replica.url = url
        self.metrics = FleetMetrics(self.router)

    async def connect(self) -> None:
        pass

    async def disconnect(self) -> None:
        pass


def dashboard_only(gatekeeper: Gatekeeper) -> FastAPI:
    """A replica's /dashboard and /dashboard/data alone, over an engine that never stepped."""
    app = FastAPI()
    errors.install(app)
    app.include_router(dashboard_router(LiveStats(), gatekeeper, MODEL))
    return app


def test_the_fleet_dashboard_needs_an_admin_key_and_survives_its_replicas():
    admin, user = "sk-admin", "sk-user"
    keys = Gatekeeper([KeySpec(admin, "ops", admin=True), KeySpec(user, "user")])
    servers = [serving(dashboard_only(keys)) for _ in range(2)]
    fleet = Rayless([next(s) for s in servers])
    try:
        with TestClient(create_ingress(fleet)) as ingress:
            # As on one server: 401 without a valid key, 403 for a key that is not an admin's.
            for path in ("/dashboard", "/dashboard/data"):
                for auth, status, code in (({}, 401, "invalid_api_key"), ({"key": "sk-nobody"}, 401,
                                           "invalid_api_key"), ({"key": user}, 403, "admin_required")):
                    refused = ingress.get(path, params=auth)
                    assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), (path, auth)
                assert ingress.get(path, headers={"Authorization": f"Bearer {user}"}).status_code == 403
                assert ingress.get(path, params={"key": admin}).status_code == 200
            data = lambda: ingress.get("/dashboard/data", headers={"Authorization": f"Bearer {admin}"}).json()
            d = data()
            assert "samples" not in d
            assert [(r["state"], r["answered"]) for r in d["replicas"]] == [("serving", True)] * 2
            replica = fleet.router.replicas[1]
            replica.url = f"http://127.0.0.1:{free_port()}"  # it stops answering
            d = data()
            assert (d["replicas"][1]["state"], d["replicas"][1]["answered"], d["replicas"][1]["totals"]) == (
                "serving", False, None)
            fleet.router.died(replica)
            d = data()
            assert (d["replicas"][1]["state"], d["replicas"][1]["outstanding_tokens"]) == ("dead", None)
            assert d["totals"] == d["replicas"][0]["totals"]
    finally:
        for s in servers:
            next(s, None)


class InOrder(Rayless):
    """Places each call on the first replica it has not tried yet."""

    async def route(self, hint):
        return next(r for r in self.router.replicas if r.index not in hint.exclude)


def sse_replica(events: list[str], dies: bool = False) -> FastAPI:
    """A replica whose completions and responses stream these events, each on its own, then end or die."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}  # alive: the ingress retries without killing it

    calls = itertools.count()

    @app.post("/v1/completions")
    @app.post("/v1/responses")
    async def completions() -> StreamingResponse:
        async def stream():
            for e in events:
                yield e
                await asyncio.sleep(0.2)  # the ingress has read it before anything else comes
            if dies:
                raise RuntimeError("the replica's engine died")  # its connection closes mid-stream

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"x-request-id": f"resp_{next(calls)}"})  # as a response's id

    return app


def test_keep_alive_comments_are_not_an_answer_and_the_call_is_retried_after_them():
    """Replica 0 sends a keep-alive comment, then dies: its response had not begun, so the call
    goes to replica 1, and the client hears only replica 1's stream, never an error event."""
    answer = [COMMENT, 'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "hi"}]}\n\n', "data: [DONE]\n\n"]
    servers = [serving(sse_replica([COMMENT, COMMENT], dies=True)), serving(sse_replica(answer))]
    fleet = InOrder([next(s) for s in servers])
    try:
        with TestClient(create_ingress(fleet)) as ingress:
            resp = ingress.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
            assert (resp.status_code, resp.headers["x-tollway-replica"]) == (200, "1")
            assert resp.text == "".join(answer)
            assert 'tollway:router_retries_total{tier="standard",why="replica_lost"} 1.0' in ingress.get("/metrics").text
    finally:
        for s in servers:
            next(s, None)


class Recording(Rayless):
    """Places each call on replica 0, keeping the hint the router was given."""

    def __init__(self, urls: list[str]):
        super().__init__(urls)
        self.hints: list[RoutingHint] = []

    async def route(self, hint):
        self.hints.append(hint)
        return self.router.replicas[0]


def test_a_response_is_routed_by_its_input_tier_and_output_allowance_and_the_conversation_it_continues():
    servers = [serving(sse_replica(["event: response.completed\ndata: {}\n\n"]))]
    fleet = Recording([next(s) for s in servers])
    instructions, items = "Answer in French.", [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    try:
        with TestClient(create_ingress(fleet)) as ingress:
            for body in ({"input": "Bonjour " * 100, "service_tier": "priority"},  # resp_0
                         {"instructions": instructions, "input": items, "max_output_tokens": 40,
                          "service_tier": "flex", "previous_response_id": "resp_0"},  # resp_1
                         {"instructions": instructions, "input": "Merci.", "previous_response_id": "resp_1"},
                         {"input": "Salut.", "previous_response_id": "resp_unknown"}):
                assert ingress.post("/v1/responses", json={"model": MODEL, "stream": True, **body}).status_code == 200
    finally:
        for s in servers:
            next(s, None)
    fast, batch, standard, unknown = fleet.hints
    assert (fast.tier, fast.prompt_text, fast.tokens) == ("fast", "Bonjour " * 100, 200 + 256)  # 256: the guess
    # instructions, then the conversation continued (resp_0's input), then the input
    assert batch.tier == "batch" and batch.prompt_text == instructions + "Bonjour " * 100 + json.dumps(items)
    assert batch.tokens == len(batch.prompt_text) // 4 + 40
    # the conversation so far begins as the one before's: prefix affinity places it where that was
    assert standard.prompt_text == batch.prompt_text + "Merci." and standard.tier == "standard"
    assert unknown.prompt_text == "Salut."


def test_the_ingress_keeps_the_start_of_the_latest_responses_conversations():
    kept = Conversations(kept_chars=8, max_entries=2)
    kept.made("resp_a", "0123456789")
    kept.made("resp_b", "b")
    assert kept.before("resp_a") == "01234567"  # what prefix affinity reads; used now, so kept
    kept.made("resp_c", "c")
    assert [kept.before(r) for r in ("resp_a", "resp_b", "resp_c", None, ["resp_a"])] == ["01234567", "", "c", "", ""]


@pytest.mark.parametrize("last, whole", [("response.completed", True), ("response.incomplete", True),
                                         ("error", True), ("response.output_text.delta", False)])
def test_a_responses_stream_is_whole_once_its_last_event_came_however_it_is_cut(last, whole):
    data = json.dumps({"response": {"output": [{"text": "event: response.completed\n" * 3}]}})  # escaped in JSON
    stream = f"event: response.created\ndata: {data}\n\n{COMMENT}event: {last}\ndata: {data}\n\n"
    for size in (1, 7, len(stream)):
        end = ResponsesStreamEnd()
        for i in range(0, len(stream), size):
            end.feed(stream[i:i + size].encode())
        assert (end.whole, end.events) == (whole, 2), size


def test_a_response_stream_whose_replica_dies_ends_with_a_responses_error_event():
    """Replica 0 answers nothing but a comment and dies: the call goes to replica 1, which dies
    after two events; the client's stream ends with the Responses API's error event, numbered
    after them, which the openai client parses."""
    begun = [f'event: {kind}\ndata: {{"type": "{kind}", "sequence_number": {n}, "response": {{"id": "resp_1", '
             '"object": "response", "created_at": 0, "model": "m", "output": [], "parallel_tool_calls": true, '
             '"tool_choice": "auto", "tools": [], "status": "in_progress"}}\n\n'
             for n, kind in enumerate(("response.created", "response.in_progress"))]
    servers = [serving(sse_replica([COMMENT], dies=True)), serving(sse_replica(begun, dies=True))]
    fleet = InOrder([next(s) for s in servers])
    try:
        with TestClient(create_ingress(fleet)) as ingress:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=ingress,
                                   max_retries=0)
            raw = client.responses.with_raw_response.create(model=MODEL, input="hi", stream=True)
            assert raw.headers["x-tollway-replica"] == "1"
            events = list(raw.parse())
    finally:
        for s in servers:
            next(s, None)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error"]
    error = events[-1]
    assert (error.code, error.sequence_number) == ("replica_failed", 2)
    assert "replica 1 failed mid-stream" in error.message


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    try:
        import ray
    except ImportError:
        assert not os.environ.get("TOLLWAY_REQUIRE_RAY"), "ray is missing, and CI requires the fleet tests"
        pytest.skip("Ray is not installed (pip install 'tollway[ray]')")
    import uvicorn

    root = tmp_path_factory.mktemp("fleet")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    config = EngineConfig(scheduler=SchedulerConfig(**SCHEDULER))
    for name, value in FAST.items():
        setattr(config.scheduler.tiers["fast"], name, value)
    server = ServerConfig(data_dir=str(root), keys_db=str(root / "keys.sqlite"),
                          meter=MeterConfig(ledger=str(root / "ledger.sqlite")))
    fleet = Fleet(ReplicaSpec(MODEL, config, server, server_parts), 2)
    fleet.start()
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(create_ingress(fleet), host="127.0.0.1", port=port, log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(uv.serve(),), daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline, "the ingress did not start"
        time.sleep(0.05)
    yield {"url": f"http://127.0.0.1:{port}", "fleet": fleet, "ledger": root / "ledger.sqlite",
           "keys": root / "keys.sqlite",
           "on_loop": lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60), "ray": ray}
    uv.should_exit = True
    thread.join(10)
    fleet.shutdown()
    ray.shutdown()


def client(fleet, timeout=60.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["url"] + "/v1", api_key="unused", timeout=timeout, max_retries=0)


def stream(fleet, prompt: str, tier: str, max_tokens: int, timeout: float = 60.0) -> dict:
    """One streamed completion: its replica, id, token arrival times, tokens billed, and the error
    that ended it, if any. A sampled token may carry no text of its own (part of a UTF-8
    character), so arrivals are counted by chunk and tokens by the usage chunk."""
    raw = client(fleet, timeout).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"service_tier": tier, "ignore_eos": True})
    result = {"replica": raw.headers["x-tollway-replica"], "tier": tier, "times": [], "tokens": None,
              "id": None, "error": None}
    try:
        for chunk in raw.parse():
            result["id"] = chunk.id
            if chunk.choices:
                result["times"].append(time.perf_counter())
            if chunk.usage:
                result["tokens"] = chunk.usage.completion_tokens
    except openai.APIError as e:
        result["error"] = e
    return result


def tpot(times: list[float]) -> float:
    return (times[-1] - times[0]) / (len(times) - 1)


def prompt(i: int, words: int = 60) -> str:
    return " ".join(f"item{i}-{j}" for j in range(words))


def ledger_rows(fleet) -> dict[str, str]:
    with sqlite3.connect(fleet["ledger"]) as db:
        return dict(db.execute("SELECT id, finish_reason FROM requests"))


def test_mixed_lanes_spread_over_both_replicas_and_fast_keeps_its_advantage(fleet):
    with ThreadPoolExecutor(16) as pool:
        standard = []
        for i in range(8):  # arriving one by one, so that standard steps carry prefill chunks
            standard.append(pool.submit(stream, fleet, prompt(i, 30), "default", 16))
            time.sleep(0.25)
        fast = [pool.submit(stream, fleet, prompt(100 + i, 10), "priority", 12) for i in range(2)]
        batch = [pool.submit(client(fleet).completions.create, model=MODEL, prompt=prompt(200 + i, 10),
                             max_tokens=4, extra_body={"service_tier": "flex"}) for i in range(2)]
        standard, fast, batch = ([f.result() for f in fs] for fs in (standard, fast, batch))
    assert not [r["error"] for r in standard + fast if r["error"]]
    assert {r["replica"] for r in standard} == {"0", "1"}
    assert all(b.service_tier == "flex" and b.choices[0].text for b in batch)
    fast_tpot = statistics.median(tpot(r["times"]) for r in fast)
    standard_tpot = statistics.median(tpot(r["times"]) for r in standard)
    assert fast_tpot < 0.8 * standard_tpot, (fast_tpot, standard_tpot)
    # /metrics: each replica's series with its replica label beside the tier, and the router's.
    text = httpx.get(fleet["url"] + "/metrics").text
    served = [line for line in text.splitlines() if line.startswith("tollway:request_success_total{")]
    assert any('replica="0"' in line and 'tier="standard"' in line for line in served)
    assert any('replica="1"' in line and 'tier="standard"' in line for line in served)
    assert 'tollway:router_requests_total{reason="fast_capacity"' in text


def test_serve_runs_the_replicas_and_its_request_router_is_tollways_policy(fleet):
    from ray import serve

    deployment = serve.status().applications["tollway"].deployments["Replica"]
    assert deployment.status == "HEALTHY" and deployment.replica_states.get("RUNNING") == 2
    # Fast: with one replica's fast slot held by a fast stream, the next fast request goes to the other.
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(stream, fleet, prompt(1100), "priority", 64)  # running still when the next is routed
        fleet_router = fleet["fleet"].router
        deadline = time.time() + 30
        while not any(r.fast_free == 0 for r in fleet_router.replicas):
            assert time.time() < deadline, "the fast stream never started"
            time.sleep(0.02)
        busy = next(r.index for r in fleet_router.replicas if r.fast_free == 0)
        other = client(fleet).completions.with_raw_response.create(
            model=MODEL, prompt=prompt(1101, 10), max_tokens=2, extra_body={"service_tier": "priority"})
        assert other.headers["x-tollway-replica"] == str(1 - busy)
        assert held.result()["error"] is None
    # Standard: requests that share a long prefix follow it to the replica that holds it in cache
    # (each sent once the replicas' reports cover the one before, so that the loads are even).
    shared = "You are a helpful assistant who answers in one short sentence. " * 20  # 1280 characters
    landed = set()
    for i in range(3):
        landed.add(stream(fleet, shared + f"Question {i}?", "default", 2)["replica"])
        done = time.time()
        while min(r.asked for r in fleet_router.replicas) < done:
            time.sleep(0.05)
    assert len(landed) == 1
    text = httpx.get(fleet["url"] + "/metrics").text
    assert 'tollway:router_requests_total{reason="prefix"' in text  # counted where Serve asked the policy


def test_a_drained_replica_sheds_its_queue_to_the_other(fleet):
    routed_before = dict(ledger_rows(fleet))
    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(client(fleet).completions.with_raw_response.create, model=MODEL,
                               prompt=prompt(300 + i, 10), max_tokens=12, extra_body={"ignore_eos": True})
                   for i in range(20)]
        replica = fleet["fleet"].router.replicas[1]
        deadline = time.time() + 30
        while replica.load.waiting["standard"] == 0:  # seven run at once; the rest queue
            assert time.time() < deadline, "replica 1 never had a queue"
            time.sleep(0.05)
        shed = fleet["on_loop"](fleet["fleet"].drain(1))
        responses = [f.result() for f in futures]
    fleet["on_loop"](fleet["fleet"].resume(1))
    assert shed > 0
    bodies = [r.parse() for r in responses]
    assert all(len(b.choices[0].text) > 0 and b.usage.completion_tokens == 12 for b in bodies)
    # Each finished request has one ledger row; a shed attempt left none.
    rows = ledger_rows(fleet)
    assert {b.id for b in bodies} <= set(rows) and len(rows) - len(routed_before) == len(bodies)
    assert all(rows[b.id] == "length" for b in bodies)
    text = httpx.get(fleet["url"] + "/metrics").text
    assert 'tollway:router_retries_total{tier="standard",why="queue_full"}' in text


def test_the_dashboard_shows_both_replicas_and_fleet_totals_that_add_up(fleet):
    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream, fleet, prompt(700 + i, 10), tier, 6)
                   for i, tier in enumerate(["default"] * 4 + ["priority"] * 2)]
        batch = [pool.submit(client(fleet).completions.create, model=MODEL, prompt=prompt(720 + i, 10), max_tokens=4,
                             extra_body={"service_tier": "flex"}) for i in range(2)]
        assert not [r["error"] for r in (f.result() for f in streams) if r["error"]]
        assert all(f.result().choices[0].text for f in batch)
    d = httpx.get(fleet["url"] + "/dashboard/data").json()
    replicas = d["replicas"]
    assert [(r["replica"], r["state"], r["answered"]) for r in replicas] == [(0, "serving", True), (1, "serving", True)]
    assert all(r["totals"]["steps"] > 0 and sum(r["tiers"][t]["finished"] for t in TIERS) > 0 for r in replicas)
    # The fleet's totals are the sums over its replicas.
    for field in ("steps", "generated_tokens", "tokens_per_s", "steps_per_s"):
        assert d["totals"][field] == pytest.approx(sum(r["totals"][field] for r in replicas)), field
    for tier in TIERS:
        for field in ("finished", "running", "waiting", "tokens"):
            assert d["tiers"][tier][field] == sum(r["tiers"][tier][field] for r in replicas), (tier, field)
        assert d["tiers"][tier]["cost"] == pytest.approx(sum(r["tiers"][tier]["cost"] for r in replicas))
    for field in ("queried", "hits"):
        assert d["prefix_cache"][field] == sum(r["prefix_cache"][field] for r in replicas)
    assert d["kv_usage"] == pytest.approx(statistics.mean(r["kv_usage"] for r in replicas))  # equal KV pools
    assert len(d["economics"]["by_replica"]) == 2
    with dashboard_page(fleet["url"]) as (view, problems):
        values = shown_values(view)
        cards = view.eval_on_selector_all("#replicas .replica", "cs => cs.length")
        # Per replica: a track for each lane's queue bar and for KV use, each row labelled.
        drawn = view.eval_on_selector_all("[data-panel=replicas] svg", """svgs => svgs.map(s => [
            s.querySelectorAll('rect.track').length, s.textContent])""")
        model = view.text_content("#model")
        view.screenshot(path=str(ARTIFACTS / "fleet-dashboard.png"), full_page=True)
    assert problems == {"errors": [], "elsewhere": [], "failed": []}
    assert cards == 2 and model.endswith("2 replicas")
    assert len(drawn) == 2 and all(tracks == 4 and "run" in text and "KV" in text for tracks, text in drawn)
    for i in (0, 1):
        assert values[f"replica-{i}-state"] == "serving"
        for field in ("steps", "finished", "generated"):
            assert values[f"replica-{i}-{field}"] not in ("—", "0"), (i, field, values)


def test_a_keys_rpm_holds_for_the_whole_fleet(fleet):
    # The replicas on one machine share the key store's SQLite file, and count rate limits in it.
    store, rpm = KeyDatabase(fleet["keys"]), 6
    key = store.add("limited", ["standard"], rpm=rpm, tpm=None)

    def attempt(i: int) -> tuple[str, str]:
        limited = openai.OpenAI(base_url=fleet["url"] + "/v1", api_key=key, timeout=60.0, max_retries=0)
        try:
            raw = limited.completions.with_raw_response.create(model=MODEL, prompt=prompt(800 + i, 10), max_tokens=2)
        except openai.RateLimitError as e:
            assert e.code == "rate_limit_exceeded" and 1 <= int(e.response.headers["Retry-After"]) <= 60
            return e.response.headers["x-tollway-replica"], "refused"
        return raw.headers["x-tollway-replica"], "served"

    try:  # while the key exists the fleet is no longer open: the other tests' clients have none
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(attempt, range(24)))
    finally:
        store.revoke("limited")
    assert [outcome for _, outcome in answers].count("served") == rpm
    assert {replica for replica, _ in answers} == {"0", "1"}


def test_every_replica_serves_the_batch_api_and_runs_its_jobs(fleet):
    replicas = [openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0)
                for r in fleet["fleet"].router.replicas]
    jobs = []
    for i, client in enumerate(replicas):  # a job handed straight to each replica
        lines = "".join(json.dumps({"custom_id": f"r{i}-{n}", "method": "POST", "url": "/v1/completions",
                                    "body": {"model": MODEL, "prompt": prompt(900 + 10 * i + n, 8), "max_tokens": 3}})
                        + "\n" for n in range(3))
        uploaded = client.files.create(file=("in.jsonl", io.BytesIO(lines.encode())), purpose="batch")
        jobs.append(client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                          completion_window="24h").id)
    through_ingress = openai.OpenAI(base_url=fleet["url"] + "/v1", api_key="unused", max_retries=0)
    deadline = time.time() + 120
    while any(through_ingress.batches.retrieve(j).status != "completed" for j in jobs):
        assert time.time() < deadline, [through_ingress.batches.retrieve(j).status for j in jobs]
        time.sleep(0.5)
    for i, job in enumerate(jobs):  # the other replica sees the same job, and its output
        batch = replicas[1 - i].batches.retrieve(job)
        assert batch.request_counts.completed == 3
        output = replicas[1 - i].files.content(batch.output_file_id).text.splitlines()
        assert sorted(json.loads(x)["custom_id"] for x in output) == [f"r{i}-{n}" for n in range(3)]


def test_responses_are_routed_and_continued_on_either_replica_through_the_shared_ledger(fleet):
    """The ingress routes a response (x-tollway-replica) and each replica keeps it in the ledger
    the fleet shares: it is continued on the other replica, then streamed through the ingress,
    and read and listed wherever the ingress sends those calls."""
    def fast_routed() -> float:  # the router's count of fast requests placed
        return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(fleet["url"] + "/metrics").text.splitlines()
                   if line.startswith("tollway:router_requests_total{") and 'tier="fast"' in line)

    ingress, routed = client(fleet), fast_routed()
    raw = ingress.responses.with_raw_response.create(model=MODEL, input="My name is Ada.", max_output_tokens=4,
                                                     temperature=0, service_tier="priority")
    made_on, first = int(raw.headers["x-tollway-replica"]), raw.parse()
    assert first.service_tier == "priority" and fast_routed() == routed + 1
    other = openai.OpenAI(base_url=fleet["fleet"].router.replicas[1 - made_on].url + "/v1", api_key="unused",
                          max_retries=0)
    second = other.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                    max_output_tokens=4, temperature=0)
    # its prompt is the first turn, its answer and the question
    alone = other.responses.create(model=MODEL, input="What is my name?", max_output_tokens=1, store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    with ingress.responses.stream(model=MODEL, input="Spell it.", previous_response_id=second.id,
                                  max_output_tokens=4, temperature=0) as stream:
        events = list(stream)
    third = events[-1].response
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert third.previous_response_id == second.id and third.usage.input_tokens > second.usage.input_tokens
    for response in (first, second, third):
        assert ingress.responses.retrieve(response.id).output_text == response.output_text
    [asked] = ingress.responses.input_items.list(second.id).data
    assert asked.content[0].text == "What is my name?"
    rows = ledger_rows(fleet)  # one ledger row each, under the response's id
    assert {"chatcmpl-" + r.id.removeprefix("resp_") for r in (first, second, third)} <= set(rows)


def test_killing_a_replica_mid_load_ends_its_streams_with_an_error_and_loses_no_ledger_row(fleet):
    with ThreadPoolExecutor(16) as pool:
        # Long enough to be mid-stream a second after both replicas run them (48 tokens ended first on q8).
        streams = [pool.submit(stream, fleet, prompt(400 + i, 10), "default", 200, 30.0) for i in range(4)]
        plain = [pool.submit(client(fleet, 30.0).completions.create, model=MODEL, prompt=prompt(500 + i, 10),
                             max_tokens=8) for i in range(2)]
        replicas = fleet["fleet"].router.replicas
        deadline = time.time() + 30
        while not all(r.load.running["standard"] for r in replicas):  # both are serving
            assert time.time() < deadline, "the load never reached both replicas"
            time.sleep(0.05)
        time.sleep(1.0)
        ray = fleet["ray"]
        ray.kill(ray.get_actor(replicas[1].actor_name, namespace="serve"))
        started = time.time()
        streams = [f.result() for f in streams]
        plain = [f.result() for f in plain]
    assert time.time() - started < 30
    on_dead = [r for r in streams if r["replica"] == "1"]
    on_live = [r for r in streams if r["replica"] == "0"]
    assert on_dead and on_live
    # The dead replica's clients got an error, not a hang; the rest finished.
    assert all(isinstance(r["error"], openai.APIError) and "replica 1 failed" in str(r["error"]) for r in on_dead)
    assert all(r["error"] is None and r["tokens"] == 200 for r in on_live)
    assert all(p.choices[0].text for p in plain)  # queued there or not, each plain request was served
    rows = ledger_rows(fleet)
    assert {r["id"] for r in on_live} | {p.id for p in plain} <= set(rows)
    # The fleet carries on without it (Serve starts a replacement, which joins as replica 2).
    health = httpx.get(fleet["url"] + "/health").json()
    assert [r["alive"] for r in health["replicas"][:2]] == [True, False]
    after = stream(fleet, prompt(600), "default", 8)
    assert after["error"] is None and after["replica"] != "1"


def test_the_dashboard_shows_a_dead_replica_as_dead(fleet):
    d = httpx.get(fleet["url"] + "/dashboard/data").json()
    live, dead = d["replicas"][:2]  # then Serve's replacement, once it has joined
    assert (dead["state"], dead["answered"], dead["totals"], dead["outstanding_tokens"]) == ("dead", False, None, None)
    assert live["state"] == "serving"
    answered = [r for r in d["replicas"] if r["answered"]]
    assert d["totals"]["steps"] == sum(r["totals"]["steps"] for r in answered)  # the dead one's figures left with it
    with dashboard_page(fleet["url"]) as (view, problems):
        values = shown_values(view)
    assert problems == {"errors": [], "elsewhere": [], "failed": []}
    assert values["replica-0-state"] == "serving" and values["replica-1-state"] == "dead"
    assert values["replica-1-steps"] == "—" and values["replica-0-steps"] != "—"


def test_serve_replaces_the_dead_replica_and_the_router_sends_it_work(fleet):
    from ray import serve

    replicas = fleet["fleet"].router.replicas
    deadline = time.time() + 120
    while len(replicas) < 3 or not replicas[2].routable:
        assert time.time() < deadline, [r.state for r in replicas]
        time.sleep(0.25)
    assert serve.status().applications["tollway"].deployments["Replica"].replica_states.get("RUNNING") == 2
    assert [r.state for r in replicas] == ["serving", "dead", "serving"]
    with ThreadPoolExecutor(4) as pool:  # at once: each counts on its replica before the next is placed
        served = {r["replica"] for r in pool.map(lambda i: stream(fleet, prompt(1000 + i), "default", 4), range(4))}
    assert served == {"0", "2"}
