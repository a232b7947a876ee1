"""A long step stops between two layers for a fast request that arrives during it: the fast
request's steps run beside it, it runs on in slices between them, and nothing it computes
changes (on the default model, through the engine)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tollway.config import SchedulerConfig
from tollway.request import Request, SamplingParams
from tollway.scheduler.scheduler import Scheduler
from tollway.scheduler.step_budget import TimeTarget
from tollway.scheduler.step_model import StepTimeModel

from tollway.server.metrics import Metrics

from live_server import MODEL, running_server

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine(kernel="q8", enable_prefix_caching=False)


def _prompts(engine, count: int, words: int) -> list[list[int]]:
    text = "the quick brown fox jumps over the lazy dog and then runs far away " * (words // 14 + 1)
    ids = engine.tokenizer.encode(text)[:words]
    return [ids[i:] + ids[:i] for i in range(count)]  # distinct, so no two share a block's prefix


def _tokens_alone(engine, prompt, tier="standard") -> list[int]:
    rid = engine.add_request(prompt, PARAMS, tier=tier)
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == rid and out.finished:
                return out.token_ids
    raise AssertionError("never finished")


def test_a_fast_request_runs_beside_a_paused_step_and_no_greedy_output_changes(engine):
    standard, (fast_prompt,) = _prompts(engine, 3, 150), _prompts(engine, 1, 40)
    want = [_tokens_alone(engine, p) for p in standard] + [_tokens_alone(engine, fast_prompt, "fast")]
    ids = [engine.add_request(p, PARAMS) for p in standard]
    engine.runner.step_yield.ask()  # as the server does when it hands the engine a fast request
    paused = engine.step()
    assert paused.paused and paused.plan is None and paused.outputs == [] and engine.runner.paused_step is not None
    fast = engine.add_request(fast_prompt, PARAMS, tier="fast")
    engine.runner.step_yield.clear()
    first = engine.step()  # the fast prompt, beside the paused step
    assert [o.request_id for o in first.outputs] == [fast] and [s.request_id for s in first.plan.seqs] == [fast]
    got, order = {o.request_id: o for o in first.outputs}, []
    while engine.has_unfinished():
        for out in engine.step().outputs:
            got[out.request_id] = out
            order.append(out.request_id)
    assert [got[rid].token_ids for rid in ids + [fast]] == want
    # The fast request's second token came while the paused step still ran: a slice of it, then
    # a fast step, turn about, until the paused step ended with every standard prompt's first token.
    assert order.index(fast) < min(order.index(rid) for rid in ids)
    assert engine.scheduler.pool.num_free == engine.scheduler.pool.num_blocks


def test_a_request_aborted_while_its_step_is_paused_is_withdrawn_when_the_step_ends(engine):
    """Its final output (and the freeing of its blocks) waits for the paused step, which still
    writes its KV: so the step's share is billed to it, as of any step it was in."""
    a, b = _prompts(engine, 2, 120)
    pool = engine.scheduler.pool
    ids = [engine.add_request(p, PARAMS) for p in (a, b)]
    engine.runner.step_yield.ask()
    assert engine.step().paused and engine.runner.paused_step is not None
    engine.runner.step_yield.clear()
    held = pool.num_free
    assert engine.abort(ids[0]) is None and engine.abort_all() == []  # both in the paused step
    assert pool.num_free == held and engine.scheduler.get(ids[0]) is not None
    outs = []
    while engine.has_unfinished():  # the paused step ends, though no fast request came
        outs += engine.step().outputs
    ended = {o.request_id: o for o in outs if o.finished}
    assert ended[ids[0]].finish_reason == ended[ids[1]].finish_reason == "abort"
    assert len(ended[ids[0]].token_ids) == 1  # the paused step's token, then withdrawn
    assert pool.num_free == pool.num_blocks


def test_a_request_aborted_beside_a_paused_step_goes_at_once(engine):
    prompt = _prompts(engine, 1, 100)[0]
    standard = engine.add_request(prompt, PARAMS)
    engine.runner.step_yield.ask()
    assert engine.step().paused
    engine.runner.step_yield.clear()
    late = engine.add_request(prompt[::-1], PARAMS)  # waiting: not in the paused step
    out = engine.abort(late)
    assert out is not None and out.finished and out.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.get(standard) is None


def test_steps_are_sized_for_one_layer_to_fit_half_the_fast_ttft_target(engine):
    """With steps that stop between layers, the warm cap (a whole step within half the fast
    TTFT target for a minute after fast traffic) gives way to one layer within it, always."""
    assert engine.scheduler.config.pause_layers == engine.model_config.num_layers
    model = StepTimeModel({"q8": [0.01, 0.001, 0.0005, 0.0, 0.001]})
    fast = SchedulerConfig().tiers["fast"]
    paused = Scheduler(SchedulerConfig(kernel="q8", pause_layers=18), model)
    assert paused.policy.time_target(0.0) == TimeTarget(fast.ttft_target / 2 * 18, 0.97, "fast")
    whole = Scheduler(SchedulerConfig(kernel="q8"), model)
    assert whole.policy.time_target(0.0).lane == "standard"  # cold: no cap
    whole.add(Request("f", [1, 2, 3], SamplingParams(max_tokens=2), tier="fast"))
    whole.policy.time_target(0.0)
    whole.abort("f")
    assert whole.policy.time_target(1.0) == TimeTarget(fast.ttft_target / 2, 0.97, "fast")  # warm


def test_a_fast_request_sent_during_a_long_prefill_gets_its_first_token_before_it(make_engine):
    """Through a real server: a 2,048-token standard prompt prefilled in one step, and a fast
    request sent once that step has begun. The fast request's first token comes before the
    standard one's: the step stopped for it. (How soon is fast_lane.py's to measure.)"""
    engine = make_engine(kernel="q8", enable_prefix_caching=False, max_num_batched_tokens=2048)
    long, short = _prompts(engine, 1, 2048)[0], _prompts(engine, 1, 30)[0]
    assert len(long) == 2048
    for details in running_server(engine, Metrics(MODEL)):
        firsts: list[str] = []

        async def call(client, name: str, prompt: list[int], tier: str) -> None:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True, "service_tier": tier})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text is not None and name not in firsts:
                    firsts.append(name)

        async def main() -> None:
            async with openai.AsyncOpenAI(base_url=details["url"] + "/v1", api_key="unused") as client:
                standard = asyncio.create_task(call(client, "standard", long, "default"))
                while not engine.scheduler.num_running and not standard.done():  # its prefill step is planned
                    await asyncio.sleep(0.005)
                await call(client, "fast", short, "priority")
                await standard

        asyncio.run(main())
        assert firsts == ["fast", "standard"] and engine.steps_paused >= 1
        metrics = httpx.get(details["url"] + "/metrics").text
        assert f'tollway:steps_paused_total{{model_name="{MODEL}"}} {float(engine.steps_paused)}' in metrics


def test_with_pausing_off_a_step_runs_whole_whatever_is_asked(make_engine):
    engine = make_engine(kernel="q8", enable_prefix_caching=False, pause_for_fast=False)
    assert engine.scheduler.config.pause_layers == 0
    engine.add_request(_prompts(engine, 1, 60)[0], PARAMS)
    engine.runner.step_yield.ask()
    report = engine.step()
    assert not report.paused and len(report.outputs) == 1 and engine.runner.paused_step is None and engine.steps_paused == 0
