"""Fast requests first through admission. In a burst, every request's admission (parsing its
body, checking its key and limits, tokenizing its prompt) runs on the event loop one after
another, in arrival order: a fast request sent among 64 others waited for most of them, tens of
milliseconds, before the scheduler saw it.

This middleware reads a generation request's body before the route does (and hands it on
unchanged) and looks for the priority tier in it (service_tier, or vLLM's negative priority). A
request that does not ask for it yields the loop once before its admission, so every fast
request that arrived in the same moment is admitted first. The look is a pattern on the raw
bytes, not a parse: a parse would double the work this saves, and a fast request the pattern
misses is only admitted in its arrival order.
"""
from __future__ import annotations

import asyncio
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tollway.tier_names import TIER_OF

ROUTES = {"/v1/chat/completions", "/v1/completions"}
# Bodies larger than this (by their content-length) go by unread: no reordering is worth holding
# a large body before the route's own checks.
MAX_PEEK_BYTES = 1 << 20
_FAST = re.compile(rb'"service_tier"\s*:\s*"(' + b"|".join(
    name.encode() for name, tier in TIER_OF.items() if tier == "fast") + rb')"|"priority"\s*:\s*-[1-9]')


class FastFirst:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if not length.isdigit() or int(length) > MAX_PEEK_BYTES:
            return await self.app(scope, receive, send)
        messages: list[Message] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if not _FAST.search(body):
            await asyncio.sleep(0)  # fast requests that arrived with this one go first

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
