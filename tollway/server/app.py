"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/v1/usage, /health, /metrics; and the operators' /dashboard (dashboard.py).

Handlers only translate: requests become engine requests through the AsyncEngine, outputs
become OpenAI responses or SSE chunks. A streaming client that goes away cancels its
response, which aborts its engine requests and frees their KV blocks at once.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from tollway.async_engine import AsyncEngine
from tollway.config import KeySpec
from tollway.meter.budgets import BudgetExceeded
from tollway.meter.ledger import GROUPS, parse_time
from tollway.meter.meter import Meter
from tollway.server import errors
from tollway.server.batch_api import batch_router
from tollway.server.batch_runner import BatchRunner
from tollway.server.batch_store import BatchStore
from tollway.server.call_ids import trusted_call_id
from tollway.server.dashboard import dashboard_router
from tollway.server.disconnects import ClientGone, ClosingStreamingResponse, unless_disconnected
from tollway.server.errors import APIError
from tollway.server.generation import (
    Generation, completion_logprobs, ledger_row, request_tags, sampling_params, token_entry, token_prompts,
)
from tollway.server.keys import Gatekeeper
from tollway.server.live_stats import LiveStats
from tollway.server.metrics import Metrics
from tollway.server.protocol import ChatCompletionRequest, CompletionRequest
from tollway.server.service_tier import tier_for
from tollway.server.watchdog import Watchdog
from tollway.storage.database import Database


def create_app(engine: AsyncEngine, model_name: str, metrics: Metrics | None = None,
               gatekeeper: Gatekeeper | None = None, batch_dir: str | Path | Database | None = None,
               meter: Meter | None = None, fleet_secret: str | None = None) -> FastAPI:
    """`metrics`, when given, must be the one feeding on `engine`'s steps; it is served at
    /metrics. `gatekeeper` checks API keys, tier entitlements and rate limits (None: open).
    `batch_dir` holds the Batch API's files and jobs: a folder, or the fleet's Database (None: no
    Batch API). `meter` attributes engine time, keeps the ledger and enforces budgets (None: no
    metering); /metrics and /dashboard then show its cost per lane and its budgets.
    `fleet_secret`: a fleet replica's, with which its ingress names calls (call_ids.py)."""
    runner: BatchRunner | None = None
    if meter is not None:
        engine.observe(meter.on_step)
        if metrics is not None:
            metrics.bill(meter)
    stats = LiveStats(meter, engine)
    engine.observe(stats.on_step)  # after the meter's: it reads the meter's charges for the step
    watchdog = Watchdog(engine)
    if metrics is not None:
        metrics.watch(engine, watchdog)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        if runner is not None:
            runner.resume()  # jobs a previous server left unfinished
        yield
        if runner is not None:
            await runner.shutdown()

    app = FastAPI(title="tollway", summary="OpenAI-compatible LLM serving with fast, standard and batch lanes",
                  lifespan=lifespan)
    errors.install(app)
    gatekeeper = gatekeeper or Gatekeeper([])

    def caller(authorization: str | None = Header(default=None)) -> KeySpec | None:
        return gatekeeper.authenticate(authorization)
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len

    app.state.watchdog = watchdog

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            raise APIError(503, "the engine has stopped")
        stuck = watchdog.check()
        if stuck:
            return JSONResponse(errors.error_body(503, f"stuck: {'; '.join(stuck)}", code="stalled") | {"stalled": stuck},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise APIError(404, "metrics are off")
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(_: KeySpec | None = Depends(caller)) -> dict:
        return {"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "tollway", "max_model_len": max_model_len}]}

    @app.get("/v1/usage")
    async def usage(group_by: str = "tier", start: str | None = None, end: str | None = None,
                    key: KeySpec | None = Depends(caller)) -> dict:
        """Totals per key, tier, tag or model over [start, end) (unix seconds or ISO 8601).
        With API keys on, a key sees only its own requests."""
        if meter is None:
            raise APIError(404, "metering is off")
        if group_by not in GROUPS:
            raise APIError(400, f"group_by must be one of {', '.join(GROUPS)}", param="group_by")
        window = []
        for value, name in ((start, "start"), (end, "end")):
            try:
                window.append(parse_time(value, name))
            except ValueError as e:
                raise APIError(400, str(e), param=name) from None
        rows = await asyncio.to_thread(meter.ledger.usage, group_by, *window, key.name if key else None)
        return {"object": "list", "data": rows}

    def call_id(request: Request) -> str | None:
        return trusted_call_id(request.headers, fleet_secret)

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest, key: KeySpec | None = Depends(caller),
                          x_tollway_tags: str | None = Header(default=None), call: str | None = Depends(call_id)):
        return await _serve(request, req, "completion", key, request_tags(req, x_tollway_tags), call)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, req: ChatCompletionRequest, key: KeySpec | None = Depends(caller),
                               x_tollway_tags: str | None = Header(default=None), call: str | None = Depends(call_id)):
        return await _serve(request, req, "chat", key, request_tags(req, x_tollway_tags), call)

    async def _serve(request: Request, req: CompletionRequest | ChatCompletionRequest, kind: str,
                     key: KeySpec | None, tags: list[str], call: str | None) -> Response:
        """A client that hangs up has its request withdrawn (aborted in the engine, billed for
        what ran) wherever it was: being admitted, queued, running, or streaming."""
        try:
            return await unless_disconnected(request, _respond(req, kind, key, tags, call))
        except ClientGone:
            return Response(status_code=499)  # nginx's "client closed request": no one reads it

    async def _respond(req: CompletionRequest | ChatCompletionRequest, kind: str, key: KeySpec | None,
                       tags: list[str], call: str | None) -> Response:
        tier = gatekeeper.entitled_tier(key, tier_for(req.service_tier), req.service_tier)
        gen = await _start(req, kind, tier, key, tags, call)
        echo = kind == "completion" and req.echo
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return ClosingStreamingResponse(_sse(gen, include_usage, echo), lambda: _withdraw(gen),
                                            media_type="text/event-stream")
        body = await _collect(gen, echo)
        headers = {"x-tollway-cost": f"{body['usage']['cost']:.10f}"} if meter is not None else None
        return JSONResponse(body, headers=headers)

    async def _start(req: CompletionRequest | ChatCompletionRequest, kind: str, tier: str,
                     key: KeySpec | None, tags: list[str], call: str | None) -> Generation:
        """Check the request against the model and the key's limits, and submit its choices."""
        if req.model is not None and req.model != model_name:
            raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`.",
                           param="model", code="model_not_found")
        gen = Generation(kind, model_name, tier, call)
        prompts = token_prompts(req, tokenizer)
        longest = max(len(p) for p in prompts)
        if longest == 0:
            raise APIError(400, "prompt is empty", param="prompt")
        if longest >= max_model_len:
            raise APIError(400, f"prompt is {longest} tokens, but the context is {max_model_len}",
                           param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        asked = (req.max_completion_tokens or req.max_tokens) if kind == "chat" else req.max_tokens
        max_tokens = asked or (max_model_len - longest if kind == "chat" else 16)
        if longest + max_tokens > max_model_len:
            raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt ({longest}) plus "
                                f"max_tokens ({max_tokens}) is more", param="max_tokens", code="context_length_exceeded")
        logprobs = (req.top_logprobs or 0 if req.logprobs else None) if kind == "chat" else req.logprobs
        params = [sampling_params(req, max_tokens, logprobs, i) for i in range(req.n)]
        gen.key, gen.tags = key.name if key else "", tags
        prompt_tokens, most_tokens = sum(len(p) for p in prompts), max_tokens * req.n * len(prompts)
        if meter is not None:
            most = meter.price_card.billed(tier, prompt_tokens, most_tokens)  # the most it can be billed
            try:
                await asyncio.to_thread(meter.budgets.reserve, gen.id, gen.key, tags, most)
            except BudgetExceeded as e:
                raise APIError(429, str(e), code="budget_exceeded", headers={"Retry-After": str(e.retry_after)}) from None
        try:
            if key is not None and key.limited:  # a transaction in the key store's database: off the event loop
                await asyncio.to_thread(gatekeeper.admit, key, prompt_tokens + most_tokens)
            if meter is not None:
                gen.metered = True
                meter.watch(gen.request_ids(len(prompts) * req.n))
            await gen.start(engine, prompts, params)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and (gen.metered or meter is None):
                _withdraw(gen)  # the client left while it was being added: abort what lands, bill what ran
            elif meter is not None:  # refused before any engine work: nothing to record, nothing to hold
                gen.metered = False
                meter.release(gen.request_ids(len(prompts) * req.n))
                asyncio.get_running_loop().run_in_executor(None, meter.budgets.release, gen.id)
            raise
        return gen

    settling: set[asyncio.Task] = set()  # ledger rows of withdrawn calls, being written

    async def _settle(gen: Generation) -> None:
        """Write the call's ledger row durably (before its response ends), once however the
        call ends, and put its cost and price into gen.usage()."""
        if gen.metered:
            gen.metered = False
            await _record(gen)

    async def _record(gen: Generation) -> None:
        await gen.ended()  # the engine's last word on every choice: all the steps it was in
        row = ledger_row(gen, meter)
        gen.cost, gen.price, gen.engine_seconds = row.cost, row.price, row.engine_seconds
        await asyncio.to_thread(meter.settle, row)

    def _withdraw(gen: Generation) -> None:
        """The call ends early or has ended (its caller may be gone): abort what still runs, and
        settle in the background once the engine has ended each abort."""
        gen.abort()
        if gen.metered:
            gen.metered = False
            task = asyncio.get_running_loop().create_task(_record(gen))
            settling.add(task)
            task.add_done_callback(settling.discard)

    async def _collect(gen: Generation, echo: bool) -> dict:
        """Run the choices to the end: the non-streaming response body."""
        try:
            async for choice, out in gen.updates():
                _absorb(choice, out)
            await _settle(gen)
        finally:
            _withdraw(gen)
        return gen.envelope([_final_choice(gen, c, echo) for c in gen.choices], usage=gen.usage())

    async def complete_in_batch_lane(url: str, body: dict) -> dict:
        """One Batch API line: what POST `url` with `body` would return, run in the batch lane."""
        kind = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}.get(url)
        if kind is None:
            raise APIError(400, f"unsupported url {url!r}; use /v1/chat/completions or /v1/completions", param="url")
        model = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = model.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            raise APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                           param=str(first["loc"][0]) if first["loc"] else None) from None
        if req.stream:
            raise APIError(400, "stream is not supported in a batch", param="stream")
        return await _collect(await _start(req, kind, "batch", None, request_tags(req, None), None),
                              kind == "completion" and req.echo)

    app.include_router(dashboard_router(stats, gatekeeper, model_name, meter))

    if batch_dir is not None:
        store = BatchStore(batch_dir)
        runner = BatchRunner(store, complete_in_batch_lane)
        app.include_router(batch_router(store, runner, caller))

    def _absorb(choice, out) -> tuple[str, list[dict]]:
        """Fold an output into its choice; returns the new text and new logprob entries."""
        choice.pieces.append(out.new_text)
        choice.text_len += len(out.new_text)
        choice.num_tokens = out.num_output_tokens
        choice.logprobs.extend(out.new_logprobs)
        choice.output = out
        if out.finished:
            choice.finish_reason = out.finish_reason
        return out.new_text, out.new_logprobs

    def _final_choice(gen: Generation, c, echo: bool) -> dict:
        if gen.kind == "chat":
            lp = {"content": [token_entry(tokenizer, e) for e in c.logprobs]} if c.logprobs else None
            return {"index": c.index, "message": {"role": "assistant", "content": "".join(c.pieces)}, "logprobs": lp,
                    "finish_reason": c.finish_reason}
        prefix = tokenizer.decode(c.prompt_ids) if echo else ""
        lp = completion_logprobs(tokenizer, c.logprobs, len(prefix)) if c.logprobs else None
        return {"index": c.index, "text": prefix + "".join(c.pieces), "logprobs": lp, "finish_reason": c.finish_reason}

    async def _sse(gen: Generation, include_usage: bool, echo: bool) -> AsyncIterator[str]:
        started = set()
        try:
            async for choice, out in gen.updates():
                text, new_logprobs = _absorb(choice, out)
                if gen.kind == "chat":
                    delta = {"content": text}
                    if choice.index not in started:
                        delta["role"] = "assistant"
                    lp = {"content": [token_entry(tokenizer, e) for e in new_logprobs]} if new_logprobs else None
                    body = {"index": choice.index, "delta": delta, "logprobs": lp, "finish_reason": choice.finish_reason}
                else:
                    if echo and choice.index not in started:
                        text = tokenizer.decode(choice.prompt_ids) + text
                    offset = choice.text_len - len(out.new_text)
                    lp = completion_logprobs(tokenizer, new_logprobs, offset) if new_logprobs else None
                    body = {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": choice.finish_reason}
                started.add(choice.index)
                extra = {"usage": None} if include_usage else {}
                yield _event(gen.envelope([body], chunk=True, **extra))
            await _settle(gen)
            if include_usage:
                yield _event(gen.envelope([], chunk=True, usage=gen.usage()))
        except APIError as e:  # too late for a status code: the error goes in the stream
            yield _event(errors.error_body(e.status, e.message, e.param, e.code))
        except Exception as e:  # noqa: BLE001 -- the engine died under this stream
            yield _event(errors.error_body(500, f"internal error: {type(e).__name__}"))
        yield "data: [DONE]\n\n"  # the response's on_close withdraws and settles whatever is left

    return app


_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps with options builds an encoder per call


def _event(payload: dict) -> str:
    return f"data: {_JSON.encode(payload)}\n\n"
