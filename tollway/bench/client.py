"""One streamed request to an OpenAI-compatible server, timed: when it was sent, when each
chunk of text arrived, what the server's usage said, and how it failed if it did.

The client shares the machine with the server it loads, so its cost per event counts: aiohttp
reads a chunk in a fraction of the CPU time httpx took (C parser, no per-read cancel scopes),
which is handed back to the server under test."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from tollway.tier_names import WIRE_NAME
from tollway.traffic.records import RequestRecord
from tollway.traffic.workload import RequestSpec


def server_root(url: str) -> str:
    """The server's address without a trailing /v1, which users often include."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


class OpenAIClient:
    """POSTs streamed completions (or chat completions) and times them."""

    def __init__(self, url: str, model: str, api_key: str | None = None, endpoint: str = "completions",
                 timeout: float = 600.0, ignore_eos: bool = True):
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"--endpoint: expected completions or chat, got {endpoint!r}")
        self.base = server_root(url)
        self.model, self.endpoint, self.ignore_eos = model, endpoint, ignore_eos
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # read_bufsize: the longest line a stream may send (a chunk with many logprobs is long).
        # force_close: a connection per request. A server may close a kept-alive connection between
        # requests (llama-server's after 5 s idle: Keep-Alive: timeout=5), and a request sent on
        # it then fails before it was written: 22-31 of 128 requests to llama-server at 64 streams.
        self.http = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout, connect=30.0),
                                          connector=aiohttp.TCPConnector(limit=0, force_close=True), read_bufsize=2**22)

    async def close(self) -> None:
        await self.http.close()

    def body(self, spec: RequestSpec) -> dict:
        body = {"model": self.model, "max_tokens": spec.max_tokens, "stream": True, "temperature": 0.0,
                "stream_options": {"include_usage": True},
                # OpenAI's names, which tollway takes too: OpenAI refuses "fast", "standard" and "batch"
                "service_tier": WIRE_NAME[spec.tier]}
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension, which tollway and llama.cpp's server take too
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    async def send(self, spec: RequestSpec, stage: str, warmup: bool, clock) -> RequestRecord:
        record = RequestRecord(spec.index, stage, spec.tier, warmup, spec.prompt_tokens, spec.max_tokens, clock())
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        try:
            async with self.http.post(self.base + path, json=self.body(spec)) as response:
                if response.status != 200:
                    text = (await response.read()).decode(errors="replace")
                    return _failed(record, f"http_{response.status}", _error_message(text), clock)
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        record.end = clock()
                        break
                    _take_chunk(record, json.loads(data), clock())
        except asyncio.TimeoutError as e:  # aiohttp's timeouts are asyncio's
            return _failed(record, "timeout", str(e) or type(e).__name__, clock)
        except aiohttp.ClientError as e:
            return _failed(record, "connection", str(e) or type(e).__name__, clock)
        except (json.JSONDecodeError, ValueError) as e:
            return _failed(record, "bad_response", str(e), clock)
        if record.end is None:
            return _failed(record, "incomplete", "the stream ended without [DONE]", clock)
        if record.output_tokens is None:  # a server without usage in streams: count chunks
            record.output_tokens = len(record.chunk_times)
        return record


def _take_chunk(record: RequestRecord, chunk: dict, now: float) -> None:
    if "error" in chunk:
        raise ValueError(f"error in stream: {_error_message(json.dumps(chunk))}")
    for choice in chunk.get("choices") or []:
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text:
            if record.first_token is None:
                record.first_token = now
            record.chunk_times.append(now)
    usage = chunk.get("usage")
    if usage:
        record.output_tokens = usage.get("completion_tokens")
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        record.cost = usage.get("cost")
        record.engine_seconds = usage.get("engine_seconds")


def _failed(record: RequestRecord, kind: str, message: str, clock) -> RequestRecord:
    record.error, record.error_message, record.end = kind, message[:500], clock()
    return record


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]


def now_clock():
    """The bench's clock: seconds since it was made."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
