"""One response being made, by POST /v1/responses or a Batch API line: the conversation it
continues (its previous response's, from the store), the chat completion it runs as, started
in its lane, and, once it ends, the Response object, kept if it is to be."""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from tollway.config import KeySpec
from tollway.server.call_timing import CallTiming
from tollway.server.errors import APIError
from tollway.server.generation import Generation
from tollway.server.responses_input import input_items
from tollway.server.responses_output import OutputItems, item_status, message_delta, response_object, \
    response_usage, status_of
from tollway.server.responses_protocol import ResponsesRequest
from tollway.server.responses_translation import chat_request, renamed
from tollway.tier_names import WIRE_NAME

if TYPE_CHECKING:
    from tollway.server.service import Service


class Turn:
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
            await asyncio.to_thread(self.svc.responses.put, body, self.conversation + [reply],
                                    input_items(self.req.input), self.owner)
        return body


async def begin(svc: Service, req: ResponsesRequest, key: KeySpec | None, owner: str, tier: str,
                call: str | None = None, tags_header: str | None = None, from_key_store: bool = False,
                canary: bool = False, timing: CallTiming | None = None) -> tuple[Turn, dict[str, str]]:
    """Start the response in `tier` as the request of `key`, whose owner_of is `owner`
    (`from_key_store`: the key came from Gatekeeper.key_of, a batch's; `canary`: the canary may
    promote it, if Canary.eligible); as Service.start."""
    history = []
    if req.previous_response_id is not None:
        if svc.responses is None:
            raise APIError(400, "this server keeps no responses (it has no ledger): send the whole conversation "
                                "as input", param="previous_response_id")
        history = await asyncio.to_thread(svc.responses.conversation, req.previous_response_id, owner)
        if history is None:
            raise not_found(req.previous_response_id, "previous_response_id")
    chat, conversation = chat_request(req, history)
    try:
        sub = svc.validate(chat, tags_header)
    except APIError as e:
        raise renamed(e) from None
    if timing is not None:
        timing.validated = time.monotonic()
    gen, headers = await svc.start(sub, tier, key, call, owner if from_key_store else None,
                                   canary_eligible=canary and svc.canary.eligible(key, sub.tags, req.service_tier),
                                   timing=timing)
    return Turn(svc, req, gen, conversation, owner), headers


async def whole(turn: Turn) -> dict:
    """The response, run to its end: the Response object."""
    chat_body = await turn.svc.collect(turn.gen, False)
    items = OutputItems()
    choice = chat_body["choices"][0]
    items.add(message_delta(choice["message"]), (choice["logprobs"] or {}).get("content"))
    status = status_of(choice["finish_reason"])
    items.finish(item_status(status))
    return await turn.finish(items, status)


def _reply_message(items: list[dict]) -> dict:
    """A response's output as the chat message the next turn's template is given."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}


def not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"Response with id {response_id[:64]!r} not found.", param=param, code="not_found")
