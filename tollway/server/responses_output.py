"""A Responses API response built from its chat completion: the chat deltas (a stream's, or
the whole message at once) become output items (a message with output_text, function_call
items) and the stream events that build them, in the shapes the openai client parses."""
from __future__ import annotations

import copy
import json
import secrets
from typing import Any

from tollway.server.responses_protocol import ResponsesRequest

_JSON = json.JSONEncoder(separators=(",", ":"))


def named_event(payload: dict) -> str:
    """One server-sent event, named by its type as OpenAI's are."""
    return f"event: {payload['type']}\ndata: {_JSON.encode(payload)}\n\n"


class OutputItems:
    """A response's output items, built delta by delta. Each method returns the stream events
    (without sequence numbers) its change makes; an item is open until the next one starts or
    the output ends."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: int | None = None  # the output index of the item being written
        self._calls: dict[int, int] = {}  # a chat tool call's index -> its item's output index
        self._logprobs: list[dict] = []  # those of tokens whose text has not come yet (part of a character)

    def add(self, delta: dict, logprobs: list[dict] | None = None) -> list[dict]:
        """What a chat delta ({"content": ...} and/or {"tool_calls": [...]}) adds, with chat's
        logprobs entries of its tokens, if asked for (the same shape as an output_text's)."""
        events = []
        self._logprobs += logprobs or ()
        if delta.get("content"):
            logprobs, self._logprobs = self._logprobs, []  # taken before _start closes the item before
            if self._open is None or self.items[self._open]["type"] != "message":
                events += self._start({"id": f"msg_{secrets.token_hex(16)}", "type": "message",
                                       "status": "in_progress", "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(self._part_event("response.content_part.added", part=copy.deepcopy(part)))
                self.items[self._open]["content"].append(part)
            part = self.items[self._open]["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += logprobs
            events.append(self._part_event("response.output_text.delta", delta=delta["content"], logprobs=logprobs))
        if delta.get("tool_calls"):
            self._logprobs = []  # a call's tokens: its item has no logprobs
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            if call.get("index", 0) not in self._calls:
                events += self._start({"id": f"fc_{secrets.token_hex(16)}", "type": "function_call",
                                       "status": "in_progress", "call_id": call.get("id"),
                                       "name": function.get("name"), "arguments": ""})
                self._calls[call.get("index", 0)] = self._open
            index = self._calls[call.get("index", 0)]
            if function.get("arguments"):
                self.items[index]["arguments"] += function["arguments"]
                events.append({"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                               "output_index": index, "delta": function["arguments"]})
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the last item with `status` ("completed" or "incomplete"): the output has ended."""
        pending, self._logprobs = self._logprobs, []
        if self._open is None:
            return []
        index, item = self._open, self.items[self._open]
        self._open = None
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += pending
            events = [self._item_event(index, "response.output_text.done", content_index=0, text=part["text"],
                                       logprobs=part["logprobs"]),
                      self._item_event(index, "response.content_part.done", content_index=0, part=copy.deepcopy(part))]
        else:
            events = [self._item_event(index, "response.function_call_arguments.done", name=item["name"],
                                       arguments=item["arguments"])]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]

    def _start(self, item: dict) -> list[dict]:
        events = self.finish("completed")
        self.items.append(item)
        self._open = len(self.items) - 1
        return events + [{"type": "response.output_item.added", "output_index": self._open,
                          "item": copy.deepcopy(item)}]

    def _part_event(self, kind: str, **fields) -> dict:
        return self._item_event(self._open, kind, content_index=0, **fields)

    def _item_event(self, index: int, kind: str, **fields) -> dict:
        return {"type": kind, "item_id": self.items[index]["id"], "output_index": index, **fields}


def message_delta(message: dict) -> dict:
    """A whole chat message as one delta."""
    calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or ())]
    return {"content": message.get("content"), "tool_calls": calls}


def status_of(finish_reason: str | None) -> str:
    """The response's status from its chat finish_reason: "incomplete" where max_output_tokens
    cut it, "cancelled" where it was aborted."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason, "completed")


def item_status(status: str) -> str:
    """The last output item's status at the response's end."""
    return "completed" if status == "completed" else "incomplete"


def response_usage(usage: dict) -> dict:
    """Chat's usage in the Responses API's names; tollway's cost, price, engine_seconds and
    timing kept as they are."""
    own = {k: v for k, v in usage.items() if k not in ("prompt_tokens", "completion_tokens", "total_tokens",
                                                      "prompt_tokens_details")}
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"], **own}


def response_object(response_id: str, created: int, req: ResponsesRequest, model: str, service_tier: str,
                    stored: bool, status: str = "in_progress", output: list[dict] | None = None,
                    usage: dict | None = None) -> dict[str, Any]:
    """The response as OpenAI's Response object; `stored`: whether it is kept."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output or [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p, "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [], "top_logprobs": req.top_logprobs,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled", "usage": usage, "metadata": req.metadata or {}, "service_tier": service_tier,
        "store": stored, "user": req.user, "background": False,
    }
