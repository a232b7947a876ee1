"""The engine end to end on the default model: stops, seeds, prefix cache, streaming, errors."""
from __future__ import annotations

import pytest

from tollway.request import InvalidRequest, SamplingParams


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


def test_max_tokens_finishes_with_length(engine, run_to_completion):
    [out], _ = run_to_completion(engine, ["The capital of France is"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_string_cuts_text_and_finishes(engine, run_to_completion):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    [free], _ = run_to_completion(engine, ["Count: 1, 2, 3,"], greedy)
    word = free.text.strip().split()[1]  # a piece of text the model is known to produce
    cut = free.text.index(word)
    [out], _ = run_to_completion(engine, ["Count: 1, 2, 3,"], SamplingParams(temperature=0, max_tokens=16, stop=[word]))
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert len(out.token_ids) < 16
    # The token that completes the stop string is also the last one max_tokens allows: still "stop".
    [both], _ = run_to_completion(engine, ["Count: 1, 2, 3,"],
                                  SamplingParams(temperature=0, max_tokens=len(out.token_ids), stop=[word]))
    assert both.finish_reason == "stop" and both.text == out.text


def test_stop_token_id_finishes(engine, run_to_completion):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [free], _ = run_to_completion(engine, ["The capital of France is"], greedy)
    target = free.token_ids[3]
    [out], _ = run_to_completion(engine, ["The capital of France is"],
                                 SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[target]))
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(target) + 1]


def test_streamed_deltas_add_up_to_the_text(engine):
    rid = engine.add_request("Write a short poem about the moon.", SamplingParams(temperature=0.8, seed=7, max_tokens=24))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == rid:
                pieces.append(out.new_text)
                final = out
    assert final.finished and "".join(pieces) == final.text
    assert "\ufffd" not in final.text
    assert final.text == engine.tokenizer.decode(final.token_ids)


def test_same_seed_same_text_different_seed_differs(engine, run_to_completion):
    prompts = ["Tell me a story about a dragon."] * 2
    a, _ = run_to_completion(engine, prompts, SamplingParams(temperature=1.0, seed=11, max_tokens=12))
    b, _ = run_to_completion(engine, prompts[:1], SamplingParams(temperature=1.0, seed=12, max_tokens=12))
    assert a[0].token_ids == a[1].token_ids
    assert a[0].token_ids != b[0].token_ids


def test_prefix_cache_skips_shared_prefill(make_engine, run_to_completion):
    engine = make_engine(block_size=16)
    shared = "You are a helpful assistant. " * 12  # ~85 tokens
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    [first], _ = run_to_completion(engine, [shared + "What is 2+2?"], greedy)
    [second], plans = run_to_completion(engine, [shared + "Name a color."], greedy)
    prefill = next(s for p in plans for s in p.seqs)
    assert prefill.start_pos >= 64 and prefill.start_pos % 16 == 0
    assert second.num_cached_prompt_tokens == prefill.start_pos
    assert prefill.num_new == len(second.prompt_token_ids) - prefill.start_pos
    # Reusing cached KV gives exactly what a cold engine computes.
    [cold], _ = run_to_completion(make_engine(enable_prefix_caching=False),
                                  [shared + "Name a color."], greedy)
    assert cold.token_ids == second.token_ids


def test_prompt_longer_than_context_is_refused(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("word " * 100, SamplingParams())


def test_bad_token_ids_are_refused(engine):
    with pytest.raises(InvalidRequest, match="token id 1000000000, past"):
        engine.add_request([1, 2, 10**9], SamplingParams())
    with pytest.raises(InvalidRequest, match="token ids must be integers"):
        engine.add_request([1, 2.5], SamplingParams())


def test_text_a_tokenizer_encodes_past_the_models_vocabulary_is_refused(engine, monkeypatch):
    # A tokenizer with more tokens than the model has rows (an added token past its embedding).
    past = engine.model_config.vocab_size
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, add_special_tokens=True: [2, 10, past])
    with pytest.raises(InvalidRequest, match=f"token id {past}, past this model's {past} tokens"):
        engine.add_request("hello", SamplingParams())
    assert not engine.has_unfinished()


def test_the_default_cpu_kernel_is_q8_and_its_fused_greedy_head_picks_the_logits_argmax(make_engine,
                                                                                        run_to_completion):
    """On a CPU where the native matmul compiles, kernel "auto" runs q8 at every step size, and a
    greedy step's argmax from the LM head's epilogue is the argmax of the logits it skips (asking
    for logprobs makes the runner write them)."""
    from tollway.model.native.qmatmul import q8_library

    if q8_library() is None:
        pytest.skip("the native matmul does not compile here")
    engine = make_engine()
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    fused, plans = run_to_completion(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert {p.kernel for p in plans} == {"q8"} and engine.runner.model.lm_head.native is not None
    logits, _ = run_to_completion(engine, prompts,
                                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0))
    assert [o.token_ids for o in fused] == [o.token_ids for o in logits]


def test_what_the_server_reads_follows_the_requests(engine):
    """The engine's read-only surface (occupancy, lanes, queued work) as requests wait, run
    and finish: the server and the fleet read nothing else."""
    assert engine.max_model_len == engine.config.scheduler.max_model_len
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    fast = engine.add_request([5] * 20, params, tier="fast")
    standard = engine.add_request([6] * 10, params)
    assert engine.tier_of(fast) == "fast" and engine.tier_of(standard) == "standard"
    assert engine.tier_of("no-such-request") is None
    assert engine.outstanding_tokens() == 20 + 3 + 10 + 3
    assert sorted((r.request_id, r.tier) for r in engine.unstarted()) == sorted([(fast, "fast"), (standard, "standard")])
    held = engine.occupancy()
    assert held.waiting["fast"] == held.waiting["standard"] == 1 and held.idle is False
    engine.step()
    assert {r.request_id for r in engine.running()} == {fast, standard} and engine.unstarted() == []
    assert engine.outstanding_tokens() < 20 + 3 + 10 + 3
    while engine.has_unfinished():
        engine.step()
    assert engine.occupancy().idle and engine.outstanding_tokens() == 0 and engine.tier_of(fast) is None


def test_each_output_carries_what_its_step_added_and_the_last_the_whole(engine):
    """Following a request costs what it adds: the new ids and logprobs of every output add up
    to the final output's whole lists, and only the final output carries them."""
    rid = engine.add_request("Count: one, two,", SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True))
    ids, logprobs, counts, final = [], [], [], None
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == rid:
                ids += out.new_token_ids
                logprobs += out.new_logprobs
                counts.append(out.num_output_tokens)
                if not out.finished:
                    assert out.token_ids == [] and out.text == "" and out.logprobs == []
                final = out
    assert final.finished and final.token_ids == ids and len(ids) == 12 and counts == list(range(1, 13))
    assert final.logprobs == logprobs and [e["token_id"] for e in logprobs] == ids


def test_a_model_that_cannot_fit_is_refused_before_anything_is_packed(tiny_gguf, cache_with_shared_native, monkeypatch):
    from tollway import engine as engine_module
    from tollway.config import EngineConfig, SchedulerConfig
    from tollway.engine import Engine
    from tollway.model import runner

    built = []
    monkeypatch.setattr(runner, "LinearBuilder", lambda *a, **k: built.append(a))
    monkeypatch.setattr(engine_module, "available_memory", lambda: 1 << 16)  # 64 KiB free
    config = EngineConfig(model=str(tiny_gguf), cache_dir=str(cache_with_shared_native), scheduler=SchedulerConfig(num_blocks=64))
    with pytest.raises(ValueError, match=r"tiny.*\.gguf: needs 0\.0 GiB .*, 0\.0 GiB available"):
        Engine(config, progress=False)
    assert not built
    monkeypatch.undo()
    Engine(config, progress=False)  # with the machine's own memory it loads
