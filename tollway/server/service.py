"""The server's state and the life of an API call, shared by the route modules: the engine,
and what meters, limits and watches it. An app keeps its Service in app.state; routes reach
it through the `service` and `caller` dependencies."""
from __future__ import annotations

import asyncio
import contextvars
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fastapi import Header, Request

from tollway.async_engine import AsyncEngine
from tollway.config import CanaryConfig, KeySpec
from tollway.meter.budgets import BudgetExceeded
from tollway.meter.meter import Meter
from tollway.meter.tab import Tab
from tollway.server.batch_runner import BatchRunner
from tollway.server.batch_store import BatchStore
from tollway.server.call_timing import CallTiming
from tollway.server.canary import PROMOTED, Canary
from tollway.server.errors import APIError
from tollway.server.generation import Generation, ledger_row
from tollway.server.keep_alive import DEFAULT_INTERVAL
from tollway.server.keys import Gatekeeper
from tollway.server.live_stats import LiveStats
from tollway.server.metrics import Metrics
from tollway.server.response_store import ResponseStore
from tollway.server.response_turn import begin, whole
from tollway.server.responses import final_choice, vllm_prompt_logprobs
from tollway.server.responses_protocol import ResponsesRequest
from tollway.server.tool_parsers import PARSERS
from tollway.server.tracing import Tracing
from tollway.server.validation import CheckedCall, batch_line, tool_call_syntax, validate
from tollway.server.watchdog import Watchdog
from tollway.storage.database import Database


# Fast calls' database work (the budget's hold and the key's limits at admission, the ledger row
# at the end) runs on threads of its own: under a burst, every call's queues for the default
# pool's few threads, and a fast call would wait behind a hundred standard ones. One pool for
# the process, however many apps.
_FAST_CALLS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tollway-fast-calls")


async def _off_loop(tier: str, func, *args):
    """func(*args) on a worker thread, a fast call's on the fast lane's own; as asyncio.to_thread."""
    pool = _FAST_CALLS if tier == "fast" else None
    return await asyncio.get_running_loop().run_in_executor(pool, contextvars.copy_context().run, func, *args)


class Service:
    def __init__(self, engine: AsyncEngine, model_name: str, metrics: Metrics | None = None,
                 gatekeeper: Gatekeeper | None = None, batch_dir: str | Path | Database | None = None,
                 meter: Meter | None = None, fleet_secret: str | None = None, keep_alive: float = DEFAULT_INTERVAL,
                 canary: CanaryConfig | None = None, tracing: Tracing | None = None):
        """See create_app (app.py) for what each is."""
        self.engine, self.model_name, self.metrics, self.meter = engine, model_name, metrics, meter
        self.tracing = tracing
        self.canary = Canary(canary or CanaryConfig())
        self.keep_alive = keep_alive
        self.gatekeeper = gatekeeper or Gatekeeper([])
        self.fleet_secret = fleet_secret
        if meter is not None:
            engine.observe(meter.on_step)
            if metrics is not None:
                metrics.bill(meter)
        self.stats = LiveStats(meter, engine)
        engine.observe(self.stats.on_step)  # after the meter's: it reads the meter's charges for the step
        self.watchdog = Watchdog(engine)
        if metrics is not None:
            metrics.watch(engine, self.watchdog)
        self.tokenizer = engine.tokenizer
        self.tool_call_parser = engine.tool_call_parser
        if self.tokenizer is not None:  # the markers of the model's tool calls, which replies are read by
            self.tool_call_parser = tool_call_syntax(self.tokenizer, engine.tool_call_parser)
            parser = PARSERS.get(self.tool_call_parser)
            self.tokenizer.keep_special_tokens(parser.markers if parser is not None else ())
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.batch_store = BatchStore(batch_dir) if batch_dir is not None else None
        self.batch_runner = BatchRunner(self.batch_store, self.complete_in_batch_lane) \
            if self.batch_store is not None else None
        # the Responses API's kept responses, beside the ledger (None without one: none kept)
        self.responses = ResponseStore(meter.ledger.database) if meter is not None else None
        self._settling: set[asyncio.Task] = set()  # ended calls' ledger rows and timings, being written

    def validate(self, req, tags_header: str | None = None) -> CheckedCall:
        return validate(req, self.model_name, self.tokenizer, self.vocab_size, self.max_model_len, tags_header,
                        self.tool_call_parser)

    async def start(self, sub: CheckedCall, tier: str, key: KeySpec | None, call: str | None,
                    owner: str | None = None, canary_eligible: bool = False,
                    timing: CallTiming | None = None) -> tuple[Generation, dict[str, str]]:
        """Hold the call's budget and the key's limits, and submit its choices. `call`: the id a
        fleet's ingress gave it; `owner`: the key's, when it came from Gatekeeper.key_of;
        `canary_eligible`: the canary may promote it (Canary.eligible); `timing`: the marks of
        the call so far (None: it starts now).
        Returns the call and the x-ratelimit-* headers of its key."""
        meter = self.meter
        gen = Generation(sub.kind, self.model_name, tier, call)
        gen.timing = timing or CallTiming(time.monotonic(), validated=time.monotonic())
        gen.key, gen.tags = key.name if key else "", sub.tags
        if canary_eligible:
            gen.canary = self.canary.arm(gen.id)  # by the call's id, known only now
            if gen.canary == PROMOTED:
                gen.tier = "fast"
                gen.billed_tier = "fast" if self.canary.config.bill_promoted else tier
        if meter is not None:
            # the most it can be billed
            most = meter.price_card.billed(gen.billed_tier, sub.prompt_tokens, sub.most_output_tokens)
            try:
                await _off_loop(gen.tier, meter.budgets.reserve, gen.id, gen.key, sub.tags, most)
            except BudgetExceeded as e:
                # As OpenAI: a spent quota is not worth the client's automatic retries.
                raise APIError(429, str(e), code="insufficient_quota",
                               headers={"Retry-After": str(e.retry_after), "x-should-retry": "false"}) from None
        limits = {}
        try:
            if key is not None and key.limited:  # a transaction in the key store's database: off the event loop
                limits = await _off_loop(gen.tier, self.gatekeeper.admit, key,
                                         sub.prompt_tokens + sub.most_output_tokens, owner)
            if meter is not None:
                gen.metered = True
                gen.tabs = [Tab() for _ in range(sub.num_requests)]
            gen.timing.submitted = time.monotonic()
            held = self.engine.occupancy
            gen.timing.held = sum(held.running.values()) + sum(held.waiting.values())
            await gen.start(self.engine, sub)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError) and (gen.metered or meter is None):
                self.withdraw(gen)  # the client left while it was being added: abort what lands, bill what ran
            elif meter is not None:  # refused before any engine work: nothing to record, nothing to hold
                gen.metered = False
                asyncio.get_running_loop().run_in_executor(None, meter.budgets.release, gen.id)
            raise
        return gen, limits

    async def settle(self, gen: Generation) -> None:
        """Write the call's ledger row durably (before its response ends), once however the
        call ends, and put its cost and price into gen.usage()."""
        if gen.metered:
            gen.metered = False
            await self._record(gen)

    async def _record(self, gen: Generation) -> None:
        await gen.ended()  # the engine's last word on every choice: all the steps it was in
        row = ledger_row(gen, self.meter)
        gen.cost, gen.price, gen.engine_seconds = row.cost, row.price, row.engine_seconds
        await _off_loop(gen.tier, self.meter.settle, row)

    def withdraw(self, gen: Generation) -> None:
        """The call ends early or has ended (its caller may be gone): abort what still runs, and
        in the background, once the engine has ended each abort, settle it and report its timing."""
        gen.abort()
        if not gen.closing:
            gen.closing = True
            task = asyncio.get_running_loop().create_task(self._close(gen))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _close(self, gen: Generation) -> None:
        if gen.metered:
            gen.metered = False
            await self._record(gen)
        else:
            await gen.ended()
        outs, finish = gen.outputs(), gen.finish_reason()
        gen.timing.log(gen.id, gen.tier, outs, finish)
        overhead = gen.timing.overhead(outs)
        if overhead is not None:
            self.stats.on_call(gen.tier, *overhead)
        if self.tracing is not None:
            prompt_tokens = sum(len(gen.prompts[p]) for p in gen.scheduled_prompts())
            self.tracing.export(gen.kind, gen.id, gen.tier, gen.timing, outs, prompt_tokens, finish)

    async def collect(self, gen: Generation, echo: bool) -> dict:
        """Run the choices to the end: the non-streaming response body."""
        try:
            async for choice, out in gen.updates():
                choice.absorb(out)
            await self.settle(gen)
        finally:
            self.withdraw(gen)
        extra = {}
        if gen.kind == "chat" and gen.prompt_logprobs is not None:  # vLLM's place for a chat's: beside its choices
            extra["prompt_logprobs"] = vllm_prompt_logprobs(self.tokenizer, gen.choices[0].prompt_logprobs,
                                                            gen.prompt_logprobs)
        return gen.envelope([final_choice(gen, c, echo, self.tokenizer) for c in gen.choices], usage=gen.usage(),
                            **extra)

    async def complete_in_batch_lane(self, url: str, body: dict, owner: str) -> dict:
        """One Batch API line: what POST `url` with `body` would return, run in the batch lane as
        a request of the key that owns the batch: metered, budgeted and rate-limited as its own."""
        key = await asyncio.to_thread(self.gatekeeper.key_of, owner)
        if owner and key is None:
            raise APIError(401, "the API key that created this batch has been revoked", code="invalid_api_key")
        req = batch_line(url, body)
        if isinstance(req, ResponsesRequest):  # its body: the Response object
            turn, _ = await begin(self, req, key, owner, "batch", from_key_store=True)
            return await whole(turn)
        sub = self.validate(req)
        gen, _ = await self.start(sub, "batch", key, None, owner)
        return await self.collect(gen, sub.echo)


# The dependencies are async: FastAPI runs a plain `def` one on a worker thread, a hop each that a
# burst of calls queues for, fast ones too (benchmarks/README.md, fast_lane.py, has the figures).
async def service(request: Request) -> Service:
    """The app's Service, for a route's Depends."""
    return request.app.state.service


async def caller(request: Request, authorization: str | None = Header(default=None)) -> KeySpec | None:
    """The API key the request came with (None when keys are off); 401 without a good one. Only
    a key that is not in the server's configuration is looked up in the key database, off the
    event loop."""
    gatekeeper = request.app.state.service.gatekeeper
    if gatekeeper.in_database(authorization):
        return await asyncio.to_thread(gatekeeper.authenticate, authorization)
    return gatekeeper.authenticate(authorization)
