"""Grammar-constrained decoding in the engine (model/grammar.py): what a request with a grammar
generates follows it, stops when it is complete, is the same alone or batched, and the mask's
time is charged to that request alone."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
from llguidance import LLMatcher
from pydantic import BaseModel, ConfigDict

from tollway.request import InvalidRequest, SamplingParams

PROMPT = "<start_of_turn>user\nDescribe a person as JSON.<end_of_turn>\n<start_of_turn>model\n"


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties false, as OpenAI's strict schemas

    name: str
    age: int
    pets: list[str]


class Story(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str
    summary: str
    characters: list[str]


def grammar(model: type[BaseModel]) -> str:
    return LLMatcher.grammar_from_json_schema(model.model_json_schema(), defaults={"whitespace_flexible": False})


GRAMMAR = grammar(Person)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(num_blocks=256)


def run(engine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.finished:
                outs[out.request_id] = out
    return outs


def test_the_output_follows_the_schema_and_stops_when_complete(engine):
    out = run(engine, {"p": (PROMPT, SamplingParams(max_tokens=200, temperature=0.0, grammar=GRAMMAR))})["p"]
    person = Person.model_validate_json(out.text)
    assert out.finish_reason == "stop" and json.loads(out.text) == person.model_dump()
    # Unconstrained, the model does not answer in this JSON: the grammar is what made it so.
    free = run(engine, {"f": (PROMPT, SamplingParams(max_tokens=len(out.token_ids), temperature=0.0))})["f"]
    with pytest.raises(ValueError):
        Person.model_validate_json(free.text)


def test_sampled_output_follows_it_too(engine):
    outs = run(engine, {f"s{i}": (PROMPT, SamplingParams(max_tokens=60, temperature=1.5, seed=i, grammar=GRAMMAR))
                        for i in range(4)})
    for out in outs.values():
        Person.model_validate_json(out.text)
        assert out.finish_reason in ("stop", "length") and len(out.token_ids) <= 60


def test_cut_short_by_max_tokens_the_reply_still_parses_and_says_length(engine):
    story = "<start_of_turn>user\nWrite a long story as JSON.<end_of_turn>\n<start_of_turn>model\n"
    # Cut at 96 if it runs longer: every shorter cut below must still parse.
    whole = run(engine, {"w": (story, SamplingParams(max_tokens=96, temperature=0.0, grammar=grammar(Story)))})["w"]
    n = len(whole.token_ids)
    assert n > 40
    for max_tokens in sorted({16, n // 2, n - 2}):
        out = run(engine, {"c": (story, SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar(Story)))})["c"]
        Story.model_validate_json(out.text)
        assert out.finish_reason == "length" and len(out.token_ids) <= max_tokens
    # Too few tokens for any complete reply: the valid beginning of one, cut.
    out = run(engine, {"c": (PROMPT, SamplingParams(max_tokens=5, temperature=0.0, grammar=GRAMMAR))})["c"]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith('{"name":"')
    matcher = LLMatcher(engine.runner.grammars._lltokenizer(), GRAMMAR)
    assert matcher.consume_tokens(out.token_ids) and not matcher.is_error()


def test_batching_never_changes_a_constrained_result(engine):
    alone = run(engine, {"a": (PROMPT, SamplingParams(max_tokens=60, temperature=0.0, grammar=GRAMMAR))})["a"]
    others = {f"o{i}": ("Once upon a time" * (i + 1), SamplingParams(max_tokens=40, temperature=0.0)) for i in range(6)}
    batched = run(engine, {"a": (PROMPT, SamplingParams(max_tokens=60, temperature=0.0, grammar=GRAMMAR)), **others})
    assert batched["a"].token_ids == alone.token_ids
    # and the grammar changed nothing for the unconstrained requests beside it
    for rid, (prompt, params) in others.items():
        assert run(engine, {rid: (prompt, params)})[rid].token_ids == batched[rid].token_ids


def test_the_mask_is_the_constrained_requests_own_time(engine):
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0.0, grammar=GRAMMAR), request_id="g")
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, temperature=0.0), request_id="u")
    grammar = weakref.ref(engine.scheduler.get("g").grammar)
    seen = []
    while engine.has_unfinished():
        seen.append(engine.step().result.own_seconds)
    assert all(set(own) <= {"g"} for own in seen)
    assert sum(1 for own in seen if own.get("g", 0) > 0) == 4  # one mask per token it sampled
    gc.collect()
    assert grammar() is None  # it went with its request


def test_a_grammar_that_cannot_run_is_refused_by_name(engine):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request(PROMPT, SamplingParams(grammar="start: ("), request_id="bad")
    assert e.value.param == "response_format"
    assert not engine.has_unfinished() and engine.scheduler.get("bad") is None
