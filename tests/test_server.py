"""A real server on a loopback port, driven by the official openai client and by raw HTTP."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from tollway.request import SamplingParams
from tollway.config import KeySpec
from tollway.server.keys import Gatekeeper, KeyDatabase
from tollway.server.metrics import Metrics

from tollway.async_engine import AsyncEngine
from tollway.server.app import create_app

from live_server import MODEL, running_server, serving


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    yield from running_server(make_engine(), Metrics(MODEL), batch_dir=tmp_path_factory.mktemp("batches"))


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused") as client:
        yield client


def _direct(server, prompt, **params):
    """The same request straight through the engine, for comparison."""
    async def run():
        out = None
        async for out in server["engine"].generate(prompt, SamplingParams(**params)):
            pass
        return out
    return asyncio.run(run())


def test_completion_matches_the_engine(server, client):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    direct = _direct(server, "The capital of France is", max_tokens=8, temperature=0)
    assert resp.choices[0].text == direct.text and resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 8 and resp.usage.prompt_tokens == len(direct.prompt_token_ids)
    assert resp.service_tier == "default" and resp.model == MODEL and resp.object == "text_completion"


def test_streamed_completion_adds_up_and_reports_usage(client):
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.service_tier == "default" for c in chunks)


def test_chat_streams_and_not(client):
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].object == "chat.completion.chunk"


@pytest.mark.parametrize("wire, served", [("priority", "priority"), ("scale", "priority"), ("fast", "priority"),
                                          ("flex", "flex"),
                                          ("auto", "default"), ("default", "default")])
def test_service_tier_picks_the_lane_and_is_reported(server, client, wire, served):
    messages = [{"role": "user", "content": "Hi"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          service_tier=wire)
    assert resp.service_tier == served
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                 service_tier=wire, stream=True))
    assert chunks[-1].service_tier == served
    # The legacy completions call has no service_tier argument in the client; the field still works.
    legacy = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"service_tier": wire})
    assert legacy.service_tier == served


def test_cached_tokens_come_from_the_prefix_cache(client):
    prompt = "A long shared preamble about rivers and their deltas. " * 12  # several KV blocks
    first = client.completions.create(model=MODEL, prompt=prompt + "First:", max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt + "Second:", max_tokens=1, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # whole blocks of the shared part
    assert first.usage.prompt_tokens_details.cached_tokens < cached  # the preamble was new the first time
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=1, stream=True, stream_options={"include_usage": True}))
    chunks_again = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1, stream=True,
        stream_options={"include_usage": True}))
    assert chunks_again[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert chunks[-1].usage.prompt_tokens == chunks_again[-1].usage.prompt_tokens


def test_n_choices_seeds_and_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="Colors:", max_tokens=6, n=3, seed=5, temperature=1.0,
                                     logprobs=2)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    again = client.completions.create(model=MODEL, prompt="Colors:", max_tokens=6, n=3, seed=5, temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded: reproducible
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == 6 and all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy: the top token


def test_every_response_has_a_request_id(server, client):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id  # a completion's is its id
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True) as stream:
        first = next(iter(stream.parse()))
        assert stream.headers["x-request-id"] == first.id
    ids = {httpx.get(server["url"] + path).headers["x-request-id"] for path in ("/health", "/health", "/nowhere")}
    assert len(ids) == 3 and all(i.startswith("req_") for i in ids)  # fresh ones, errors too
    given = httpx.get(server["url"] + "/v1/models", headers={"x-request-id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"  # the client's own is echoed


def test_an_internal_error_has_a_request_id_too(server):
    app = create_app(server["engine"], MODEL)

    def boom():
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)  # Starlette answers an unhandled error outside every middleware
    with TestClient(app, raise_server_exceptions=False) as local:
        r = local.get("/boom", headers={"x-request-id": "trace-500"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert r.headers["x-request-id"] == "trace-500" and "a bug" not in r.text  # nothing leaks


def test_models_and_health(server, client):
    models = httpx.get(server["url"] + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    one = client.models.retrieve(MODEL)
    assert one.id == MODEL and one.object == "model" and one.model_dump(exclude_unset=True) == models["data"][0]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-9")
    assert missing.value.code == "model_not_found" and missing.value.body["param"] == "model"
    assert httpx.get(server["url"] + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": 5}, 400, "temperature"),
    ({"prompt": "hi " * 140_000, "max_tokens": 1}, 400, "prompt"),  # past the context, whatever --max-model-len
    ({"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ({"prompt": "hi", "service_tier": "gold"}, 400, "service_tier"),
    ({"prompt": 5}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": [], "max_tokens": 3}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server["url"] + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 3}', "prompt"),
    ("/v1/completions", '{"prompt": ["fine", "a\\udfffb"], "max_tokens": 3}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 3}', "messages"),
])
def test_text_with_a_lone_surrogate_is_a_400_naming_it(server, path, body, param):
    # JSON may escape a lone surrogate, which no UTF-8 text holds: the tokenizer cannot take it.
    r = httpx.post(server["url"] + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "not valid Unicode" in error["message"] and "\\ud" in error["message"]


def test_chat_without_messages_is_a_400(server):
    r = httpx.post(server["url"] + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    engine = server["engine"]
    pool = lambda: engine.run(lambda e: (e.scheduler.pool.num_free, e.scheduler.num_running,  # noqa: E731
                                          e.scheduler.num_waiting)).result(10)
    before = pool()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": 200, "temperature": 0, "stream": True}
        async with client.stream("POST", server["url"] + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # the first chunk came: hang up mid-stream

    async def all_of_them() -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            await asyncio.gather(*(one(client, i) for i in range(100)))

    asyncio.run(all_of_them())
    deadline = time.time() + 30
    while pool()[1:] != (0, 0):
        assert time.time() < deadline, f"requests still running after disconnect: {pool()}"
        time.sleep(0.1)
    assert pool() == before


def test_min_tokens_and_ignore_eos(server, client):
    prompt = "Water boils at a temperature of"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    first_id = _direct(server, prompt, max_tokens=1, temperature=0).token_ids[0]
    # Its own first token as a stop token id: the reply stops at once ...
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [first_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    # ... unless min_tokens holds it off: that token cannot be sampled before 5 are out.
    held = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [first_id], "min_tokens": 5})
    assert held.usage.completion_tokens >= 5 and held.choices[0].text != greedy.choices[0].text
    forced = client.completions.create(model=MODEL, prompt="Hi", max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert forced.usage.completion_tokens == 20


def test_the_readme_client_example_runs(server, capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Use it from the openai client", 1)[1]
    code = section.split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code.replace("http://127.0.0.1:8000/v1", server["url"] + "/v1"), "README", "exec"), {})
    printed = capsys.readouterr().out
    assert "priority" in printed and len(printed) > 20


def test_metrics_parse_and_show_each_tier(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    for tier in ("priority", "default"):
        client.completions.create(model=MODEL, prompt="Count: one two", max_tokens=4, temperature=0,
                                  extra_body={"service_tier": tier})
    text = httpx.get(server["url"] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = {s.labels["tier"]: s.value for s in families["tollway:time_to_first_token_seconds"].samples
            if s.name.endswith("_count")}
    assert ttft["fast"] >= 1 and ttft["standard"] >= 1
    gen = {s.labels["tier"]: s.value for s in families["tollway:generation_tokens"].samples if s.name.endswith("_total")}
    assert gen["fast"] >= 4 and gen["standard"] >= 4
    waiting = {s.labels["tier"] for s in families["tollway:num_requests_waiting"].samples}
    assert waiting == {"fast", "standard", "batch"}
    steps = [s for s in families["tollway:step_seconds"].samples if s.name.endswith("_count")]
    assert steps[0].value >= 8


KEYS = [KeySpec("sk-all", "all"), KeySpec("sk-std", "std", tiers=["standard", "batch"]),
        KeySpec("sk-slow", "slow", rpm=2)]


@pytest.fixture(scope="module")
def keyed_server(make_engine, tmp_path_factory):
    database = KeyDatabase(tmp_path_factory.mktemp("keys") / "keys.sqlite")
    for details in running_server(make_engine(num_blocks=64), gatekeeper=Gatekeeper(KEYS, database)):
        yield {**details, "database": database}


def _post(server, key=None, **body):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server["url"] + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body},
                      headers=headers)


def test_keys_are_required_and_checked(keyed_server):
    for key in (None, "sk-wrong"):
        r = _post(keyed_server, key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(keyed_server["url"] + "/v1/models").status_code == 401
    assert httpx.get(keyed_server["url"] + "/health").status_code == 200  # liveness needs no key
    with openai.OpenAI(base_url=keyed_server["url"] + "/v1", api_key="sk-all") as ok:
        assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_tiers_a_key_is_not_entitled_to_are_refused_except_auto(keyed_server):
    r = _post(keyed_server, "sk-std", service_tier="priority")
    assert r.status_code == 403 and "fast" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "service_tier"
    r = _post(keyed_server, "sk-std", service_tier="auto")
    assert r.status_code == 200 and r.json()["service_tier"] == "default"
    assert _post(keyed_server, "sk-all", service_tier="priority").json()["service_tier"] == "priority"


def test_rate_limit_is_a_429_with_retry_after(keyed_server):
    admitted = [_post(keyed_server, "sk-slow") for _ in range(2)]
    assert [r.status_code for r in admitted] == [200, 200]
    # OpenAI's headers, on every answer to a limited key; rpm only, so no -tokens ones
    assert [r.headers["x-ratelimit-remaining-requests"] for r in admitted] == ["1", "0"]
    assert all(r.headers["x-ratelimit-limit-requests"] == "2" for r in admitted)
    assert admitted[1].headers["x-ratelimit-reset-requests"].endswith("s")
    assert "x-ratelimit-limit-tokens" not in admitted[1].headers
    r = _post(keyed_server, "sk-slow")
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 60
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-requests" not in _post(keyed_server, "sk-all").headers  # an unlimited key
    assert _post(keyed_server, "sk-all").status_code == 200  # other keys are unaffected


def test_keys_from_the_database(keyed_server):
    database = keyed_server["database"]
    key = database.add("carol", ["batch"], rpm=None, tpm=None)
    stored = [str(value) for row in database.database.query("SELECT * FROM keys") for value in row]
    assert stored and not any(key in value for value in stored)  # only its hash is stored
    r = _post(keyed_server, key, service_tier="flex")
    assert r.status_code == 200 and r.json()["service_tier"] == "flex"
    assert _post(keyed_server, key).status_code == 403  # standard is not among its tiers
    database.revoke("carol")
    assert _post(keyed_server, key).status_code == 401


@pytest.fixture(scope="module")
def chatty_server(make_engine):
    """Keep-alive comments after 50 ms of silence."""
    engine = AsyncEngine(make_engine(num_blocks=256))
    yield from serving(create_app(engine, MODEL, keep_alive=0.05))
    engine.shutdown()


def test_a_waiting_stream_sends_keep_alive_comments(chatty_server):
    # A long prompt: its prefill keeps the stream silent for far longer than 50 ms.
    body = {"prompt": "The rivers of Europe, from west to east, are " * 60, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", chatty_server + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    comments = [i for i, line in enumerate(lines) if line.startswith(":")]
    data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
    assert comments and set(lines[i] for i in comments) == {": keep-alive"}
    assert comments[0] < data[0]  # while it waited for its first token
    assert len(data) == 4 and lines[data[-1]] == "data: [DONE]" and len(comments) + len(data) == len(lines)
    with openai.OpenAI(base_url=chatty_server + "/v1", api_key="unused") as client:  # which clients skip
        chunks = list(client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=3, stream=True))
    assert len(chunks) == 3 and all(c.choices[0].text is not None for c in chunks)


@pytest.fixture(scope="module")
def tiny_server(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.scheduler.tiers["fast"].max_queue = 1
    yield from running_server(engine)


def test_a_full_queue_is_a_429_with_retry_after(tiny_server):
    """One seat and room for one waiting fast request: one runs, one waits, a third is refused."""
    url = tiny_server["url"] + "/v1/completions"
    body = {"prompt": "Tell me a long story", "max_tokens": 30, "temperature": 0, "service_tier": "priority"}
    waiting = lambda: tiny_server["engine"].run(lambda e: len(e.scheduler.waiting["fast"])).result(10)  # noqa: E731

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", url, json={**body, "stream": True}) as running:
                lines = running.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass  # the first chunk: it holds the only seat
                queued = asyncio.create_task(c.post(url, json=body))
                while waiting() < 1:
                    await asyncio.sleep(0.02)
                refused = await c.post(url, json=body)
                async for _ in lines:
                    pass
            return refused, await queued

    refused, queued = asyncio.run(scenario())
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "queue_full" and "fast queue is full" in refused.json()["error"]["message"]
    assert queued.status_code == 200 and queued.json()["usage"]["completion_tokens"] == 30
