"""The fleet's HTTP front: the same OpenAI API as one server, each completion, chat completion
and response (the Responses API's) placed on a replica by the tier-aware router (router.py, run
by Serve as the deployment's request router: fleet.py) and proxied to that replica's own
tollway API.

A request is *committed* to a replica once its response has begun reaching the client: the
whole body of a plain response, the first event of a stream that is not a comment (keep-alive
comments are no answer: server/keep_alive.py). Until then any failure there
(the replica died or stopped answering, refused it as draining or queue-full, or answered
5xx) sends it to another replica, so no request is silently dropped; the call keeps one id on
every replica tried (server/call_ids.py), so one that failed after billing it is not billed
twice. After that, a failed replica ends the stream with an error event in the stream's own
shape (stream_end.py), never a hang: its connection closes when its process dies, Serve
replaces a replica that fails its health checks (its engine stopped or hung), and the ingress
kills one that stops answering on its port.

A response that continues another (previous_response_id) is routed by the conversation it
continues (conversations.py). /dashboard/data merges every replica's (dashboard.py). Everything else (/v1/models, /v1/usage,
the Batch API, kept responses, the /dashboard page) goes to the first live replica: they share
one store.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tollway.fleet.affinity import CHUNK
from tollway.fleet.conversations import Conversations
from tollway.fleet.dashboard import fleet_data
from tollway.fleet.router import ReplicaState, RoutingHint, estimated_tokens
from tollway.fleet.stream_end import ChatStreamEnd, ResponsesStreamEnd
from tollway.server import errors
from tollway.server.call_ids import CALL_ID, FLEET_SECRET, new_call_id
from tollway.server.disconnects import ClientGone, ClosingStreamingResponse, unless_disconnected
from tollway.server.errors import APIError
from tollway.server.service_tier import asked_tier

_FORWARD = ("authorization", "content-type", "x-tollway-tags")
_RETURN = ("content-type", "x-tollway-cost", "retry-after", "x-request-id", "x-should-retry",
           *(f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset") for unit in ("requests", "tokens")))
# A chat request or a response without max_tokens may run to the context's end; the router guesses this.
_UNSPECIFIED_MAX_TOKENS = 256
RESPONSES = "/v1/responses"


class Ingress:
    """The front's state: the fleet, its router and metrics, and the HTTP client to the replicas."""

    def __init__(self, fleet):
        self.fleet, self.router, self.metrics = fleet, fleet.router, fleet.metrics
        self.conversations = Conversations(self.router.affinity.max_chunks * CHUNK)
        self.client: httpx.AsyncClient | None = None

    async def open(self) -> None:
        # No read timeout: a generation may take minutes, and a dead replica closes its socket.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None))
        await self.fleet.connect()

    async def close(self) -> None:
        await self.fleet.disconnect()
        await self.client.aclose()

    async def scrape(self, replica: ReplicaState) -> str | None:
        try:
            resp = await self.client.get(replica.url + "/metrics", timeout=10.0)
            return resp.text if resp.status_code == 200 else None
        except httpx.HTTPError:
            return None

    async def route(self, request: Request, path: str) -> Response:
        """A client that hangs up before its response begins has it withdrawn: the replica's
        connection is closed, so the replica aborts it too (and bills what ran)."""
        body = await request.body()
        try:
            return await unless_disconnected(request, self._place(request, body, path))
        except ClientGone:
            return Response(status_code=499)

    async def _place(self, request: Request, body: bytes, path: str) -> Response:
        router, metrics, fleet = self.router, self.metrics, self.fleet
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD}
        # One id for the call on every replica tried: a retry of a call already billed is not billed again.
        headers |= {CALL_ID: new_call_id(), FLEET_SECRET: fleet.secret}
        try:
            parsed = json.loads(body)
            tier, _, _ = asked_tier(parsed.get("service_tier"), parsed.get("priority"))
            if path == RESPONSES:  # its instructions, then the conversation it continues, then its input
                conversation = self.conversations.before(parsed.get("previous_response_id")) + \
                    as_text(parsed.get("input"))
                text = as_text(parsed.get("instructions")) + conversation
            else:
                conversation, text = None, prompt_text(parsed)
            tokens = estimated_tokens(text, output_allowance(parsed, path), int(parsed.get("n") or 1))
            stream = bool(parsed.get("stream"))
        except (ValueError, TypeError, AttributeError, APIError):
            # Malformed: any replica answers it with the same error a single server would.
            tier, text, conversation, tokens, stream = "standard", "", None, 0, False
        tried: set[int] = set()
        failure: Response | None = None
        unplaced = 0  # routing calls that failed: the replica they went to died meanwhile
        while True:
            if router.choose(tier, text, tried) is None:
                if not [r for r in router.replicas if r.routable and r.index not in tried]:
                    return failure or _unavailable()
                # Batch runs only on spare capacity: it waits here until a replica has some.
                metrics.waiting[tier] += 1
                try:
                    await router.wait_for_capacity(1.0)
                finally:
                    metrics.waiting[tier] -= 1
                continue
            try:  # the router places it (and counts it there), as the policy says
                replica = await fleet.route(RoutingHint(tier, text, tokens, frozenset(tried)))
            except Exception:  # noqa: BLE001 -- the call did not reach a live replica: place it again
                metrics.retried.labels(tier, "replica_lost").inc()
                unplaced += 1
                if unplaced > len(router.replicas):
                    return failure or _unavailable()
                continue
            try:
                response = await self._attempt(replica, path, body, headers, stream)
            except _NotServed as e:
                tried.add(replica.index)
                metrics.retried.labels(tier, e.why).inc()
                failure = e.refusal or failure
                continue
            if conversation is not None and response.status_code == 200:  # a response: its id is x-request-id
                self.conversations.made(response.headers.get("x-request-id"), conversation)
            return response

    async def _attempt(self, replica: ReplicaState, path: str, body: bytes, headers: dict, stream: bool) -> Response:
        """The replica's response, committed; _NotServed if another replica should have it."""
        client = self.client
        try:
            resp = await client.send(client.build_request("POST", replica.url + path, content=body, headers=headers),
                                     stream=True)
        except httpx.TransportError:
            await self.fleet.check(replica, client)
            raise _NotServed("replica_lost") from None
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() in _RETURN}
        out_headers["x-tollway-replica"] = str(replica.index)
        try:
            if resp.status_code != 200 or not stream:
                content = await resp.aread()
                response = Response(content, resp.status_code, out_headers)
                refused = _refusal(resp.status_code, content)
                if refused:
                    raise _NotServed(refused, response)
                return response
            # Keep-alive comments before the first event are held, not forwarded: forwarding one
            # would begin the client's response (its status and headers, x-tollway-replica among
            # them) on a replica that may yet fail, and the call could no longer go elsewhere
            # unseen. Little waits here: a replica begins its response only once the request has
            # started (ReplicaEngine.add). The comments then go out with the first event.
            first = b""
            chunks = resp.aiter_raw()
            while not _holds_event(first):
                first += await anext(chunks)
        except (httpx.HTTPError, StopAsyncIteration):
            await resp.aclose()
            await self.fleet.check(replica, client)
            raise _NotServed("replica_lost") from None
        except BaseException:  # _NotServed, or the client left: let the replica's connection go
            await resp.aclose()
            raise
        # Closed however the relay ends: a client gone before its first byte never starts it.
        return ClosingStreamingResponse(self._relay(replica, resp, first, chunks, path), resp.aclose,
                                        headers=out_headers, media_type="text/event-stream")

    async def _relay(self, replica: ReplicaState, resp: httpx.Response, first: bytes, chunks: AsyncIterator[bytes],
                     path: str) -> AsyncIterator[bytes]:
        """The replica's stream; if it breaks off before its end, an error event in its shape ends it."""
        end = ResponsesStreamEnd() if path == RESPONSES else ChatStreamEnd()
        try:
            end.feed(first)
            yield first
            async for chunk in chunks:
                end.feed(chunk)
                yield chunk
            if end.whole:
                return
            why = "its stream ended early"
        except httpx.HTTPError as e:
            why = type(e).__name__
        finally:
            await resp.aclose()
        self.metrics.failed_streams.labels(str(replica.index)).inc()
        # Checked before the client hears of it: by then the fleet no longer lists a dead replica as alive.
        await self.fleet.check(replica, self.client)
        yield end.error(f"replica {replica.index} failed mid-stream ({why}); the response is incomplete")

    async def pass_through(self, path: str, request: Request) -> Response:
        """Anything else, to the first live replica."""
        home = self.fleet.home()
        if home is None:
            return JSONResponse(errors.error_body(503, "no replica is serving"), status_code=503)
        url = f"{home.url}/{path}" + (f"?{request.url.query}" if request.url.query else "")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        client = self.client
        try:
            resp = await client.send(client.build_request(request.method, url, content=await request.body(),
                                                          headers=headers), stream=True)
        except httpx.TransportError:
            await self.fleet.check(home, client)
            return JSONResponse(errors.error_body(503, "the replica did not answer"), status_code=503)
        kept = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "transfer-encoding")}
        return ClosingStreamingResponse(resp.aiter_raw(), resp.aclose, status_code=resp.status_code, headers=kept)


def ingress(request: Request) -> Ingress:
    return request.app.state.ingress


routes = APIRouter()


@routes.get("/health")
async def health(ing: Ingress = Depends(ingress)) -> JSONResponse:
    replicas = ing.router.replicas
    states = [{"replica": r.index, "alive": r.alive, "draining": r.draining} for r in replicas]
    if not any(r.routable for r in replicas):
        return JSONResponse(errors.error_body(503, "no replica is serving") | {"replicas": states}, status_code=503)
    return JSONResponse({"status": "ok", "replicas": states})


@routes.get("/metrics")
async def prometheus(ing: Ingress = Depends(ingress)) -> Response:
    live = [r for r in ing.router.replicas if r.alive]
    texts = await asyncio.gather(*(ing.scrape(r) for r in live))
    body = ing.metrics.exposition({str(r.index): t for r, t in zip(live, texts) if t is not None})
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@routes.get("/dashboard/data")
async def dashboard_data(request: Request, ing: Ingress = Depends(ingress)) -> Response:
    return await fleet_data(ing.client, ing.router.replicas, request)


@routes.post("/v1/completions")
async def completions(request: Request, ing: Ingress = Depends(ingress)) -> Response:
    return await ing.route(request, "/v1/completions")


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request, ing: Ingress = Depends(ingress)) -> Response:
    return await ing.route(request, "/v1/chat/completions")


@routes.post(RESPONSES)
async def responses(request: Request, ing: Ingress = Depends(ingress)) -> Response:
    return await ing.route(request, RESPONSES)


@routes.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])  # last: it matches every path
async def passthrough(path: str, request: Request, ing: Ingress = Depends(ingress)) -> Response:
    return await ing.pass_through(path, request)


def create_ingress(fleet) -> FastAPI:
    ing = Ingress(fleet)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await ing.open()
        yield
        await ing.close()

    app = FastAPI(title="tollway fleet", lifespan=lifespan)
    app.state.ingress = ing
    errors.install(app)
    app.include_router(routes)
    return app


def _unavailable() -> JSONResponse:
    return JSONResponse(errors.error_body(503, "no replica is available to serve the request",
                                          code="replica_unavailable"), status_code=503)


class _NotServed(Exception):
    """The replica did not take the request (`why`); `refusal` is its answer, if it gave one."""

    def __init__(self, why: str, refusal: Response | None = None):
        super().__init__(why)
        self.why, self.refusal = why, refusal


def _holds_event(received: bytes) -> bool:
    """Whether a stream's bytes so far hold a whole event other than a comment (lines that
    begin with a colon, as the replicas' keep-alive comments do)."""
    *events, _ = received.split(b"\n\n")  # the last part is not yet whole
    return any(line and not line.startswith(b":") for event in events for line in event.split(b"\n"))


def _refusal(status: int, content: bytes) -> str | None:
    """Why another replica may serve a request this one refused: it was queue-full or
    draining (429 queue_full), or failed (5xx); None for answers any replica would give."""
    if status >= 500:
        return "replica_error"
    if status == 429:
        try:
            if json.loads(content)["error"]["code"] == "queue_full":
                return "queue_full"
        except (ValueError, KeyError, TypeError):
            pass
    return None


def prompt_text(body: dict) -> str:
    """The request's prompt as text, for prefix affinity and the token estimate: the prompt,
    or the chat messages as JSON (a conversation's next turn extends the same text)."""
    prompt = body.get("messages", body.get("prompt", ""))
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def as_text(part) -> str:
    """A response's instructions or input as routing text: a string as it is, items as JSON."""
    return "" if part is None else part if isinstance(part, str) else json.dumps(part)


def output_allowance(body: dict, path: str) -> int:
    """The most tokens each choice may generate, or the router's guess where the request leaves it open."""
    if path == RESPONSES:
        return int(body.get("max_output_tokens") or _UNSPECIFIED_MAX_TOKENS)
    return int(body.get("max_completion_tokens") or body.get("max_tokens") or (
        _UNSPECIFIED_MAX_TOKENS if "messages" in body else 16))
