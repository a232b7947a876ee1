"""POST /v1/completions and /v1/chat/completions: a body checked (validation.py) becomes a
Generation in the lane the key may use, answered whole or as server-sent events (kept alive
while they wait: keep_alive.py).

A client that hangs up has its request withdrawn (aborted in the engine, billed for what ran)
wherever it was: being admitted, queued, running, or streaming."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from tollway.config import KeySpec
from tollway.server import errors
from tollway.server.call_ids import trusted_call_id
from tollway.server.call_timing import CallTiming, asked_for, trace_context
from tollway.server.disconnects import ClientGone, ClosingStreamingResponse, unless_disconnected
from tollway.server.errors import APIError
from tollway.server.generation import Generation
from tollway.server.keep_alive import with_keep_alive
from tollway.server.protocol import ChatCompletionRequest, CompletionRequest
from tollway.server.responses import chunk_choice, event
from tollway.server.service import Service, caller, service
from tollway.server.service_tier import asked_tier

router = APIRouter()


async def _call_id(request: Request, svc: Service = Depends(service)) -> str | None:
    return trusted_call_id(request.headers, svc.fleet_secret)


@router.post("/v1/completions")
async def completions(request: Request, req: CompletionRequest, key: KeySpec | None = Depends(caller),
                      x_tollway_tags: str | None = Header(default=None), call: str | None = Depends(_call_id),
                      svc: Service = Depends(service)) -> Response:
    return await _serve(svc, request, req, key, x_tollway_tags, call)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, req: ChatCompletionRequest, key: KeySpec | None = Depends(caller),
                           x_tollway_tags: str | None = Header(default=None), call: str | None = Depends(_call_id),
                           svc: Service = Depends(service)) -> Response:
    return await _serve(svc, request, req, key, x_tollway_tags, call)


async def _serve(svc: Service, request: Request, req: CompletionRequest | ChatCompletionRequest,
                 key: KeySpec | None, tags_header: str | None, call: str | None) -> Response:
    timing = CallTiming(request.state.received, parent=trace_context(request.headers))
    try:
        return await unless_disconnected(request, _respond(svc, req, key, tags_header, call, timing,
                                                           asked_for(request.headers)))
    except ClientGone:
        return Response(status_code=499)  # nginx's "client closed request": no one reads it


async def _respond(svc: Service, req: CompletionRequest | ChatCompletionRequest, key: KeySpec | None,
                   tags_header: str | None, call: str | None, timing: CallTiming, timing_asked: bool) -> Response:
    tier = svc.gatekeeper.entitled_tier(key, *asked_tier(req.service_tier, req.priority))
    sub = svc.validate(req, tags_header)
    timing.validated = time.monotonic()
    # a priority other than 0 chose its lane: the canary promotes only calls that left it to the server
    eligible = not req.priority and svc.canary.eligible(key, sub.tags, req.service_tier)
    gen, headers = await svc.start(sub, tier, key, call, canary_eligible=eligible, timing=timing)
    gen.timing_asked = timing_asked
    headers["x-request-id"] = gen.id
    if req.stream:
        if timing_asked:  # sent before any token: the stages up to the engine's taking it
            headers["server-timing"] = timing.server_timing([])
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = with_keep_alive(_events(svc, gen, include_usage, sub.echo), svc.keep_alive)
        return ClosingStreamingResponse(events, lambda: svc.withdraw(gen), media_type="text/event-stream",
                                        headers=headers)
    body = await svc.collect(gen, sub.echo)
    if svc.meter is not None:
        headers["x-tollway-cost"] = f"{body['usage']['cost']:.10f}"
    if timing_asked:
        headers["server-timing"] = timing.server_timing(gen.outputs())
    return JSONResponse(body, headers=headers)


async def _events(svc: Service, gen: Generation, include_usage: bool, echo: bool) -> AsyncIterator[str]:
    started = set()
    try:
        async for choice, out in gen.updates():
            choice.absorb(out)
            body = chunk_choice(gen, choice, out, choice.index not in started, echo, svc.tokenizer)
            started.add(choice.index)
            extra = {"usage": None} if include_usage else {}
            if out.new_token_ids:
                gen.timing.sent()
            yield event(gen.envelope([body], chunk=True, **extra))
        await svc.settle(gen)
        if include_usage:
            yield event(gen.envelope([], chunk=True, usage=gen.usage()))
    except APIError as e:  # too late for a status code: the error goes in the stream
        yield event(errors.error_body(e.status, e.message, e.param, e.code))
    except Exception as e:  # noqa: BLE001 -- the engine died under this stream
        yield event(errors.error_body(500, f"internal error: {type(e).__name__}"))
    yield "data: [DONE]\n\n"  # the response's on_close withdraws and settles whatever is left
