"""Every OpenAI request field is honoured or refused by name, through a real server and the
official openai client; logit_bias and the repetition penalties change what greedy decoding picks."""
from __future__ import annotations

import openai
import pytest

from live_server import running_server

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
REFUSED_IN_CHAT = [
    ("functions", [TOOL["function"]]),
    ("function_call", "auto"),
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
    for server in running_server(make_engine()):
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


def _greedy(client, prompt: str, max_tokens: int, **fields) -> str:
    return client.completions.create(model="gemma3-270m", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=fields).choices[0].text


def test_logit_bias_bans_and_forces_tokens(client, default_tokenizer):
    prompt = "The capital of France is"
    plain = _greedy(client, prompt, 8)
    [first] = default_tokenizer.encode(_greedy(client, prompt, 1), add_special_tokens=False)
    banned = _greedy(client, prompt, 8, logit_bias={str(first): -100})
    assert banned != plain and first not in default_tokenizer.encode(banned, add_special_tokens=False)
    [banana] = default_tokenizer.encode(" banana", add_special_tokens=False)
    assert _greedy(client, prompt, 3, logit_bias={str(banana): 100}) == " banana" * 3


def test_bad_logit_bias_keys_are_refused_by_name(client):
    for bias in ({"not-a-token": 1}, {"99999999": 1}):
        with pytest.raises(openai.BadRequestError) as refused:
            _greedy(client, "Hi", 2, logit_bias=bias)
        assert refused.value.param == "logit_bias"


def test_frequency_penalty_reduces_repetition_in_greedy_output(client, default_tokenizer):
    """frequency_penalty grows with each repeat, so it breaks a loop presence_penalty's flat 2 does not."""
    prompt = "one one one one one one one one one one"
    plain = default_tokenizer.encode(_greedy(client, prompt, 16), add_special_tokens=False)
    penalized = default_tokenizer.encode(_greedy(client, prompt, 16, frequency_penalty=2.0), add_special_tokens=False)
    assert len(set(plain)) < len(plain) / 2  # the model repeats itself here...
    assert len(set(penalized)) / len(penalized) > len(set(plain)) / len(plain)  # ...less so when penalized


def test_penalties_out_of_range_are_refused_by_name(client):
    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="gemma3-270m", messages=MESSAGES, max_tokens=2, **{field: 2.5})
        assert refused.value.param == field
