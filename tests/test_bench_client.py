"""tollway bench's HTTP client against a server that closes kept-alive connections."""
from __future__ import annotations

import asyncio
import json

from tollway.bench.client import OpenAIClient, now_clock
from tollway.traffic.workload import RequestSpec


async def _serve_one_request_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                            served: list[int]) -> None:
    """Answers a connection's first request with a one-token stream, saying the connection stays
    open, and closes it without a word when a second request comes: what llama-server does to a
    request that arrives as its 5 s keep-alive timeout runs out, here every time."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        served.append(1)
        chunks = [{"choices": [{"index": 0, "text": "hi"}]},
                  {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nKeep-Alive: timeout=1\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body.encode())
        await writer.drain()
        await reader.read(1)  # the next request, if any: closed unanswered
    except asyncio.IncompleteReadError:
        pass
    finally:
        writer.close()


def test_a_server_that_closes_a_kept_alive_connection_loses_no_request():
    async def run() -> tuple[list, list[int]]:
        served: list[int] = []
        server = await asyncio.start_server(lambda r, w: _serve_one_request_per_connection(r, w, served), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = OpenAIClient(f"http://127.0.0.1:{port}", "m")
        clock = now_clock()
        try:
            records = []
            for index in range(3):
                records.append(await client.send(RequestSpec(index, "standard", "hello", 3, 1), "s", False, clock))
        finally:
            await client.close()
            server.close()
            await server.wait_closed()
        return records, served

    records, served = asyncio.run(run())
    assert [(r.error, r.error_message) for r in records] == [(None, None)] * 3
    assert [r.output_tokens for r in records] == [1, 1, 1] and len(served) == 3


def test_tiers_are_sent_in_openai_names_that_tollway_maps_back_to_the_same_lane():
    from typing import get_args, get_type_hints

    from openai.types.chat.completion_create_params import CompletionCreateParamsBase

    from tollway.server.service_tier import tier_for

    openai_names = set(get_args(get_args(get_type_hints(CompletionCreateParamsBase)["service_tier"])[0]))
    async def bodies() -> dict[str, dict]:
        client = OpenAIClient("http://127.0.0.1:1", "m")
        try:
            return {tier: client.body(RequestSpec(0, tier, "hi", 1, 1)) for tier in ("fast", "standard", "batch")}
        finally:
            await client.close()

    for tier, body in asyncio.run(bodies()).items():
        assert body["service_tier"] in openai_names - {"fast"} and tier_for(body["service_tier"]) == tier


def test_a_send_that_raises_stops_the_stage_with_its_error(tmp_path):
    """A bug in sending (not a request's error, which is a record) must not vanish in a task's
    callback, leaving an open-loop stage that measured nothing and said nothing."""
    import pytest

    from tollway.bench.load import run_stage
    from tollway.traffic.patterns import Limits, LoadPattern
    from tollway.traffic.workload import Lengths, Requests, Workload

    class Broken:
        async def send(self, spec, stage, warmup, clock):
            raise KeyError(spec.tier)

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"prompt": "hi"}\n')
    requests = Requests(Workload(Lengths(8, 0, 8, 8), Lengths(4, 0, 4, 4), True, {"fast": 1.0}, str(dataset), 3))
    for pattern in (LoadPattern("rate", rate=200.0), LoadPattern("users", concurrency=2)):
        with pytest.raises(KeyError, match="fast"):
            asyncio.run(run_stage(Broken(), requests, pattern, Limits(max_requests=20), now_clock()))
