"""When a client hangs up: its work is withdrawn however far it had got. Starlette stops a
streaming response when the client goes, but never starts its body if the client left before
the first byte, and it does not notice at all while a plain response is being worked out."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready; no one is left to answer."""


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` (awaited if it returns an awaitable) however
    it ends: finished, failed, or cut off by the client, before or after its first byte."""

    def __init__(self, content, on_close: Callable[[], Awaitable[None] | None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            closing = self.on_close()
            if inspect.isawaitable(closing):
                await closing


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it and raising ClientGone if the client disconnects first. Call
    it once the request's body has been read: it listens for the disconnect on the same channel."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait((task, listener), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself was cancelled (server shutting down)
        task.cancel()
        raise
    finally:
        listener.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its cleanup runs before we answer
        raise ClientGone()
    return task.result()
