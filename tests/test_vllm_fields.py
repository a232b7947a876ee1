"""vLLM's request fields through a real server and the official openai client (extra_body):
priority picks a lane, min_p, top_k and repetition_penalty change what is sampled, guided_* and
structured_outputs constrain the output through llguidance, the chat template's flags, the
cheap extras honoured, the rest refused by name; and a field no one knows is refused as OpenAI
refuses it."""
from __future__ import annotations

import json
import re
import time
import typing

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from live_server import MODEL, running_server
from tollway.config import KeySpec
from tollway.server.errors import APIError
from tollway.server.keys import Gatekeeper
from tollway.server.metrics import Metrics
from tollway.server.protocol import ChatCompletionRequest, CompletionRequest
from tollway.server.service_tier import asked_tier

ALL, STANDARD_ONLY = "sk-all", "sk-standard"
CHAT = [{"role": "user", "content": "Name three colours."}]
REPEATS = "one one one one one one one one one one"


@pytest.fixture(scope="module")
def server(make_engine):
    keys = Gatekeeper([KeySpec(ALL), KeySpec(STANDARD_ONLY, tiers=["standard", "batch"])])
    yield from running_server(make_engine(), Metrics(MODEL), gatekeeper=keys)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key=ALL, max_retries=0) as client:
        yield client


def _complete(client, prompt: str = "The capital of France is", max_tokens: int = 8, **fields):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=fields)


def _chat(client, messages=CHAT, max_tokens: int = 8, **fields):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          extra_body=fields)


def test_every_field_the_openai_client_sends_is_known():
    for params, body in ((chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest),
                         (completion_create_params.CompletionCreateParamsBase, CompletionRequest)):
        assert set(typing.get_type_hints(params)) <= set(body.model_fields)


def test_priority_and_service_tier_as_a_lane():
    assert asked_tier(None, None) == ("standard", None, "service_tier")
    assert asked_tier("flex", None) == ("batch", "flex", "service_tier")
    assert asked_tier(None, -3) == ("fast", -3, "priority")
    assert asked_tier("auto", 2) == ("batch", 2, "priority")
    assert asked_tier("auto", 0) == ("standard", "auto", "service_tier")  # 0 is vLLM's default: auto may fall back
    assert asked_tier("priority", -1) == ("fast", -1, "priority")
    with pytest.raises(APIError) as refused:
        asked_tier("priority", 0)
    assert refused.value.status == 400 and refused.value.param == "priority"


def _finished_in(server, tier: str) -> float:
    """Requests the engine finished in `tier`, by the server's Prometheus metrics."""
    text = httpx.get(server["url"] + "/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "tollway:request_success_total" and sample.labels["tier"] == tier)


@pytest.mark.parametrize("priority, wire, tier", [(-5, "priority", "fast"), (0, "default", "standard"),
                                                  (3, "flex", "batch")])
def test_priority_picks_the_lane_the_response_names(client, server, priority, wire, tier):
    before = _finished_in(server, tier)
    assert _complete(client, max_tokens=2, priority=priority).service_tier == wire
    assert _chat(client, max_tokens=2, priority=priority).service_tier == wire
    deadline = time.monotonic() + 5  # the metrics hear of a finish on the engine's thread
    while _finished_in(server, tier) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _finished_in(server, tier) == before + 2  # the engine ran them in that lane


def test_priority_and_service_tier_must_name_the_same_lane(client):
    assert _complete(client, max_tokens=2, priority=-1, service_tier="priority").service_tier == "priority"
    assert _complete(client, max_tokens=2, priority=-1, service_tier="auto").service_tier == "priority"
    with pytest.raises(openai.BadRequestError) as refused:
        _complete(client, max_tokens=2, priority=-1, service_tier="default")
    assert refused.value.param == "priority" and "service_tier" in refused.value.message


def test_a_key_without_the_fast_lane_is_refused_its_priority_as_its_service_tier(server):
    with openai.OpenAI(base_url=server["url"] + "/v1", api_key=STANDARD_ONLY, max_retries=0) as limited:
        for fields, param in (({"priority": -1}, "priority"), ({"service_tier": "priority"}, "service_tier")):
            with pytest.raises(openai.PermissionDeniedError) as refused:
                _complete(limited, max_tokens=2, **fields)
            assert refused.value.param == param and refused.value.code == "tier_not_allowed"
        assert _complete(limited, max_tokens=2, priority=1).service_tier == "flex"


def test_repetition_penalty_breaks_a_greedy_loop(client, default_tokenizer):
    plain = default_tokenizer.encode(_complete(client, REPEATS, 16).choices[0].text, add_special_tokens=False)
    penalized = default_tokenizer.encode(_complete(client, REPEATS, 16, repetition_penalty=2.0).choices[0].text,
                                         add_special_tokens=False)
    assert len(set(plain)) < len(plain) / 2  # the model repeats itself here...
    [one] = default_tokenizer.encode(" one", add_special_tokens=False)
    assert penalized.count(one) < plain.count(one)  # ...and a prompt token is penalized before it is generated
    assert len(set(penalized)) / len(penalized) > len(set(plain)) / len(plain)


def test_min_p_one_and_top_k_one_leave_only_the_greedy_token(client):
    greedy = _complete(client, max_tokens=12).choices[0].text
    for fields in ({"min_p": 1.0}, {"top_k": 1}):
        hot = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                        temperature=2.0, seed=3, extra_body=fields)
        assert hot.choices[0].text == greedy, fields
    unconstrained = {client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12,
                                               temperature=2.0, seed=s).choices[0].text for s in range(3)}
    assert unconstrained != {greedy}  # temperature 2 alone wanders


def test_sampling_fields_give_the_same_tokens_alone_or_among_concurrent_requests(client):
    from concurrent.futures import ThreadPoolExecutor

    fields = [dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=0.9, seed=11, min_p=0.1, top_k=20,
                                                                   repetition_penalty=1.2)]
    prompts = ["Once upon a time", "The quick brown fox", "def add(a, b):", "Water boils at"]

    def run(prompt, f):
        body = dict(f)
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=body.pop("temperature"),
                                         seed=body.pop("seed", None), extra_body=body).choices[0].text

    alone = [run(p, f) for f in fields for p in prompts]
    with ThreadPoolExecutor(len(alone)) as pool:
        together = list(pool.map(lambda pf: run(*pf), [(p, f) for f in fields for p in prompts]))
    assert together == alone


@pytest.mark.parametrize("fields, check", [
    ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
                      "additionalProperties": False}}, lambda t: isinstance(json.loads(t)["n"], int)),
    ({"guided_json": json.dumps({"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2})},
     lambda t: [type(v) for v in json.loads(t)] == [bool, bool]),
    ({"guided_grammar": 'start: "colour: " COLOUR\nCOLOUR: "red" | "green" | "blue"'},
     lambda t: t in ("colour: red", "colour: green", "colour: blue")),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"regex": "[A-Z]{4}"}}, lambda t: re.fullmatch("[A-Z]{4}", t)),
    ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
], ids=["choice", "regex", "json", "json_string", "grammar", "so_choice", "so_regex", "so_json_object",
        "response_format"])
def test_guided_fields_constrain_chat_and_completions(client, fields, check):
    chat = _chat(client, max_tokens=40, **fields)
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)
    text = _complete(client, "Answer:", 40, **fields).choices[0].text
    assert check(text), text


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " +", "regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_malformed_or_conflicting_constraints_are_refused_by_name(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, max_tokens=2, **fields)
    assert refused.value.param == param


def test_a_guided_field_with_tools_that_force_a_call_is_refused(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, tools=[tool], tool_choice="required",
                                       extra_body={"guided_regex": "a"})
    assert refused.value.param == "guided_regex"


def test_continue_final_message_continues_the_assistants_text(client, default_tokenizer):
    """The template rendered without a generation prompt and cut after the assistant's text: the
    same tokens a plain completion of that text gets."""
    messages = [{"role": "user", "content": "Count from one to ten in words."},
                {"role": "assistant", "content": "one, two, three,"}]
    rendered = default_tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    prompt = rendered[:rendered.rindex("one, two, three,") + len("one, two, three,")]
    ids = default_tokenizer.encode(prompt, add_special_tokens=False)
    want = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    got = _chat(client, messages, 8, continue_final_message=True, add_generation_prompt=False)
    assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(ids)
    assert got.choices[0].message.content == want.choices[0].text and "four" in got.choices[0].message.content
    for fields in ({"continue_final_message": True, "add_generation_prompt": True},):
        with pytest.raises(openai.BadRequestError) as refused:
            _chat(client, messages, 2, **fields)
        assert refused.value.param == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, CHAT, 2, continue_final_message=True)  # the last message is the user's
    assert refused.value.param == "continue_final_message"


def test_add_generation_prompt_false_leaves_out_the_models_turn(client):
    asked = _chat(client, max_tokens=1).usage.prompt_tokens
    assert _chat(client, max_tokens=1, add_generation_prompt=False).usage.prompt_tokens < asked


def test_stop_strings_skip_special_tokens_and_bad_words(client, default_tokenizer):
    plain = _complete(client, max_tokens=8).choices[0].text  # " Paris. ..." on this model
    word = plain.split()[0].strip(".,")
    assert _complete(client, stop=[word]).choices[0].text == plain[:plain.index(word)]
    kept = _complete(client, stop=[word], include_stop_str_in_output=True).choices[0].text
    assert kept == plain[:plain.index(word) + len(word)]
    assert word not in _complete(client, bad_words=[word]).choices[0].text

    special = default_tokenizer.encode("<start_of_turn>", add_special_tokens=False)
    forced = {str(special[0]): 100}
    assert _complete(client, max_tokens=2, logit_bias=forced).choices[0].text == ""
    assert "<start_of_turn>" in _complete(client, max_tokens=2, logit_bias=forced,
                                          skip_special_tokens=False).choices[0].text


def test_allowed_token_ids_and_truncate_prompt_tokens(client, default_tokenizer):
    allowed = default_tokenizer.encode(" red green blue", add_special_tokens=False)
    out = _complete(client, max_tokens=6, allowed_token_ids=allowed).choices[0].text
    assert set(default_tokenizer.encode(out, add_special_tokens=False)) <= set(allowed)
    assert _complete(client, "a b c d e f g h i j k l m n o p", 1, truncate_prompt_tokens=5).usage.prompt_tokens == 5


def test_common_vllm_fields_at_their_defaults_are_accepted(client):
    defaults = dict(skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
                    min_tokens=0, ignore_eos=False, stop_token_ids=[], use_beam_search=False, length_penalty=1.0,
                    prompt_logprobs=None, bad_words=[], allowed_token_ids=None, return_tokens_as_token_ids=False,
                    request_id="my-call-1", priority=0, kv_transfer_params=None, vllm_xargs=None, top_k=-1, min_p=0.0,
                    repetition_penalty=1.0, truncate_prompt_tokens=None)
    plain = _complete(client).choices[0].text
    assert _complete(client, **defaults, add_special_tokens=True).choices[0].text == plain
    chat = _chat(client, **defaults, add_special_tokens=False, documents=None, chat_template=None,
                 mm_processor_kwargs=None, echo=False, add_generation_prompt=True, continue_final_message=False,
                 chat_template_kwargs={}, include_reasoning=True)
    assert chat.choices[0].message.content == _chat(client).choices[0].message.content


@pytest.mark.parametrize("field, value", [
    ("use_beam_search", True), ("length_penalty", 0.5), ("spaces_between_special_tokens", False),
    ("return_tokens_as_token_ids", True), ("logits_processors", ["my.module:fn"]),
    ("vllm_xargs", {"a": 1}), ("kv_transfer_params", {"do_remote_decode": True}), ("cache_salt", "s"),
    ("mm_processor_kwargs", {"num_crops": 4}), ("chat_template", "{{ messages }}"), ("echo", True),
    ("guided_whitespace_pattern", " "), ("structural_tag", "{}"),
])
def test_unhonoured_vllm_fields_are_refused_by_name_with_why(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, max_tokens=2, **{field: value})
    assert refused.value.param == field
    assert "not supported" in refused.value.message or "not disaggregated" in refused.value.message \
        or "decoded as" in refused.value.message


@pytest.mark.parametrize("field, value", [("min_p", 1.5), ("repetition_penalty", 0), ("allowed_token_ids", [10**9]),
                                          ("truncate_prompt_tokens", 0), ("top_k", -2), ("bad_words", [""]),
                                          ("priority", "high")])
def test_bad_vllm_values_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        _complete(client, max_tokens=2, **{field: value})
    assert refused.value.param == field


def test_a_bad_word_that_is_not_unicode_is_refused_by_name(server):
    # JSON's "\ud800" escape parses to a lone surrogate, which no UTF-8 holds (the openai client cannot send it)
    body = '{"model": "%s", "prompt": "x", "max_tokens": 1, "bad_words": ["\\ud800"]}' % MODEL
    response = httpx.post(server["url"] + "/v1/completions", content=body, timeout=60,
                          headers={"authorization": f"Bearer {ALL}", "content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "bad_words"


def test_an_unknown_field_is_refused_as_openai_refuses_it(client, server):
    for call in (lambda: _complete(client, x_frobnicate_level=3), lambda: _chat(client, x_frobnicate_level=3)):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == "x_frobnicate_level"
        assert refused.value.body == {"message": "Unrecognized request argument supplied: x_frobnicate_level",
                                      "type": "invalid_request_error", "param": "x_frobnicate_level", "code": None}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True, "bogus": 1})
    assert refused.value.param == "stream_options"
