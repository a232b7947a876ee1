"""The OpenAI-compatible HTTP API: /v1/completions and /v1/chat/completions (completions.py),
/v1/responses (responses_api.py),
/v1/models, /health and /metrics (status.py), /v1/usage (usage.py), vLLM's /tokenize,
/detokenize and /version (tokenization.py), /v1/embeddings' refusal (embeddings.py), the Batch API
(batch_api.py) and the operators' /dashboard (dashboard.py), each a router over one Service
(service.py).

Handlers only translate: requests become engine requests through the AsyncEngine, outputs
become OpenAI responses or SSE chunks. A streaming client that goes away cancels its
response, which aborts its engine requests and frees their KV blocks at once.
"""
from __future__ import annotations

import re
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tollway.async_engine import AsyncEngine
from tollway.config import CanaryConfig
from tollway.meter.meter import Meter
from tollway.server import batch_api, completions, embeddings, errors, responses_api, status, tokenization, usage
from tollway.server.dashboard import dashboard_router
from tollway.server.fast_first import FastFirst
from tollway.server.keep_alive import DEFAULT_INTERVAL
from tollway.server.keys import Gatekeeper
from tollway.server.metrics import Metrics
from tollway.server.service import Service
from tollway.server.tracing import Tracing
from tollway.storage.database import Database


def create_app(engine: AsyncEngine, model_name: str, metrics: Metrics | None = None,
               gatekeeper: Gatekeeper | None = None, batch_dir: str | Path | Database | None = None,
               meter: Meter | None = None, fleet_secret: str | None = None,
               keep_alive: float = DEFAULT_INTERVAL, canary: CanaryConfig | None = None,
               tracing: Tracing | None = None) -> FastAPI:
    """`metrics`, when given, must be the one feeding on `engine`'s steps; it is served at
    /metrics. `gatekeeper` checks API keys, tier entitlements and rate limits (None: open).
    `batch_dir` holds the Batch API's files and jobs: a folder, or the fleet's Database (None: no
    Batch API). `meter` attributes engine time, keeps the ledger and enforces budgets (None: no
    metering); /metrics and /dashboard then show its cost per lane and its budgets.
    `fleet_secret`: a fleet replica's, with which its ingress names calls (call_ids.py).
    `keep_alive`: the seconds a stream may go silent before it sends a keep-alive comment.
    `canary`: the share of eligible traffic promoted to the fast lane (None: none).
    `tracing`: where each call's span goes (tracing.py; None: nowhere)."""
    svc = Service(engine, model_name, metrics, gatekeeper, batch_dir, meter, fleet_secret, keep_alive, canary,
                  tracing)
    runner = svc.batch_runner

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if runner is not None:
            runner.resume()  # jobs a previous server left unfinished
        yield
        if runner is not None:
            await runner.shutdown()
        if tracing is not None:
            tracing.shutdown()

    app = FastAPI(title="tollway", summary="OpenAI-compatible LLM serving with fast, standard and batch lanes",
                  lifespan=lifespan)
    app.state.service = svc
    app.add_middleware(FastFirst)
    app.add_middleware(RequestIds)  # added last: outermost, so `received` counts FastFirst's wait
    errors.install(app)
    for module in (status, usage, completions, responses_api, tokenization, embeddings):
        app.include_router(module.router)
    app.include_router(dashboard_router(svc.stats, svc.gatekeeper, model_name, meter, svc.canary))
    if runner is not None:
        app.include_router(batch_api.router)
    return app


class RequestIds:
    """Gives every response an x-request-id, as OpenAI does: the one its route set (a
    completion's id), else the client's own, else a fresh one. Plain ASGI rather than
    BaseHTTPMiddleware, which would hide a streaming client's disconnect from the route."""

    _CLIENT_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # echoed only if it is a sane header value

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        request_id = given.decode() if self._CLIENT_ID.fullmatch(given) else f"req_{uuid.uuid4().hex}"
        # For the 500 handler (errors.py), which Starlette runs outside every middleware; and when
        # the request reached the server, before its body is read (call_timing.py).
        scope.setdefault("state", {}).update(request_id=request_id, received=time.monotonic())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                if "x-request-id" not in headers:
                    headers["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
