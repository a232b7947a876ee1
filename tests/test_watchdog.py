"""The watchdog through a real server: a request held without progress for longer than any
step takes (here, the engine thread blocked) turns /health unhealthy and is counted in
/metrics; once it moves again /health recovers and the count stays."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tollway.async_engine import AsyncEngine
from tollway.server.app import create_app
from tollway.server.metrics import Metrics

from live_server import MODEL, serving


@pytest.fixture(scope="module")
def server(make_engine):
    metrics = Metrics(MODEL)
    engine = AsyncEngine(make_engine(), on_step=metrics.on_step)
    app = create_app(engine, MODEL, metrics)
    app.state.service.watchdog.floor = 1.0  # seconds; the measured steps set the bound past that
    for url in serving(app):
        yield {"url": url, "engine": engine, "watchdog": app.state.service.watchdog}
    engine.shutdown()


def stalled_count(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("tollway:stalled_requests_total{"):
            return float(line.rpartition(" ")[2])
    raise AssertionError("no tollway:stalled_requests_total in /metrics")


def test_a_request_without_progress_makes_health_fail_and_is_counted(server):
    url, engine, watchdog = server["url"], server["engine"], server["watchdog"]
    assert httpx.get(url + "/health").status_code == 200 and stalled_count(url) == 0
    body = {"model": MODEL, "prompt": [7] * 10, "max_tokens": 200, "ignore_eos": True}
    done = threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs={"json": body, "timeout": 120})
    done.start()
    while not engine.running:
        time.sleep(0.05)
    time.sleep(0.5)  # a few steps, so the bound is set by measured steps
    bound = watchdog.bound
    assert bound >= 1.0
    hang = engine.run(lambda _: time.sleep(bound + 3))  # the engine thread hangs between two steps
    deadline = time.monotonic() + bound + 2.5
    while (health := httpx.get(url + "/health")).status_code == 200:
        assert time.monotonic() < deadline, "the hang was never reported"
        time.sleep(0.2)
    assert health.status_code == 503
    error = health.json()
    assert error["error"]["code"] == "stalled" and "without progress" in error["stalled"][0]
    assert stalled_count(url) == 1
    assert stalled_count(url) == 1  # counted once, however often it is seen
    hang.result(timeout=30)
    time.sleep(1.0)  # a few steps: the request moves again
    assert httpx.get(url + "/health").status_code == 200 and stalled_count(url) == 1
    done.join(120)
