"""AsyncEngine: the engine loop in its own thread, fanned out to asyncio callers.

The Engine is not thread-safe, so only the engine thread touches it: callers post commands
(add, abort) to a queue that the thread drains between steps, and each request's outputs come
back through its own asyncio queue, put there with call_soon_threadsafe. Nothing blocks the
event loop, and a step never waits on a slow client.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

from tollway.engine import Engine
from tollway.outputs import RequestOutput
from tollway.request import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; nothing more can run."""


class RequestStream:
    """One request's outputs, in order, ending with the finished one. Leaving it early (an
    `async with` block exited, or abort()) aborts the request and frees its KV blocks."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue):
        self.engine, self.request_id, self._outputs = engine, request_id, outputs
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            self.finished = True
            raise EngineDeadError("the engine stopped") from out
        self.finished = out.finished
        return out

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            if self.engine.alive:
                self.engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


class AsyncEngine:
    def __init__(self, engine: Engine, on_step=None):
        """on_step(engine, plan, result, outputs): called on the engine thread after every
        step that ran, before its outputs are handed out (metrics, the meter); more can be
        added with observe()."""
        self.engine = engine
        self._observers = (on_step,) if on_step is not None else ()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tollway-engine", daemon=True)
        self._thread.start()

    async def add(self, prompt: str | list[int], params: SamplingParams, tier: str = "standard",
                  request_id: str | None = None) -> RequestStream:
        """Submit a request. Bad input (a ValueError: a full queue, a prompt too long, bad
        sampling values) is raised here; outputs then come from the returned stream."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        self._post(("add", prompt, params, tier, request_id, loop, outputs, added))
        return RequestStream(self, await asyncio.wrap_future(added), outputs)

    async def generate(self, prompt: str | list[int], params: SamplingParams, tier: str = "standard",
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """add() and iterate: the request's outputs until it finishes."""
        stream = await self.add(prompt, params, tier, request_id)
        async with stream:
            async for out in stream:
                yield out

    def observe(self, on_step) -> None:
        """Call on_step(engine, plan, result, outputs) after every step from now on."""
        self._observers = (*self._observers, on_step)  # one assignment: the engine thread sees old or new

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def run(self, fn):
        """Run fn(engine) on the engine thread between steps; a Future of its result. For
        reading engine state (e.g. the block pool) consistently."""
        done: Future = Future()
        self._post(("call", fn, done))
        return done

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _post(self, command: tuple) -> None:
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self._commands.put(command)

    # ---- the engine thread --------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._stopping:
                # Block for work only while idle; between steps take whatever has arrived.
                block = not self.engine.has_unfinished()
                self._drain(block)
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    if self.engine.last_plan.seqs:
                        for observe in self._observers:
                            observe(self.engine, self.engine.last_plan, self.engine.last_result, outputs)
                    for out in outputs:
                        self._deliver(out.request_id, out, last=out.finished)
        except BaseException as e:  # noqa: BLE001 -- every waiter must hear of it
            self.error = e
            for rid in list(self._outputs):
                self._deliver(rid, e, last=True)

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, prompt, params, tier, request_id, loop, outputs, added = command
            try:
                rid = self.engine.add_request(prompt, params, tier=tier, request_id=request_id)
            except ValueError as e:
                added.set_exception(e)
                return
            self._outputs[rid] = (loop, outputs)
            added.set_result(rid)
        elif kind == "abort":
            self.engine.abort(command[1])
            self._outputs.pop(command[1], None)
        elif kind == "call":
            _, fn, done = command
            try:
                done.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 -- handed to the caller
                done.set_exception(e)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        target = self._outputs.pop(request_id, None) if last else self._outputs.get(request_id)
        if target is not None:
            loop, outputs = target
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # that caller's event loop is closed: nobody is listening
                self.engine.abort(request_id)
