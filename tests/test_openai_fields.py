"""Every OpenAI request field is honoured or refused by name, through a real server and the
official openai client."""
from __future__ import annotations

import logging

import openai
import pytest

from live_server import running_server

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
REFUSED_IN_CHAT = [
    ("tools", [TOOL]),
    ("tool_choice", "required"),
    ("functions", [TOOL["function"]]),
    ("function_call", "auto"),
    ("parallel_tool_calls", False),
    ("response_format", {"type": "json_object"}),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "hello"}),
    ("web_search_options", {}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("store", True),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("prompt_cache_options", {"mode": "explicit"}),
    ("prompt_cache_retention", "24h"),
]
REFUSED_IN_COMPLETIONS = [("best_of", 2), ("suffix", " and so on")]
MESSAGES = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def client(make_engine):
    for server in running_server(make_engine(kernel="int8")):
        with openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0) as client:
            yield client


@pytest.mark.parametrize("field, value", REFUSED_IN_CHAT, ids=[f for f, _ in REFUSED_IN_CHAT])
def test_unhonoured_chat_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="gemma3-270m", messages=MESSAGES, max_tokens=2,
                                       extra_body={field: value})
    assert refused.value.param == field
    assert "not supported" in refused.value.message or "only" in refused.value.message


@pytest.mark.parametrize("field, value", REFUSED_IN_COMPLETIONS, ids=[f for f, _ in REFUSED_IN_COMPLETIONS])
def test_unhonoured_completion_fields_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="gemma3-270m", prompt="Once", max_tokens=2, extra_body={field: value})
    assert refused.value.param == field


def test_values_that_ask_for_nothing_are_accepted(client):
    out = client.chat.completions.create(
        model="gemma3-270m", messages=MESSAGES, max_tokens=2, temperature=0, tools=[], tool_choice="none",
        response_format={"type": "text"}, modalities=["text"], store=False, parallel_tool_calls=True,
        prompt_cache_key="k", safety_identifier="u1")
    assert out.choices[0].message.content
    out = client.completions.create(model="gemma3-270m", prompt="Once", max_tokens=2, best_of=1, suffix="")
    assert out.choices[0].text


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_non_text_content_parts_are_refused(client, part):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="gemma3-270m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}])
    assert refused.value.param == "messages"
    assert part["type"] in refused.value.message


def test_unknown_extra_fields_are_accepted_and_logged_once(client, caplog):
    with caplog.at_level(logging.WARNING, logger="tollway.server.protocol"):
        for _ in range(2):
            out = client.chat.completions.create(model="gemma3-270m", messages=MESSAGES, max_tokens=2,
                                                 extra_body={"x_frobnicate_level": 3})
            assert out.choices[0].message.content
    assert sum("x_frobnicate_level" in r.getMessage() for r in caplog.records) == 1
