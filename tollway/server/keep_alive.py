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
    """`events`, with a COMMENT after every `interval` seconds in which none came. One task per
    stream reads `events` into a queue, and each wait is bounded by a timeout on this task: a task
    per event, as `asyncio.wait` on the next item would need, cost 2.5x as much per event."""
    queue: asyncio.Queue = asyncio.Queue()
    source = aiter(events)
    pump = asyncio.ensure_future(_read(source, queue))
    try:
        while True:
            try:
                async with asyncio.timeout(interval):
                    item = await queue.get()
            except TimeoutError:
                yield COMMENT
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        # The reader is gone or done: stop the source where it waits, then let it clean up
        # (the events' own finally withdraws the call) once it no longer runs in that task.
        pump.cancel()
        await asyncio.wait({pump})
        await source.aclose()


_END = object()  # the source is exhausted


async def _read(source: AsyncIterator[str], queue: asyncio.Queue) -> None:
    """Every item of `source` into `queue`, then _END; an error it raises goes in its place."""
    try:
        async for item in source:
            queue.put_nowait(item)
    except Exception as e:  # noqa: BLE001 -- raised again to the stream's reader
        queue.put_nowait(e)
        return
    queue.put_nowait(_END)
