"""A response's input as the items GET /v1/responses/{id}/input_items lists, in OpenAI's
shapes: a string is one user message, and every item gets an id (the client's own, if it gave
one) and a status. Called on input that chat_request has accepted, so each item is well formed."""
from __future__ import annotations

import secrets
from typing import Any

from tollway.server.errors import APIError

MAX_PAGE = 100  # OpenAI's most input items per page; 20 by default


def input_items(given: str | list[Any] | None) -> list[dict]:
    if given is None:
        return []
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    return [_item(item) for item in given]


def _item(item: dict) -> dict:
    kind = item.get("type", "message")
    if kind == "message":
        content = item["content"]
        texts = [content] if isinstance(content, str) else [part["text"] for part in content]
        # an assistant's message is listed as an output message (its text output_text, with
        # annotations), the others as input messages
        part = {"type": "output_text", "annotations": []} if item["role"] == "assistant" else {"type": "input_text"}
        return {"id": _id(item, "msg"), "type": "message", "role": item["role"], "status": "completed",
                "content": [{**part, "text": text} for text in texts]}
    if kind == "function_call":
        return {"id": _id(item, "fc"), "type": kind, "status": "completed",
                **{k: item[k] for k in ("call_id", "name", "arguments")}}
    return {"id": _id(item, "fco"), "type": kind, "status": "completed", "call_id": item["call_id"],
            "output": item["output"]}


def page(items: list[dict], order: str, after: str | None, limit: int) -> dict:
    """One page of the list, as OpenAI's: newest (last) first unless order is "asc"; `after`:
    the id of the item the page starts after."""
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be 'asc' or 'desc'", param="order")
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"limit must be between 1 and {MAX_PAGE}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise APIError(400, f"after: no input item of this response has the id {after[:64]!r}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


def _id(item: dict, prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else f"{prefix}_{secrets.token_hex(16)}"
