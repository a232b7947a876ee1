"""API calls as OpenTelemetry spans, sent to an OTLP/HTTP collector where one is configured
(`--otlp-traces-endpoint`, or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), as vLLM exports them: a span
per call named by its route, carrying vLLM's `gen_ai.*` attributes, with a child span per stage
of call_timing.py. A client's W3C `traceparent` header makes the call's span a child of its own.

The OpenTelemetry packages are the `otel` extra's: they are imported only when tracing is on."""
from __future__ import annotations

import os
import time

from tollway.outputs import RequestOutput
from tollway.server.call_timing import STAGES, CallTiming

ENDPOINT_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"


class Tracing:
    """Exports each finished call's span in the background (a batching processor)."""

    def __init__(self, endpoint: str, model_name: str):
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.propagate import extract
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise SystemExit("tollway: OpenTelemetry tracing needs the otel extra: pip install 'tollway[otel]'") from None
        self.endpoint, self.model_name = endpoint, model_name
        self._extract, self._in_span = extract, trace.set_span_in_context
        self._provider = TracerProvider(resource=Resource.create({"service.name": "tollway"}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer("tollway")

    def export(self, name: str, call_id: str, tier: str, timing: CallTiming, outs: list[RequestOutput],
               prompt_tokens: int, finish: str) -> None:
        """The call's span, from when its request reached the server to its last token (or now)."""
        to_wall = time.time_ns() - time.monotonic_ns()  # the marks are monotonic seconds

        def ns(mark: float) -> int:
            return int(mark * 1e9) + to_wall

        marks, summary = timing.marks(outs), timing.summary(outs)
        end = marks.get("decode", time.monotonic())
        attributes = {
            "gen_ai.request.id": call_id, "gen_ai.response.model": self.model_name, "tollway.tier": tier,
            "gen_ai.usage.prompt_tokens": prompt_tokens,
            "gen_ai.usage.completion_tokens": sum(o.num_output_tokens for o in outs),
            "gen_ai.latency.e2e": end - timing.received, "tollway.finish_reason": finish,
            "tollway.steps": summary.get("steps", 0),
        }
        if "queue" in marks and "engine" in marks:
            attributes["gen_ai.latency.time_in_queue"] = marks["queue"] - marks["engine"]
        if "prefill" in marks:
            attributes["gen_ai.latency.time_to_first_token"] = marks["prefill"] - timing.received
            attributes["gen_ai.latency.time_in_model_prefill"] = marks["prefill"] - marks.get("queue", marks["prefill"])
            attributes["tollway.prefill_steps"] = summary.get("prefill_steps", 0)
        if "decode" in marks and "prefill" in marks:
            attributes["gen_ai.latency.time_in_model_decode"] = marks["decode"] - marks["prefill"]
        call = self._tracer.start_span(name, context=self._extract(timing.parent), start_time=ns(timing.received),
                                       attributes=attributes)
        described, last = dict(STAGES), timing.received
        for stage, _ in STAGES:
            if stage in marks:
                self._tracer.start_span(stage, context=self._in_span(call), start_time=ns(last),
                                        attributes={"tollway.stage": described[stage]}).end(end_time=ns(marks[stage]))
                last = marks[stage]
        call.end(end_time=ns(end))

    def shutdown(self) -> None:
        """Send what is still batched."""
        self._provider.shutdown()


def tracing_for(endpoint: str | None, model_name: str) -> Tracing | None:
    """Tracing to `endpoint`, else to $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; None where neither is set."""
    endpoint = endpoint or os.environ.get(ENDPOINT_VARIABLE)
    return Tracing(endpoint, model_name) if endpoint else None
