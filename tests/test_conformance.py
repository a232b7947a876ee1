"""Every response of a live server validated against the `openai` package's own types, with
pydantic validation (model_validate, not the client's lenient construct). The JSON comes over
raw HTTP, so the validation sees exactly what was sent; the happy paths go through the openai
client too. Fields the types do not know are allowed only where tollway documents them."""
from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest
from typing import Literal

from openai.types import Batch, Completion, CompletionChoice, FileDeleted, FileObject, Model
from openai.types.completion_choice import Logprobs
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from pydantic import BaseModel

from live_server import MODEL
from test_server import server  # noqa: F401 -- the shared live server

# tollway's additions to OpenAI's objects: usage's cost, price and engine seconds (README, the
# meter), a model's context length (as vLLM's), and the lane on legacy completions too.
EXTENSIONS = {"cost", "price", "engine_seconds", "max_model_len", "service_tier"}
CHAT = [{"role": "user", "content": "Name a river."}]


class StreamedCompletionChoice(CompletionChoice):
    """A legacy completion chunk's choice: OpenAI's own streams send finish_reason null until the
    last chunk, which the package's Completion (written from the non-streaming response) does
    not allow. Nothing else differs."""

    finish_reason: Literal["stop", "length", "content_filter"] | None = None


class StreamedCompletion(Completion):
    choices: list[StreamedCompletionChoice]


class EchoedLogprobs(Logprobs):
    """An echo's logprobs: OpenAI's own legacy completions (and vLLM's) send null for the
    prompt's first token, which nothing precedes; the package's Logprobs, written from responses
    without echo, does not allow it. Nothing else differs."""

    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class EchoedChoice(CompletionChoice):
    logprobs: EchoedLogprobs | None = None


class EchoedCompletion(Completion):
    choices: list[EchoedChoice]


class EchoedStreamedChoice(StreamedCompletionChoice):
    logprobs: EchoedLogprobs | None = None


class EchoedStreamedCompletion(Completion):
    choices: list[EchoedStreamedChoice]


def _validated(kind: type[BaseModel], data: dict) -> BaseModel:
    """`data` as `kind`, with nothing in it, at any depth, that the type does not define
    except tollway's documented EXTENSIONS."""
    parsed = kind.model_validate(data)
    unknown = _extra_fields(parsed) - EXTENSIONS
    assert not unknown, f"{kind.__name__} has fields OpenAI's type does not: {unknown}"
    return parsed


def _extra_fields(value) -> set[str]:
    if isinstance(value, BaseModel):
        found = set(value.model_extra or {})
        for name in type(value).model_fields:
            found |= _extra_fields(getattr(value, name))
        return found
    if isinstance(value, list | tuple):
        return set().union(*(_extra_fields(v) for v in value))
    if isinstance(value, dict):
        return set().union(*(_extra_fields(v) for v in value.values()))
    return set()


def _error(response: httpx.Response, status: int) -> ErrorObject:
    """An error response in OpenAI's shape, {"error": ErrorObject}, and nothing else."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    return _validated(ErrorObject, body["error"])


def _events(server, path: str, body: dict) -> list[dict]:
    """A stream's data events, parsed; comments skipped; it must end with [DONE]."""
    with httpx.stream("POST", server["url"] + path, json={"model": MODEL, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server["url"] + path, json={"model": MODEL, **body}, timeout=120)


@pytest.mark.parametrize("body", [
    {"prompt": "The sea is", "max_tokens": 4},
    {"prompt": ["One", "Two"], "max_tokens": 3, "n": 2, "seed": 1, "temperature": 1.0},
    {"prompt": "The sea is", "max_tokens": 3, "logprobs": 2, "echo": True},
], ids=["plain", "n", "logprobs"])
def test_completions(server, body):  # noqa: F811
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    echo = body.get("echo", False)
    resp = _validated(EchoedCompletion if echo else Completion, r.json())
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    assert len(resp.choices) == len(prompts) * body.get("n", 1)
    if "logprobs" in body:
        lp = resp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    chunk_type = EchoedStreamedCompletion if echo else StreamedCompletion
    chunks = [_validated(chunk_type, e) for e in _events(server, "/v1/completions",
                                                         {**body, "stream_options": {"include_usage": True}})]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    finished = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(choice.index for choice in finished) == list(range(len(resp.choices)))  # once per choice


@pytest.mark.parametrize("body", [
    {"messages": CHAT, "max_tokens": 4},
    {"messages": CHAT, "max_completion_tokens": 3, "n": 2, "seed": 1, "temperature": 1.0},
    {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
], ids=["plain", "n", "logprobs"])
def test_chat_completions(server, body):  # noqa: F811
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    resp = _validated(ChatCompletion, r.json())
    assert len(resp.choices) == body.get("n", 1) and resp.usage.prompt_tokens_details is not None
    if body.get("logprobs"):
        assert all(len(t.top_logprobs) == 2 for t in resp.choices[0].logprobs.content)
    chunks = [_validated(ChatCompletionChunk, e) for e in _events(server, "/v1/chat/completions",
                                                                  {**body, "stream_options": {"include_usage": True}})]
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[-1].usage.total_tokens == resp.usage.total_tokens
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == \
        list(range(body.get("n", 1)))


def test_the_openai_client_gets_the_same_shapes(server):  # noqa: F811
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused") as client:
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=1)
        _validated(ChatCompletion, chat.to_dict())
        for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True):
            _validated(ChatCompletionChunk, chunk.to_dict())
        _validated(Completion, client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2).to_dict())
        for model in client.models.list():
            _validated(Model, model.to_dict())
        _validated(Model, client.models.retrieve(MODEL).to_dict())


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITY = {"type": "json_schema", "json_schema": {"name": "city", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}}}


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tools"),
    ({"response_format": CITY}, "response_format"),
], ids=["tools", "json_schema"])
def test_tools_and_json_schema_answer_in_openai_shapes(server, body, param):  # noqa: F811
    """A ChatCompletion (and chunks) that carries what was asked, in OpenAI's shape."""
    # "Name a country.": asked for "a river" under the schema, the 270M model repeats itself to max_tokens.
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a country."}],
                                               "max_tokens": 24, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    choice = _validated(ChatCompletion, r.json()).choices[0]
    if param == "tools":
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "weather"
        assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments)["city"], str)
    else:
        assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content)["name"], str)
    for event in _events(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, **body}):
        _validated(ChatCompletionChunk, event)


def test_the_openai_clients_parse_gets_a_validated_object(server):  # noqa: F811
    """client.chat.completions.parse with a pydantic model: the reply validates against it; cut
    short by max_tokens, the client raises LengthFinishReasonError as it does with OpenAI."""
    class City(BaseModel):  # strings: an unbounded integer is one this model writes digits into until cut
        name: str
        country: str

    question = [{"role": "user", "content": "Describe the city of Paris as JSON."}]
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0) as client:
        done = client.chat.completions.parse(model=MODEL, messages=question, response_format=City, max_tokens=120,
                                             temperature=0)
        city = done.choices[0].message.parsed
        assert isinstance(city, City) and done.choices[0].finish_reason == "stop"
        assert json.loads(done.choices[0].message.content) == city.model_dump()
        with pytest.raises(openai.LengthFinishReasonError):
            client.chat.completions.parse(model=MODEL, messages=question, response_format=City, max_tokens=3)
        anything = client.chat.completions.create(model=MODEL, messages=question, max_tokens=120, temperature=0,
                                                  response_format={"type": "json_object"})
        assert isinstance(json.loads(anything.choices[0].message.content), dict)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=question, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {"type": "nonsense"}}})
        assert e.value.body["param"] == "response_format"


@pytest.mark.parametrize("method, path, body, status, param", [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("POST", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("POST", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "service_tier": "gold"}, 400, "service_tier"),
    ("POST", "/v1/completions", "{not json", 400, None),
    ("GET", "/v1/models/gpt-9", None, 404, "model"),
    ("GET", "/v1/files/file_nope", None, 404, "file_id"),
    ("GET", "/v1/batches/batch_nope", None, 404, "batch_id"),
    ("GET", "/v1/files?limit=0", None, 400, "limit"),
    ("GET", "/v1/nowhere", None, 404, None),
    ("DELETE", "/v1/completions", None, 405, None),
])
def test_error_bodies(server, method, path, body, status, param):  # noqa: F811
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body})
    r = httpx.request(method, server["url"] + path, content=body, headers={"content-type": "application/json"})
    error = _error(r, status)
    assert error.param == param and error.message and error.type


def test_a_stream_refused_before_its_first_byte_is_a_plain_error(server):  # noqa: F811
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "stream": True, "max_tokens": 10**9})
    assert _error(r, 400).param == "max_tokens" and r.headers["content-type"] == "application/json"


def _wait(server, batch_id: str) -> dict:
    deadline = time.time() + 120
    while True:
        batch = httpx.get(server["url"] + f"/v1/batches/{batch_id}").json()
        if batch["status"] not in ("validating", "in_progress", "finalizing"):
            return batch
        assert time.time() < deadline, batch
        time.sleep(0.2)


def test_files_and_batches(server):  # noqa: F811
    url = server["url"]
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": CHAT, "max_tokens": 3}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": CHAT, "max_tokens": -1}}]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    r = httpx.post(url + "/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"})
    uploaded = _validated(FileObject, r.json())
    assert _validated(FileObject, httpx.get(url + f"/v1/files/{uploaded.id}").json()) == uploaded
    listed = httpx.get(url + "/v1/files", params={"limit": 1}).json()
    assert isinstance(listed["has_more"], bool) and listed["object"] == "list"
    for item in listed["data"]:
        _validated(FileObject, item)

    r = httpx.post(url + "/v1/batches", json={"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
    created = _validated(Batch, r.json())
    done = _validated(Batch, _wait(server, created.id))
    assert done.status == "completed" and done.request_counts.completed == 1 and done.request_counts.failed == 1
    for item in httpx.get(url + "/v1/batches").json()["data"]:
        _validated(Batch, item)
    output = [json.loads(x) for x in httpx.get(url + f"/v1/files/{done.output_file_id}/content").text.splitlines()]
    assert _validated(ChatCompletion, output[0]["response"]["body"]).id == output[0]["response"]["request_id"]
    failed = [json.loads(x) for x in httpx.get(url + f"/v1/files/{done.error_file_id}/content").text.splitlines()]
    assert _validated(ErrorObject, failed[0]["response"]["body"]["error"]).param == "max_tokens"
    assert _error(httpx.post(url + f"/v1/batches/{done.id}/cancel"), 409).message

    with openai.OpenAI(base_url=url + "/v1", api_key="unused") as client:  # the same through the client
        _validated(Batch, client.batches.retrieve(done.id).to_dict())
        _validated(FileObject, client.files.retrieve(done.output_file_id).to_dict())
        deleted = _validated(FileDeleted, httpx.delete(url + f"/v1/files/{uploaded.id}").json())
        assert deleted.deleted and deleted.id == uploaded.id
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(uploaded.id)
