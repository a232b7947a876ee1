"""POST /v1/responses (OpenAI's Responses API), whole or as its event stream, and GET and DELETE
/v1/responses/{id} for the kept ones. A response runs as the chat completion it translates to
(responses_translation.py), in the lane the key may use, metered and billed as chat is; its
output becomes Responses items (responses_output.py). Kept responses (store, the default) live
in the ledger's database (response_store.py): a server without a ledger keeps none."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from tollway.config import KeySpec
from tollway.server.call_ids import trusted_call_id
from tollway.server.call_timing import CallTiming, asked_for, trace_context
from tollway.server.disconnects import ClientGone, ClosingStreamingResponse, unless_disconnected
from tollway.server.errors import APIError
from tollway.server.generation import Generation
from tollway.server.keep_alive import with_keep_alive
from tollway.server.keys import owner_of
from tollway.server.responses import chunk_choice
from tollway.server.responses_output import (OutputItems, message_delta, named_event, response_object,
                                             response_usage, item_status, status_of)
from tollway.server.responses_protocol import ResponsesRequest
from tollway.server.responses_translation import chat_request, renamed
from tollway.server.service import Service, caller, service
from tollway.server.service_tier import tier_for
from tollway.tier_names import WIRE_NAME

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
        raise _not_found(response_id, None)
    return body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, key: KeySpec | None = Depends(caller),
                          svc: Service = Depends(service)) -> dict:
    if not (svc.responses and await asyncio.to_thread(svc.responses.delete, response_id, owner_of(key))):
        raise _not_found(response_id, None)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


class _Turn:
    """One response being made: its request, its id and the conversation it continues."""

    def __init__(self, svc: Service, req: ResponsesRequest, gen: Generation, conversation: list[dict], owner: str):
        self.svc, self.req, self.gen, self.conversation, self.owner = svc, req, gen, conversation, owner
        # the call's id under the Responses API's prefix: its ledger row is chatcmpl-<the same>
        self.id = "resp_" + gen.id.partition("-")[2]
        self.stored = req.store and svc.responses is not None

    def body(self, status: str = "in_progress", output: list[dict] | None = None, usage: dict | None = None) -> dict:
        return response_object(self.id, self.gen.created, self.req, self.gen.model, WIRE_NAME[self.gen.tier],
                               self.stored, status, output, usage)

    async def finish(self, items: OutputItems, status: str) -> dict:
        """The finished response, kept if it is to be (before the client hears it is done, so
        that it can be continued at once)."""
        body = self.body(status, items.items, response_usage(self.gen.usage()))
        if self.stored:
            reply = _reply_message(items.items)
            await asyncio.to_thread(self.svc.responses.put, body, self.conversation + [reply], self.owner)
        return body


async def _respond(svc: Service, req: ResponsesRequest, key: KeySpec | None, tags_header: str | None,
                   call: str | None, timing: CallTiming, timing_asked: bool) -> Response:
    owner = owner_of(key)
    history = []
    if req.previous_response_id is not None:
        if svc.responses is None:
            raise APIError(400, "this server keeps no responses (it has no ledger): send the whole conversation "
                                "as input", param="previous_response_id")
        history = await asyncio.to_thread(svc.responses.conversation, req.previous_response_id, owner)
        if history is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
    chat, conversation = chat_request(req, history)
    tier = svc.gatekeeper.entitled_tier(key, tier_for(req.service_tier), req.service_tier)
    try:
        sub = svc.validate(chat, tags_header)
    except APIError as e:
        raise renamed(e) from None
    timing.validated = time.monotonic()
    gen, headers = await svc.start(sub, tier, key, call,
                                   canary_eligible=svc.canary.eligible(key, sub.tags, req.service_tier), timing=timing)
    gen.timing_asked = timing_asked
    turn = _Turn(svc, req, gen, conversation, owner)
    headers["x-request-id"] = turn.id
    if req.stream:
        if timing_asked:
            headers["server-timing"] = timing.server_timing([])
        events = with_keep_alive(_events(turn), svc.keep_alive)
        return ClosingStreamingResponse(events, lambda: svc.withdraw(gen), media_type="text/event-stream",
                                        headers=headers)
    chat_body = await svc.collect(gen, False)
    items = OutputItems()
    choice = chat_body["choices"][0]
    items.add(message_delta(choice["message"]))
    status = status_of(choice["finish_reason"])
    items.finish(item_status(status))
    body = await turn.finish(items, status)
    if svc.meter is not None:
        headers["x-tollway-cost"] = f"{body['usage']['cost']:.10f}"
    if timing_asked:
        headers["server-timing"] = timing.server_timing(gen.outputs())
    return JSONResponse(body, headers=headers)


async def _events(turn: _Turn) -> AsyncIterator[str]:
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
            for event in items.add(chunk["delta"]):
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


def _reply_message(items: list[dict]) -> dict:
    """A response's output as the chat message the next turn's template is given."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"Response with id {response_id[:64]!r} not found.", param=param, code="not_found")

