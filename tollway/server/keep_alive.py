"""SSE keep-alive: a stream that has nothing to send for a while sends a comment line, which
clients ignore, so that a proxy's idle timeout (often 60 s) does not cut a request that is
still waiting in its lane (a `flex` request may queue for minutes before its first token)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tollway.config import ServerConfig

COMMENT = ": keep-alive\n\n"
DEFAULT_INTERVAL = ServerConfig.sse_keep_alive  # [server] sse_keep_alive, --sse-keep-alive


async def with_keep_alive(events: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """`events`, with a COMMENT after every `interval` seconds in which none came."""
    source = aiter(events)
    pending = asyncio.ensure_future(anext(source))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield COMMENT
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(source))
    finally:
        # The reader is gone or done: stop the source where it waits, then let it clean up
        # (the events' own finally withdraws the call) once it no longer runs in that task.
        pending.cancel()
        await asyncio.wait({pending})
        await source.aclose()
