"""POST /v1/responses (OpenAI's Responses API), whole or as its event stream, and GET and DELETE
/v1/responses/{id} and GET /v1/responses/{id}/input_items for the kept ones. A response runs as
the chat completion it translates to (response_turn.py), in the lane the key may use, metered
and billed as chat is; its output becomes Responses items (responses_output.py). Kept responses
(store, the default) live in the ledger's database (response_store.py): a server without a
ledger keeps none."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from tollway.config import KeySpec
from tollway.server.call_ids import trusted_call_id
from tollway.server.call_timing import CallTiming, asked_for, trace_context
from tollway.server.disconnects import ClientGone, ClosingStreamingResponse, unless_disconnected
from tollway.server.errors import APIError
from tollway.server.keep_alive import with_keep_alive
from tollway.server.keys import owner_of
from tollway.server.responses import chunk_choice
from tollway.server.response_turn import Turn, begin, not_found, whole
from tollway.server.responses_input import page
from tollway.server.responses_output import OutputItems, item_status, named_event, status_of
from tollway.server.responses_protocol import ResponsesRequest
from tollway.server.service import Service, caller, service
from tollway.server.service_tier import tier_for

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request, req: ResponsesRequest, key: KeySpec | None = Depends(caller),
                          x_tollway_tags: str | None = Header(default=None),
                          svc: Service = Depends(service)) -> Response:
    timing = CallTiming(request.state.received, parent=trace_context(request.headers))
    call = trusted_call_id(request.headers, svc.fleet_secret)
    try:
        return await unless_disconnected(request, _respond(svc, req, key, x_tollway_tags, call, timing,
                                                           asked_for(request.headers)))
    except ClientGone:
        return Response(status_code=499)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, key: KeySpec | None = Depends(caller),
                       svc: Service = Depends(service)) -> dict:
    body = await asyncio.to_thread(svc.responses.get, response_id, owner_of(key)) if svc.responses else None
    if body is None:
        raise not_found(response_id, None)
    return body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, key: KeySpec | None = Depends(caller),
                          svc: Service = Depends(service)) -> dict:
    if not (svc.responses and await asyncio.to_thread(svc.responses.delete, response_id, owner_of(key))):
        raise not_found(response_id, None)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: str, order: str = "desc", after: str | None = None,
                           limit: int = 20, key: KeySpec | None = Depends(caller),
                           svc: Service = Depends(service)) -> dict:
    # include[]=... as the openai client sends it, or include=...
    if request.query_params.getlist("include[]") or request.query_params.getlist("include"):
        raise APIError(400, "include is not supported: input items here are text and calls, with nothing more "
                            "to include", param="include")
    items = await asyncio.to_thread(svc.responses.input_items, response_id, owner_of(key)) if svc.responses else None
    if items is None:
        raise not_found(response_id, None)
    return page(items, order, after, limit)


async def _respond(svc: Service, req: ResponsesRequest, key: KeySpec | None, tags_header: str | None,
                   call: str | None, timing: CallTiming, timing_asked: bool) -> Response:
    tier = svc.gatekeeper.entitled_tier(key, tier_for(req.service_tier), req.service_tier)
    turn, headers = await begin(svc, req, key, owner_of(key), tier, call, tags_header, canary=True, timing=timing)
    gen = turn.gen
    gen.timing_asked = timing_asked
    headers["x-request-id"] = turn.id
    if req.stream:
        if timing_asked:
            headers["server-timing"] = timing.server_timing([])
        events = with_keep_alive(_events(turn), svc.keep_alive)
        return ClosingStreamingResponse(events, lambda: svc.withdraw(gen), media_type="text/event-stream",
                                        headers=headers)
    body = await whole(turn)
    if svc.meter is not None:
        headers["x-tollway-cost"] = f"{body['usage']['cost']:.10f}"
    if timing_asked:
        headers["server-timing"] = timing.server_timing(gen.outputs())
    return JSONResponse(body, headers=headers)


async def _events(turn: Turn) -> AsyncIterator[str]:
    numbers = itertools.count()

    def numbered(event: dict) -> str:
        return named_event({**event, "sequence_number": next(numbers)})

    svc, gen = turn.svc, turn.gen
    yield numbered({"type": "response.created", "response": turn.body()})
    yield numbered({"type": "response.in_progress", "response": turn.body()})
    items, finish_reason = OutputItems(), None
    try:
        async for choice, out in gen.updates():
            choice.absorb(out)
            chunk = chunk_choice(gen, choice, out, False, False, svc.tokenizer)
            finish_reason = chunk["finish_reason"] or finish_reason
            if out.new_token_ids:
                gen.timing.sent()
            for event in items.add(chunk["delta"], (chunk["logprobs"] or {}).get("content")):
                yield numbered(event)
        await svc.settle(gen)
        status = status_of(finish_reason)
        for event in items.finish(item_status(status)):
            yield numbered(event)
        body = await turn.finish(items, status)
        # OpenAI's stream has no event for a cancelled response: it is not complete
        done = "response.completed" if status == "completed" else "response.incomplete"
        yield numbered({"type": done, "response": body})
    except APIError as e:  # too late for a status code: the error goes in the stream
        yield numbered({"type": "error", "code": e.code, "message": e.message, "param": e.param})
    except Exception as e:  # noqa: BLE001 -- the engine died under this stream
        yield numbered({"type": "error", "code": "server_error", "message": f"internal error: {type(e).__name__}",
                        "param": None})
