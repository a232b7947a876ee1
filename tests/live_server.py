"""A real tollway server on a free loopback port, in a thread: for the server tests."""
from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx
import uvicorn

from tollway.async_engine import AsyncEngine
from tollway.config import default_tiers
from tollway.meter.budgets import Budgets
from tollway.meter.ledger import Ledger
from tollway.meter.meter import Meter
from tollway.meter.price_card import PriceCard
from tollway.server.app import create_app

MODEL = "gemma3-270m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, url: str, timeout: float = 300) -> None:
    """Wait for a `tollway serve` process to answer /health at `url`; fail with its stderr (a
    pipe) if it dies first."""
    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.time() < deadline, "server did not come up"
        time.sleep(0.5)


def serving(app):
    """uvicorn serving `app` on a free loopback port in a thread; yields its URL, then stops it."""
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(10)


def running_server(engine, metrics=None, gatekeeper=None, batch_dir=None, meter=None, fleet_secret=None,
                   canary=None, tracing=None):
    """A tollway server over `engine` (see serving); yields its details, then stops it."""
    async_engine = AsyncEngine(engine, on_step=metrics.on_step if metrics else None)
    for url in serving(create_app(async_engine, MODEL, metrics, gatekeeper, batch_dir, meter, fleet_secret,
                                  canary=canary, tracing=tracing)):
        yield {"url": url, "engine": async_engine, "sync": engine}
    async_engine.shutdown()


def make_meter(ledger_path, budgets=(), webhook=None, clock=time.time, price_per_hour=3.6) -> Meter:
    """A meter on a real ledger; 3.6 $/h is 0.001 $ per engine second."""
    ledger = Ledger(ledger_path)
    return Meter(PriceCard(price_per_hour, default_tiers()), ledger, Budgets(list(budgets), ledger, webhook, clock))
