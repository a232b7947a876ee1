"""Where an API call's time went, from the moment its HTTP request reached the server: reading
and checking the body, the key's budget and limits, waiting for the engine to finish the step it
was in, the scheduler's queue, the prefill steps up to the first token, then the decode steps.

An operator asking "why was this fast request slow?" reads it in the access log (a line per call,
logger `tollway.access`), in the response (a client that sends `x-tollway-timing: 1` gets a
`Server-Timing` header, and the whole breakdown as `usage.timing`), or as OpenTelemetry spans
(tracing.py)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tollway.outputs import RequestOutput

ASK_HEADER = "x-tollway-timing"  # a client sends it (any of TRUE_VALUES) to get the timing back
TRUE_VALUES = ("1", "true", "yes")
access_log = logging.getLogger("tollway.access")

# (stage, what it covers): each runs from the previous stage's end, the first from `received`.
# No commas: a Server-Timing header lists its entries with them.
STAGES = (
    ("validate", "the body read and tokenized"),
    ("limits", "the key's budget and rate limits"),
    ("engine", "the step in flight"),
    ("queue", "the scheduler's queue"),
    ("prefill", "the steps to the first token"),
    ("decode", "the steps after it"),
)


@dataclass
class CallTiming:
    """The server's marks of one call (time.monotonic, as the engine's); the engine's own come
    with its outputs."""

    received: float
    validated: float | None = None
    submitted: float | None = None  # handed to the engine, past the budget and limits
    first_sent: float | None = None  # a stream's first chunk with a token, handed to the wire
    held: int = 0  # requests the engine held (running or waiting) when the call was handed to it
    parent: dict[str, str] = field(default_factory=dict)  # the client's W3C trace context headers

    def marks(self, outs: list[RequestOutput]) -> dict[str, float]:
        """Each stage's end, as far as the call got (of its earliest choice, which the client
        sees first)."""
        marks = {"received": self.received}
        if self.validated is not None:
            marks["validate"] = self.validated
        if self.submitted is not None:
            marks["limits"] = self.submitted
        if outs:
            marks["engine"] = min(o.arrival_time for o in outs)
            scheduled = [o.first_scheduled_time for o in outs if o.first_scheduled_time is not None]
            first = [o.first_token_time for o in outs if o.first_token_time is not None]
            if scheduled:
                marks["queue"] = min(scheduled)
            if first:
                marks["prefill"] = min(first)
            if all(o.finished for o in outs):
                marks["decode"] = max(o.time for o in outs)
        return marks

    def sent(self) -> None:
        """A stream hands a chunk with tokens to the wire: the first ends the first token's way out."""
        if self.first_sent is None:
            self.first_sent = time.monotonic()

    def overhead(self, outs: list[RequestOutput]) -> tuple[float, float, int] | None:
        """A stream's time in the server beside the engine's, in seconds: from reaching the server
        to the engine's queue (the body read, tokenized, limits), and from its first token to that
        token's chunk on the wire; with the requests the engine held, since both grow with the
        streams the server's loop serves. The simulator draws these per call (LiveStats.calls).
        None for a call that streamed no token."""
        firsts = [o.first_token_time for o in outs if o.first_token_time is not None]
        if self.first_sent is None or self.submitted is None or not firsts:
            return None
        return self.submitted - self.received, max(0.0, self.first_sent - min(firsts)), self.held

    def stages(self, outs: list[RequestOutput]) -> dict[str, float]:
        """Seconds spent in each stage reached (STAGES' names)."""
        marks, seconds, last = self.marks(outs), {}, self.received
        for name, _ in STAGES:
            if name in marks:
                seconds[name], last = max(0.0, marks[name] - last), marks[name]
        return seconds

    def summary(self, outs: list[RequestOutput]) -> dict:
        """The call's timing as `usage.timing` gives it: each stage's milliseconds, the time to
        first token and in all from when the request reached the server, and the steps."""
        marks, stages = self.marks(outs), self.stages(outs)
        out = {f"{name}_ms": round(s * 1e3, 3) for name, s in stages.items()}
        if "prefill" in marks:
            out["ttft_ms"] = round((marks["prefill"] - self.received) * 1e3, 3)
        if self.first_sent is not None and "prefill" in marks:
            out["deliver_ms"] = round(max(0.0, self.first_sent - marks["prefill"]) * 1e3, 3)  # the first token's way out
        if "decode" in marks:
            out["total_ms"] = round((marks["decode"] - self.received) * 1e3, 3)
        if outs:
            out["steps"] = max(o.num_steps for o in outs)
            firsts = [o.steps_to_first_token for o in outs if o.steps_to_first_token is not None]
            if firsts:
                out["prefill_steps"] = min(firsts)
        return out

    def server_timing(self, outs: list[RequestOutput]) -> str:
        """The stages reached, as a Server-Timing header (milliseconds; browsers' devtools draw it)."""
        described = dict(STAGES)
        return ", ".join(f'{name};dur={s * 1e3:.3f};desc="{described[name]}"' for name, s in self.stages(outs).items())

    def log(self, call_id: str, tier: str, outs: list[RequestOutput], finish: str) -> None:
        """The call's line in the access log."""
        if not access_log.isEnabledFor(logging.INFO):
            return
        s = self.summary(outs)
        tokens = sum(o.num_output_tokens for o in outs)
        stages = ", ".join(f"{name} {s[f'{name}_ms']:.1f}" for name, _ in STAGES if f"{name}_ms" in s)
        first = f"first token {s['ttft_ms']:.1f} ms after {s['prefill_steps']} steps" if "ttft_ms" in s else "no token"
        access_log.info("%s %s %s: %s, %d tokens in %d steps (ms: %s)", call_id, tier, finish, first, tokens,
                        s.get("steps", 0), stages)


TRACE_CONTEXT = ("traceparent", "tracestate")


def asked_for(headers) -> bool:
    """Whether the client asked for the timing back."""
    return headers.get(ASK_HEADER, "").strip().lower() in TRUE_VALUES


def trace_context(headers) -> dict[str, str]:
    """The W3C trace context a client sent, under which its call's span is traced."""
    return {name: headers[name] for name in TRACE_CONTEXT if name in headers}
