"""One API call in the engine: the n choices of each prompt submitted, merged into one stream,
withdrawn together, and summed into the call's ledger row."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from tollway.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tollway.meter.ledger import LedgerRow
from tollway.meter.tab import Tab
from tollway.outputs import RequestOutput
from tollway.request import InvalidRequest, QueueFullError
from tollway.server.call_ids import new_call_id
from tollway.server.call_timing import CallTiming
from tollway.server.errors import APIError
from tollway.tier_names import WIRE_NAME
from tollway.server.tools import ToolCallReader, ToolCalling
from tollway.server.validation import CheckedCall, invalid


@dataclass
class Choice:
    """One choice being generated: what has been sent of it so far."""

    index: int
    prompt_ids: list[int]
    pieces: list[str] = field(default_factory=list)  # the text sent so far, a piece per output
    text_len: int = 0
    num_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict | None] | None = None  # where asked: the engine's (RequestOutput's)
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the latest from the engine: token counts and times
    reader: ToolCallReader | None = None  # a stream's, where the output is read for tool calls

    def absorb(self, out: RequestOutput) -> None:
        """Fold in the engine's next output."""
        self.pieces.append(out.new_text)
        self.text_len += len(out.new_text)
        self.num_tokens = out.num_output_tokens
        self.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.output = out
        if out.finished:
            self.finish_reason = out.finish_reason


class Generation:
    """One API call: every prompt times n choices, each an engine request in `tier`."""

    def __init__(self, kind: str, model: str, tier: str, call_id: str | None = None):
        """`call_id`: the id a fleet's ingress gave the call (the same on every replica it tries)."""
        self.kind = kind  # "completion" | "chat"
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{call_id or new_call_id()}"
        self.arrived = time.time()
        self.created = int(self.arrived)
        self.model = model
        self.tier = tier
        self.billed_tier = tier  # the canary bills a promoted call as standard unless told otherwise
        self.canary: str | None = None  # its canary arm, where it was eligible (canary.py)
        self.key, self.tags = "", []  # the API key's name and the request's tags, for the ledger
        self.metered = False  # on the meter's tabs and not yet settled
        self.tabs: list[Tab] = []  # the meter's, a choice each, where it is metered
        self.cost: float | None = None  # set when settled
        self.price: float | None = None
        self.engine_seconds: float | None = None
        self.prompts: list[list[int]] = []
        self.n = 1  # choices per prompt
        self.tools: ToolCalling | None = None  # a chat whose output is read for tool calls
        self.logprobs: int | None = None  # top logprobs per token, where asked (every choice alike)
        self.prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, where asked
        self.echo_only = False  # max_tokens 0 with echo: the token each choice generates is not its own
        self.choices: list[Choice] = []
        self.streams: list[RequestStream] = []
        self._adding: asyncio.Future | None = None  # the add of the next stream, until it lands
        self._pumps: list[asyncio.Task] = []
        self.timing: CallTiming | None = None  # set by Service.start
        self.timing_asked = False  # the client asked for the timing back (usage.timing)
        self.closing = False  # its end is being settled and reported (Service.withdraw)

    async def start(self, engine: AsyncEngine, call: CheckedCall) -> None:
        """Submit every choice; if any is refused, withdraw the others and raise."""
        self.prompts, self.n = call.prompts, len(call.params)
        self.tools = call.tools
        self.logprobs, self.prompt_logprobs = call.params[0].logprobs, call.prompt_logprobs
        self.echo_only = call.echo_only
        try:
            for index, submission in enumerate(call.submissions):
                self.choices.append(Choice(index, submission.prompt_token_ids))
                # Shielded: a caller that leaves meanwhile must not lose the stream of an add
                # that lands anyway, or what it ran would go unaborted and unbilled.
                tab = self.tabs[index] if self.tabs else None
                self._adding = asyncio.ensure_future(engine.add(submission, self.tier, self.request_id(index), tab))
                self.streams.append(await asyncio.shield(self._adding))
                self._adding = None
        except QueueFullError as e:
            self.abort()
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": str(e.retry_after)}) from None
        except InvalidRequest as e:  # what only the scheduler knows: a lane's KV share
            self.abort()
            raise invalid(e, self.kind == "chat") from None
        except EngineDeadError:  # as /health says: nothing more can run here
            self.abort()
            raise APIError(503, "the engine has stopped", code="engine_stopped") from None

    def request_id(self, index: int) -> str:
        """The engine request id of choice `index`."""
        return f"{self.id}-{index}"

    def abort(self) -> None:
        """Withdraw every choice still running (a no-op for finished ones), and one still being
        added once it lands."""
        for task in self._pumps:
            task.cancel()
        for stream in self.streams:
            stream.abort()
        if self._adding is not None:
            self._adding.add_done_callback(_abort_added)

    async def ended(self) -> None:
        """Wait for the engine's last output of every choice and fold it in: after an abort it
        counts the tokens made after the caller stopped reading, which the ledger bills too. A
        stopped engine leaves the choices as they were last seen."""
        if self._adding is not None:
            await asyncio.wait([self._adding])
            if not self._adding.cancelled() and self._adding.exception() is None:
                self.streams.append(self._adding.result())
            self._adding = None
        for choice, stream in zip(self.choices, self.streams):
            try:
                out = self._shown(await stream.ended())
            except EngineDeadError:
                continue
            choice.output, choice.num_tokens = out, out.num_output_tokens
            choice.finish_reason = choice.finish_reason or out.finish_reason

    async def updates(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's outputs as they come, interleaved. Abandoning it aborts them all."""
        if len(self.streams) == 1:  # the usual call: read its stream directly, not through a pump task
            try:
                async for out in self.streams[0]:
                    yield self.choices[0], self._shown(out)
            finally:
                self.abort()
            return
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await merged.put((choice, out))
            except Exception as e:  # noqa: BLE001 -- surfaced to the reader below
                await merged.put((choice, e))

        self._pumps = [asyncio.create_task(pump(c, s)) for c, s in zip(self.choices, self.streams)]
        try:
            remaining = len(self._pumps)
            while remaining:
                choice, out = await merged.get()
                if isinstance(out, Exception):
                    raise out
                remaining -= out.finished
                yield choice, self._shown(out)
        finally:
            self.abort()

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """`out` as the call shows it: under echo_only, without the token it generated, which is
        then neither returned nor billed (its engine time is, as the prompt's: it scored the
        prompt), finished for "length" as OpenAI's legacy completions say."""
        if not self.echo_only:
            return out
        reason = "length" if out.finished and out.finish_reason != "abort" else out.finish_reason
        return replace(out, new_text="", new_token_ids=[], new_logprobs=[], num_output_tokens=0, text="",
                       token_ids=[], logprobs=[], finish_reason=reason)

    def scheduled_prompts(self) -> dict[int, RequestOutput]:
        """Per prompt that any of its choices was scheduled for, the first such choice's output:
        a prompt counts once, however many choices; one aborted while it waited used nothing."""
        ran: dict[int, RequestOutput] = {}
        for c in self.choices:
            if c.output is not None and c.output.first_scheduled_time is not None:
                ran.setdefault(c.index // self.n, c.output)
        return ran

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.prompts)  # once per prompt, however many choices
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(o.num_cached_prompt_tokens for o in self.scheduled_prompts().values())  # prefix-cache hits
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.cost is not None:
            usage |= {"cost": self.cost, "price": self.price, "engine_seconds": self.engine_seconds}
        if self.timing_asked:
            usage["timing"] = self.timing.summary(self.outputs())
        return usage

    def outputs(self) -> list[RequestOutput]:
        """Each choice's latest output from the engine, for those that have one."""
        return [c.output for c in self.choices if c.output is not None]

    def finish_reason(self) -> str:
        """The choices' finish reason, or their reasons joined where they differ ("abort" for
        one that never finished)."""
        finish = {c.finish_reason or "abort" for c in self.choices}
        return finish.pop() if len(finish) == 1 else ",".join(sorted(finish))

    def envelope(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self._object(extra.pop("chunk", False)), "created": self.created,
                "model": self.model, "choices": choices, "service_tier": WIRE_NAME[self.tier], **extra}

    def _object(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"


def _abort_added(add: asyncio.Future) -> None:
    if not add.cancelled() and add.exception() is None:
        add.result().abort()


def ledger_row(gen: Generation, meter) -> LedgerRow:
    """The ledger's row for a finished (or abandoned) API call: every choice summed."""
    outs = gen.outputs()
    completion = sum(c.num_tokens for c in gen.choices)
    ran = gen.scheduled_prompts()  # a prompt is billed once any of its choices was scheduled
    prompt = sum(len(gen.prompts[p]) for p in ran)
    cached = sum(o.num_cached_prompt_tokens for o in ran.values())
    arrival = min((o.arrival_time for o in outs), default=None)
    scheduled = [o.first_scheduled_time for o in outs if o.first_scheduled_time is not None]
    first_tokens = [o.first_token_time for o in outs if o.first_token_time is not None]
    seconds = sum(tab.seconds for tab in gen.tabs)  # every choice's, added or not
    price = meter.price_card.billed(gen.billed_tier, prompt, completion)
    return LedgerRow(
        id=gen.id, created=gen.arrived, key=gen.key, tier=gen.tier, model=gen.model,
        prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached,
        queue_seconds=min(scheduled) - arrival if scheduled else None,
        ttft_seconds=min(first_tokens) - arrival if first_tokens else None,
        e2e_seconds=time.time() - gen.arrived, engine_seconds=seconds, cost=meter.cost(seconds),
        price=price, finish_reason=gen.finish_reason(), tags=gen.tags,
        canary=gen.canary, canary_cost=meter.price_card.billed(gen.tier, prompt, completion) - price,
    )
