"""AsyncEngine: the engine loop in its own thread, fanned out to asyncio callers.

The Engine is not thread-safe, so only the engine thread touches it: callers post commands
(add, abort) to a queue that the thread drains between steps, and each request's outputs come
back through its own asyncio queue, put there with call_soon_threadsafe. Nothing blocks the
event loop, and a step never waits on a slow client.

Every request ends the same way, whether it finished or was aborted (while waiting, mid-prefill,
preempted, or while a step that holds it runs: the abort is applied after that step): the
scheduler frees its blocks and slot, and a final RequestOutput goes to the observers and then
to its stream, which always ends with exactly one. After every change the thread publishes the
scheduler's Occupancy and the running requests (each with when a plan last took it, for the
watchdog). No books are kept by request id: each request carries its outlet (Request.listener).
"""
from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

import torch

from tollway.engine import Engine
from tollway.outputs import RequestOutput
from tollway.request import Request, SamplingParams, Submission
from tollway.scheduler.occupancy import Occupancy
from tollway.step_report import StepReport


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; nothing more can run."""


class RequestStream:
    """One request's outputs, in order, ending with the finished one. Leaving it early (an
    `async with` block exited, or abort()) aborts the request and frees its KV blocks; ended()
    then gives the engine's last word on it."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue):
        self.engine, self.request_id, self._outputs = engine, request_id, outputs
        self.finished = False  # nothing more is read through iteration: it ended, or was left
        self.final: RequestOutput | None = None  # the request's last output, once received

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self._next()
        self.finished = out.finished
        return out

    async def _next(self) -> RequestOutput:
        out = await self._outputs.get()
        if isinstance(out, BaseException):
            self.finished = True
            raise EngineDeadError("the engine stopped") from out
        if out.finished:
            self.final = out
        return out

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            if self.engine.alive:
                self.engine.abort(self.request_id)

    async def ended(self) -> RequestOutput:
        """The request's last output, waiting for it if need be: the finished one, or after
        abort() the engine's (finish_reason "abort"), whose counts include any tokens made after
        the caller stopped reading. Outputs not read before are skipped. Raises EngineDeadError
        if the engine stops first."""
        while self.final is None:
            await self._next()
        return self.final

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


class AsyncEngine:
    def __init__(self, engine: Engine, on_step=None):
        """on_step(report): called with each StepReport on the engine thread, before its
        outputs are handed out (metrics, the meter): after every step that ran or paused, and
        with no plan for the final outputs of requests aborted between steps. More can be
        added with observe()."""
        self.engine = engine
        self._fast_lane = engine.scheduler.policy.fast_lane  # read-only: safe from any thread
        self._observers = (on_step,) if on_step is not None else ()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Outputs the engine has made (each request's listener, an _Outlet, puts them here), to be
        # handed out once the observers have seen their step.
        self._made: list[tuple[_Outlet, RequestOutput]] = []
        self._aborted: list[RequestOutput] = []  # final outputs of aborts, for the observers
        self._stopping = False
        self.error: BaseException | None = None
        # Published by the engine thread after every change; read from any thread.
        self.occupancy = engine.occupancy()
        self.running: tuple[Request, ...] = ()  # each with when a plan last took it (the watchdog's)
        self.longest_step = 0.0  # seconds: the longest step measured so far
        self._thread = threading.Thread(target=self._loop, name="tollway-engine", daemon=True)
        self._thread.start()

    def check(self, prompt: str | list[int], params: SamplingParams) -> Submission:
        """Engine.check, from any thread: InvalidRequest for bad input."""
        return self.engine.check(prompt, params)

    async def add(self, submission: Submission, tier: str = "standard", request_id: str | None = None,
                  tab: object | None = None) -> RequestStream:
        """Submit a request checked at the edge (check(), or the server's validation). What only
        the scheduler knows is raised here (QueueFullError, InvalidRequest for a prompt past its
        lane's KV share); outputs then come from the returned stream. A caller cancelled while
        the add is queued leaves nothing behind: the request is aborted once it lands. `tab`: the
        meter's, which the request carries (meter/tab.py)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        self._post(("add", submission, tier, request_id, tab, loop, outputs, added))
        if self._fast_lane(tier):  # the step in flight stops after its current layer to let it in
            self.engine.runner.step_yield.ask()
        try:
            rid = await asyncio.wrap_future(added)
        except asyncio.CancelledError:  # if the engine thread had taken the add up, abort it once added
            added.add_done_callback(self._abort_orphan)
            raise
        return RequestStream(self, rid, outputs)

    def _abort_orphan(self, added: Future) -> None:
        if not added.cancelled() and added.exception() is None and self.alive:
            self.abort(added.result())

    async def generate(self, prompt: str | list[int], params: SamplingParams, tier: str = "standard",
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """check(), add() and iterate: the request's outputs until it finishes."""
        stream = await self.add(self.check(prompt, params), tier, request_id)
        async with stream:
            async for out in stream:
                yield out

    def observe(self, on_step) -> None:
        """Call on_step(report) after every step from now on."""
        self._observers = (*self._observers, on_step)  # one assignment: the engine thread sees old or new

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def fault_in_kv(self) -> None:
        """Fault the KV pool's pages in on a thread of their own (ModelRunner.fault_in_kv): for a
        server, before its first requests."""
        self.engine.runner.fault_in_kv()

    def refuse_unstarted(self, error) -> int:
        """Abort every queued request that has never run (preempted ones have, and stay), each
        stream ending with error(tier) raised in place of outputs; how many were refused."""
        def refuse(engine: Engine) -> int:
            queued = engine.unstarted()
            refused = [(r.listener, error(r.tier), True) for r in queued if isinstance(r.listener, _Outlet)]
            for request in queued:
                request.listener = None  # its stream ends with the error, not with the abort's output
                engine.abort(request.request_id)
            self._deliver(refused)
            return len(queued)

        return self.run(refuse).result()

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
    def tokenizer(self):
        return self.engine.tokenizer  # set once at load: safe from any thread

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tool_call_parser(self) -> str | None:
        return self.engine.config.tool_call_parser

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

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
            with torch.inference_mode():  # once for the thread, not once a step (ModelRunner.execute)
                self._steps()
            stopped: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as e:  # noqa: BLE001 -- every waiter must hear of it
            self.error = stopped = e
        # Every stream still waiting hears of it, those whose outputs were made but not handed out too.
        outlets = dict.fromkeys([o for o, _ in self._made] + [r.listener for r in self.engine.unfinished()])
        self._deliver([(outlet, stopped, True) for outlet in outlets if isinstance(outlet, _Outlet)])

    def _steps(self) -> None:
        while not self._stopping:
            # Block for work only while idle; between steps take whatever has arrived. A fast
            # request posted from now on asks the next step to stop for it; one posted before
            # is taken in by this drain.
            self.engine.runner.step_yield.clear()
            block = not self.engine.has_unfinished()
            if self._drain(block):
                self._publish(self.engine.occupancy())  # before anyone hears of what the commands did
            self._end_aborted()
            if self.engine.has_unfinished():
                report = self.engine.step()
                if report.ran:
                    self.longest_step = max(self.longest_step, report.result.seconds)
                if report.ran or report.paused:
                    for observe in self._observers:
                        observe(report)
                self._publish(report.occupancy)
                self._deliver_made()
                if self._aborted:  # a caller whose event loop closed meanwhile
                    self._publish(self.engine.occupancy())
                    self._end_aborted()

    def _publish(self, occupancy: Occupancy) -> None:
        """Occupancy and the running requests, as of now."""
        self.running = tuple(self.engine.running())
        self.occupancy = occupancy

    def _drain(self, block: bool) -> bool:
        """Apply the commands posted so far; whether there were any."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, submission, tier, request_id, tab, loop, outputs, added = command
            if not added.set_running_or_notify_cancel():
                return  # its caller was cancelled while this was queued: nothing to add
            try:
                rid = self.engine.submit(submission, tier, request_id, tab, _Outlet(loop, outputs, self._made))
            except ValueError as e:
                added.set_exception(e)
                return
            added.set_result(rid)
        elif kind == "abort":
            self._abort(command[1])
        elif kind == "call":
            _, fn, done = command
            try:
                done.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 -- handed to the caller
                done.set_exception(e)

    def _abort(self, request_id: str) -> None:
        """The one way a request leaves early. An unknown id (finished already, or its add
        failed) is a no-op: its stream has had its final output, or never existed."""
        out = self.engine.abort(request_id)
        if out is not None:
            self._aborted.append(out)

    def _end_aborted(self) -> None:
        """Aborted requests' final outputs: to the observers, then to their streams."""
        while self._aborted:
            outputs, self._aborted = self._aborted, []
            report = StepReport(None, None, outputs, self.engine.occupancy())
            for observe in self._observers:
                observe(report)
            self._deliver_made()

    def _deliver_made(self) -> None:
        made = self._made[:]
        self._made.clear()  # in place: every outlet holds this list
        self._deliver([(outlet, out, out.finished) for outlet, out in made])

    def _deliver(self, items: list[tuple[_Outlet, object, bool]]) -> None:
        """Hand each (outlet, output or error, whether it is the last) to its stream: one
        wake-up per event loop for them all, since each wake-up is a system call and a turn of
        that loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object, bool]]] = {}
        for outlet, item, last in items:
            batches.setdefault(outlet.loop, []).append((outlet.queue, item, last))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that caller's event loop is closed: nobody is listening
                for _, item, last in batch:
                    if not last:
                        self._abort(item.request_id)


class _Outlet:
    """Where one request's outputs go (its Request.listener): its stream's queue, on its
    caller's event loop. The engine calls it with each output it makes; AsyncEngine hands them
    out once the step's observers have run."""

    __slots__ = ("loop", "queue", "made")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, made: list):
        self.loop, self.queue, self.made = loop, queue, made

    def __call__(self, out: RequestOutput) -> None:
        self.made.append((self, out))


def _put_all(batch: list[tuple[asyncio.Queue, object, bool]]) -> None:
    for outputs, item, _ in batch:
        outputs.put_nowait(item)
