"""Every list and string in a request body is bounded: past a bound the official openai client
gets a 400 whose OpenAI-style error names the parameter, and the engine never sees the request."""
from __future__ import annotations

import openai
import pytest

from tollway.server.metrics import Metrics
from tollway.server.protocol import MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_PROMPTS, MAX_STOP, MAX_TEXT_CHARS

from live_server import MODEL, running_server


@pytest.fixture(scope="module")
def client(make_engine):
    for details in running_server(make_engine(), Metrics(MODEL)):
        yield openai.OpenAI(base_url=details["url"] + "/v1", api_key="unused", max_retries=0)


def refused(call, **body) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call(model=MODEL, max_tokens=1, **body)
    assert e.value.status_code == 400
    return e.value.body  # the "error" object: message, type, param, code


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("field, value", [
    ("stop", [f"s{i}" for i in range(MAX_STOP + 1)]),
    ("stop", [f"s{i}" for i in range(1000)]),
    ("stop", "x" * 1000),
    ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
    ("logit_bias", {"5": 1000}),
    ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("metadata", {"k": "v" * 513}),
    ("stop_token_ids", list(range(65))),
    ("user", "u" * 1000),
])
def test_each_bound_names_its_parameter(client, field, value):
    for call, body in ((client.chat.completions.create, {"messages": HI}),
                       (client.completions.create, {"prompt": "Hi"})):
        extra = {field: value} if field in ("stop", "user") else {}  # the rest are not in every create()
        error = refused(call, **body, **extra, extra_body={} if extra else {field: value})
        assert error["param"] == field and error["type"] == "invalid_request_error", error
        assert error["message"]


def test_messages_and_prompts_are_bounded_in_number_and_size(client):
    chat, complete = client.chat.completions.create, client.completions.create
    assert refused(chat, messages=HI * (MAX_MESSAGES + 1))["param"] == "messages"
    assert refused(chat, messages=[{"role": "user", "content": "x" * (MAX_TEXT_CHARS + 1)}])["param"] == "messages"
    assert refused(complete, prompt=["Hi"] * (MAX_PROMPTS + 1))["param"] == "prompt"
    assert refused(complete, prompt="x" * (MAX_TEXT_CHARS + 1))["param"] == "prompt"


def test_requests_at_the_bounds_are_served(client):
    resp = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, stop=["a", "b", "c", "d"],
                                          metadata={f"k{i}": "v" for i in range(16)}, user="u" * 256,
                                          extra_body={"logit_bias": {"5": 100}})
    assert resp.choices[0].finish_reason in ("stop", "length")
