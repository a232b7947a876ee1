"""FastFirst: in a burst, fast requests go through admission before the standard ones that
arrived in the same moment, and every route still gets its body unchanged."""
from __future__ import annotations

import asyncio
import json

from tollway.server.fast_first import MAX_PEEK_BYTES, FastFirst


def scope(path: str, body: bytes) -> dict:
    return {"type": "http", "method": "POST", "path": path,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


def receiver(body: bytes):
    """An ASGI receive giving `body` in a few chunks, then a disconnect."""
    chunk = max(7, len(body) // 4)
    messages = [{"type": "http.request", "body": body[i:i + chunk], "more_body": i + chunk < len(body)}
                for i in range(0, len(body), chunk)] + [{"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)
    return receive


async def nothing_sent(message) -> None:
    raise AssertionError("the test app sends nothing")


def burst(requests: list[tuple[str, bytes]]) -> tuple[list[int], dict[int, tuple[bytes, str]]]:
    """Requests (path, body) whose tasks start in this order on one loop, as uvicorn starts a
    burst's; the order in which they reached the app, and what each read there."""
    entered, read = [], {}

    async def app(scope, receive, send) -> None:
        index = scope["index"]
        entered.append(index)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        read[index] = (body, (await receive())["type"])

    middleware = FastFirst(app)

    async def main() -> None:
        await asyncio.gather(*(middleware({**scope(path, body), "index": i}, receiver(body), nothing_sent)
                               for i, (path, body) in enumerate(requests)))
    asyncio.run(main())
    return entered, read


def body(tier: str | None, **fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "hello there", **({"service_tier": tier} if tier else {}),
                       **fields}).encode()


def test_fast_requests_in_a_burst_reach_admission_before_the_rest():
    requests = [("/v1/completions", body(None)), ("/v1/chat/completions", body("default")),
                ("/v1/completions", body("flex")), ("/v1/completions", body("priority")),
                ("/v1/chat/completions", body(None)), ("/v1/chat/completions", body("scale"))]
    entered, read = burst(requests)
    assert entered[:2] == [3, 5] and sorted(entered[2:]) == [0, 1, 2, 4]
    # Each route read its own body, whole, and then the client's disconnect.
    assert read == {i: (b, "http.disconnect") for i, (_, b) in enumerate(requests)}


def test_a_spaced_priority_field_counts_and_other_routes_and_large_bodies_go_by():
    spaced = b'{"model": "m", "prompt": "x", "service_tier" :  "priority"}'
    large = body(None, padding="x" * MAX_PEEK_BYTES)
    requests = [("/v1/completions", body(None)), ("/v1/files", body("default")), ("/v1/completions", large),
                ("/v1/completions", spaced)]
    entered, read = burst(requests)
    # Not a generation route, or too large to read ahead: admitted in arrival order, unread.
    assert entered[:3] == [1, 2, 3] and entered[3] == 0
    assert read == {i: (b, "http.disconnect") for i, (_, b) in enumerate(requests)}


def test_a_negative_vllm_priority_is_fast_and_others_are_not():
    requests = [("/v1/completions", body(None, priority=0)), ("/v1/completions", body(None, priority=3)),
                ("/v1/chat/completions", body(None, priority=-2)), ("/v1/completions", body(None, priority=-10))]
    entered, _ = burst(requests)
    assert entered[:2] == [2, 3] and sorted(entered[2:]) == [0, 1]
