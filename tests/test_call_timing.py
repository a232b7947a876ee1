"""Where a call's time went: the access log, the opt-in Server-Timing header and usage.timing,
and OpenTelemetry spans sent to a real OTLP/HTTP receiver, all from a real server driven by the
openai client."""
from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tollway.outputs import RequestOutput
from tollway.server.call_timing import STAGES, CallTiming
from tollway.server.tracing import Tracing

from live_server import MODEL, running_server

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
STAGE_NAMES = [name for name, _ in STAGES]


class Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP collector's traces endpoint: keeps every span it is sent."""

    spans: list = []

    def do_POST(self):
        request = ExportTraceServiceRequest()
        request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                Receiver.spans.extend(scope.spans)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def collector():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(make_engine, collector):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within the test, not every 5 s
        tracing = Tracing(collector, MODEL)
    yield from running_server(make_engine(), tracing=tracing)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused") as client:
        yield client


def _spans_of(call_id: str, timeout: float = 10.0) -> list:
    """The call's span and its children, once all have arrived at the collector."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ours = [s for s in Receiver.spans if any(a.key == "gen_ai.request.id" and a.value.string_value == call_id
                                                 for a in s.attributes)]
        if ours:
            children = [s for s in Receiver.spans if s.parent_span_id == ours[0].span_id]
            if len(children) == len(STAGES):
                return [ours[0], *children]
        time.sleep(0.05)
    raise AssertionError(f"no complete span of {call_id} reached the collector")


def test_a_call_reports_its_stages_when_asked(client, caplog):
    with caplog.at_level(logging.INFO, logger="tollway.access"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0,
            extra_headers={"x-tollway-timing": "1", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        resp = raw.parse()
        header = raw.headers["server-timing"]
        assert [part.split(";")[0].strip() for part in header.split(",")] == STAGE_NAMES
        timing = resp.usage.model_extra["timing"]
        assert timing["steps"] == resp.usage.completion_tokens == 6  # one prefill step, then a token a step
        assert timing["prefill_steps"] == 1
        # the time to first token is every stage up to it, from when the request reached the server
        before_first = sum(timing[f"{name}_ms"] for name in STAGE_NAMES[:STAGE_NAMES.index("prefill") + 1])
        assert timing["ttft_ms"] == pytest.approx(before_first, abs=0.01)
        assert timing["total_ms"] == pytest.approx(before_first + timing["decode_ms"], abs=0.01)
        assert timing["prefill_ms"] > 0 and timing["decode_ms"] > 0
        deadline = time.time() + 5  # the access log's line is written once the call has been closed
        while not any(resp.id in r.getMessage() for r in caplog.records) and time.time() < deadline:
            time.sleep(0.02)
    line = next(r.getMessage() for r in caplog.records if resp.id in r.getMessage())
    assert "standard stop" in line or "standard length" in line
    assert "6 tokens in 6 steps" in line and "first token" in line

    call, *children = _spans_of(resp.id)
    assert call.name == "chat" and call.trace_id.hex() == TRACE_ID and call.parent_span_id.hex() == PARENT_ID
    attributes = {a.key: a.value for a in call.attributes}
    assert attributes["gen_ai.latency.time_to_first_token"].double_value == pytest.approx(timing["ttft_ms"] / 1e3,
                                                                                         abs=1e-5)
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 6
    # the stages tile the call's span, one after another
    children.sort(key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in children] == STAGE_NAMES
    assert children[0].start_time_unix_nano == call.start_time_unix_nano
    assert children[-1].end_time_unix_nano == call.end_time_unix_nano
    assert all(a.end_time_unix_nano == b.start_time_unix_nano for a, b in zip(children, children[1:]))


def test_a_stream_reports_its_stages_in_its_usage_chunk(client):
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-tollway-timing": "1"})
    # the header leaves before the first token: the stages up to the engine
    assert [part.split(";")[0].strip() for part in raw.headers["server-timing"].split(",")] == ["validate", "limits"]
    chunks = list(raw.parse())
    timing = chunks[-1].usage.model_extra["timing"]
    assert set(timing) >= {f"{name}_ms" for name in STAGE_NAMES} | {"ttft_ms", "total_ms", "steps", "deliver_ms"}
    assert timing["steps"] == 5
    # the first token's way from the engine to the wire: under the rest of the call
    assert 0 <= timing["deliver_ms"] < timing["decode_ms"]


def test_timing_is_only_sent_to_a_client_that_asks(client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert "server-timing" not in raw.headers and "timing" not in (raw.parse().usage.model_extra or {})


def _out(**fields) -> RequestOutput:
    return RequestOutput("r", "fast", [1, 2], **fields)


def test_stages_run_from_one_mark_to_the_next_as_far_as_the_call_got():
    timing = CallTiming(received=10.0, validated=10.002, submitted=10.003)
    waiting = _out(arrival_time=10.1)
    assert timing.stages([waiting]) == pytest.approx({"validate": 0.002, "limits": 0.001, "engine": 0.097})
    first = _out(arrival_time=10.1, first_scheduled_time=10.15, first_token_time=10.2, num_steps=1,
                 steps_to_first_token=1)
    later = _out(arrival_time=10.12, first_scheduled_time=10.16, first_token_time=10.3, finished=True, time=11.0,
                 num_steps=9, steps_to_first_token=2)
    summary = timing.summary([first, later])  # n choices: the earliest start, the last to finish
    assert "decode_ms" not in summary  # one choice still runs
    first.finished, first.time = True, 10.5
    summary = timing.summary([first, later])
    assert summary == pytest.approx({"validate_ms": 2, "limits_ms": 1, "engine_ms": 97, "queue_ms": 50,
                                     "prefill_ms": 50, "decode_ms": 800, "ttft_ms": 200, "total_ms": 1000,
                                     "steps": 9, "prefill_steps": 1})


def test_a_streams_time_beside_the_engine_is_its_intake_and_its_first_tokens_way_out():
    timing = CallTiming(received=10.0, validated=10.002, submitted=10.003)
    out = _out(arrival_time=10.004, first_scheduled_time=10.01, first_token_time=10.05)
    assert timing.overhead([out]) is None  # nothing streamed yet
    timing.first_sent = 10.0515
    timing.held = 7
    assert timing.overhead([out]) == pytest.approx((0.003, 0.0015, 7))
    assert timing.summary([out])["deliver_ms"] == pytest.approx(1.5)
    assert timing.overhead([_out(arrival_time=10.004)]) is None  # no token
    timing.sent()  # later chunks leave the first one's mark as it was
    assert timing.first_sent == 10.0515
