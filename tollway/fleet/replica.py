"""One replica: one engine (one model copy, its own scheduler and lanes) and the whole tollway
API over it (create_app: keys, the meter and its ledger, budgets, /metrics), listening on its
own port. fleet.py runs the replicas as a Ray Serve deployment of this class: Serve places
them, polls their load (record_routing_stats) and health (check_health), and replaces one that
dies; its request router (serve_router.py) picks which replica each request goes to.

The router may take back what a replica has queued (drain, shed). So a request's add() here
returns only once the engine has run it and produced its first output: until then it can be
refused with ReplicaDraining, a QueueFullError, which the handler answers before any engine
work is recorded (a 429 queue_full, no ledger row) and the router sends elsewhere.
"""
from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tollway.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tollway.config import EngineConfig, ServerConfig
from tollway.fleet.load import ReplicaLoad
from tollway.fleet.router import RoutingHint
from tollway.outputs import RequestOutput
from tollway.request import QueueFullError, Submission
from tollway.server.log_level import uvicorn_logging

HEALTH_SECONDS = 20.0  # an engine that takes longer to come round to a call is hung


class ReplicaDraining(QueueFullError):
    """Refused: this replica is draining, and the request had not started."""

    def __init__(self, tier: str):
        super().__init__(tier, 0)
        self.args = ("this replica is draining; the request goes to another",)


class _Started:
    """A request's stream whose first output was already read (to know it had started)."""

    def __init__(self, stream: RequestStream, first: RequestOutput):
        self.stream, self._first = stream, first
        self.request_id = stream.request_id

    def __aiter__(self) -> _Started:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
            return out
        return await self.stream.__anext__()

    def abort(self) -> None:
        self.stream.abort()

    async def ended(self) -> RequestOutput:
        return await self.stream.ended()

    async def __aenter__(self) -> _Started:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


class ReplicaEngine(AsyncEngine):
    """An AsyncEngine whose queued requests can be shed."""

    draining = False

    async def add(self, submission: Submission, tier: str = "standard", request_id: str | None = None,
                  tab: object | None = None) -> _Started:
        if self.draining:
            raise ReplicaDraining(tier)
        stream = await super().add(submission, tier, request_id, tab)
        try:
            first = await stream.__anext__()
        except EngineDeadError as e:
            if isinstance(e.__cause__, ReplicaDraining):
                raise e.__cause__ from None
            raise
        except BaseException:  # the caller went away while it was queued
            stream.abort()
            raise
        return _Started(stream, first)

    def shed(self) -> int:
        """Take no more requests, and refuse every queued one that has not started (never
        run; preempted ones have, and stay). Returns how many were refused."""
        self.draining = True
        return self.refuse_unstarted(ReplicaDraining)


@dataclass
class ReplicaSpec:
    """What every replica is built from. `build(server, config)` returns the gatekeeper, meter
    and Batch API store a server process needs, made as `tollway serve` makes them; it runs in
    each replica (a module-level function: Ray sends it by name)."""

    model_name: str
    config: EngineConfig
    server: ServerConfig
    build: Callable
    secret: str | None = None  # the fleet's, with which its ingress names calls (server/call_ids.py)
    log_level: str = "info"  # --log-level: the replicas', the ingress's and Serve's


class Replica:
    """The Serve deployment's class (fleet.py makes the deployment). Its methods that take a
    RoutingHint are called through the deployment's handle, so Serve's request router reads
    the hint and picks the replica that answers."""

    def __init__(self, spec: ReplicaSpec, host: str | None):
        """`host`: the address to listen on; None: this node's, as Ray knows it (for a cluster)."""
        import ray
        import uvicorn

        from tollway.engine import Engine
        from tollway.server.app import create_app
        from tollway.server.metrics import Metrics
        from tollway.server.tracing import tracing_for

        metrics = Metrics(spec.model_name)
        gatekeeper, meter, batch_store = spec.build(spec.server, spec.config)
        self.engine = ReplicaEngine(Engine(spec.config, progress=False), on_step=metrics.on_step)
        self.engine.fault_in_kv()
        # Every replica runs Batch API jobs; the shared store gives each job to one at a time.
        app = create_app(self.engine, spec.model_name, metrics, gatekeeper, batch_store, meter, spec.secret,
                         spec.server.sse_keep_alive, spec.server.canary,
                         tracing_for(spec.server.otlp_traces_endpoint, spec.model_name))
        host = host or ray.util.get_node_ip_address()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self._server = uvicorn.Server(uvicorn.Config(app, **uvicorn_logging(spec.log_level)))
        threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True).start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the replica's HTTP server did not start")
            time.sleep(0.05)

    async def record_routing_stats(self) -> dict:
        """The report Serve polls and hands to the request router: where this replica listens
        and its load, timed (wall clock) when read."""
        load = await asyncio.wrap_future(self.engine.run(ReplicaLoad.of))
        return {"url": self.url, "actor_name": self.actor_name, "load": dataclasses.asdict(load), "at": time.time()}

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine stopped or hangs is replaced."""
        await asyncio.wait_for(asyncio.wrap_future(self.engine.run(lambda engine: None)), HEALTH_SECONDS)

    def placed(self, hint: RoutingHint) -> str:
        """The router placed a request here: this replica's Serve id, to which the ingress then
        sends the request (over HTTP, to this replica's own API)."""
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id

    def shed(self, hint: RoutingHint) -> int:
        return self.engine.shed()

    def resume(self, hint: RoutingHint) -> None:
        self.engine.draining = False
