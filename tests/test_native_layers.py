"""All decoder layers in one native call give the same bits as running them layer by layer, on
every architecture tollway runs, on one thread or several: tokens, logprobs and KV caches."""
from __future__ import annotations

import gc
import shutil
import weakref

import pytest
import torch

from tollway.config import SchedulerConfig
from tollway.model.runner import ModelRunner, kv_dtype_for
from tollway.model.weights import load_weights
from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq, StepPlan

pytestmark = pytest.mark.skipif(not shutil.which("cc") and not shutil.which("gcc"), reason="no C compiler")


def _steps(vocab: int, params: SamplingParams):
    """Four steps: two prefills; two decodes beside a 120-token prefill, long enough that the
    row-wise work and attention are split over the threads; two decodes beside the first chunk
    of a prefill, which samples nothing; and the rest of that prefill. The fused call runs its
    last layer past K and V only for the rows that sample, so the caches must come out the same."""
    g = torch.Generator().manual_seed(7)
    ids = {r: torch.randint(0, vocab, (n,), generator=g).tolist() for r, n in (("a", 9), ("b", 20), ("c", 120),
                                                                               ("d", 40))}
    tables = {"a": tuple(range(0, 8)), "b": tuple(range(8, 16)), "c": tuple(range(16, 48)), "d": tuple(range(48, 60))}
    first = [ScheduledSeq(r, "standard", tuple(ids[r]), 0, tables[r], True, params) for r in ("a", "b")]
    second = [ScheduledSeq(r, "standard", (ids[r][-1],), len(ids[r]), tables[r], True, params) for r in ("a", "b")]
    second.append(ScheduledSeq("c", "standard", tuple(ids["c"]), 0, tables["c"], True, params))
    third = [ScheduledSeq(r, "standard", (ids[r][0],), len(ids[r]) + 1, tables[r], True, params) for r in ("a", "b")]
    third.append(ScheduledSeq("d", "standard", tuple(ids["d"][:30]), 0, tables["d"], False, params))
    fourth = [ScheduledSeq("d", "standard", tuple(ids["d"][30:]), 30, tables["d"], True, params)]
    return [StepPlan(i, seqs, "q8") for i, seqs in enumerate((first, second, third, fourth))]


def _run(loaded, cache, fused: str, threads: int, kv_cache_dtype: str, logprobs: int | None = 5):
    """Each step's tokens with their logprobs, and the KV caches after the last step. `fused`:
    "no" (layer by layer), "layers" (decoder_layers, then the head from Python) or "greedy"
    (decoder_greedy: the embedding, the layers and the head's argmax in one call; no logprobs)."""
    runner = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=64),
                         torch.device("cpu"), {"q8"}, cache_dir=str(cache), kv_cache_dtype=kv_cache_dtype)
    assert runner.caches[0].k.dtype == {"float32": torch.float32, "float16": torch.float16}[kv_cache_dtype]
    ops, ran = runner.model.ops, []
    fused_run, greedy_step = ops.run_layers, ops.greedy_step

    def run_layers(*args):
        if fused != "layers":
            return None
        done = fused_run(*args)
        ran.append(done is not None)
        return done

    def greedy(*args):
        if fused != "greedy":
            return None
        tokens = greedy_step(*args)
        ran.append(tokens is not None)
        return tokens

    ops.run_layers, ops.greedy_step = run_layers, greedy
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        params = SamplingParams(temperature=0, logprobs=logprobs)
        steps = _steps(loaded.config.vocab_size, params)
        results = [runner.execute(plan).tokens for plan in steps]
    finally:
        torch.set_num_threads(before)
    assert ran == ([] if fused == "no" else [True] * len(steps))  # the fused path really ran (or really did not)
    assert [sorted(step) for step in results] == [["a", "b"], ["a", "b", "c"], ["a", "b"], ["d"]]
    tokens = [{r: [(t.token_id, t.logprob, t.top_logprobs) for t in toks] for r, toks in step.items()}
              for step in results]
    return tokens, [(c.k.clone(), c.v.clone()) for c in runner.caches]


def _same(a, b) -> bool:
    tokens_a, caches_a = a
    tokens_b, caches_b = b
    return tokens_a == tokens_b and all(torch.equal(x, y) for pair_a, pair_b in zip(caches_a, caches_b)
                                        for x, y in zip(pair_a, pair_b))


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3"])
def test_one_call_for_all_layers_equals_layer_by_layer(tiny_hf_models, native_cache, name, kv_cache_dtype):
    loaded = load_weights(str(tiny_hf_models[name]))
    want = _run(loaded, native_cache, "no", 2, kv_cache_dtype)
    assert _same(_run(loaded, native_cache, "layers", 2, kv_cache_dtype), want)
    assert _same(_run(loaded, native_cache, "layers", 1, kv_cache_dtype), want)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma3"])
def test_a_greedy_step_in_one_call_equals_the_layers_and_the_head_called_apart(tiny_hf_models, native_cache, name,
                                                                                kv_cache_dtype):
    """decoder_greedy (embedding rows, every layer, the final norm and the head's argmax in one
    call) gives the tokens and caches of the same operations called one by one from Python."""
    loaded = load_weights(str(tiny_hf_models[name]))
    want = _run(loaded, native_cache, "no", 2, kv_cache_dtype, logprobs=None)  # the head's argmax from Python
    assert _same(_run(loaded, native_cache, "greedy", 2, kv_cache_dtype, logprobs=None), want)
    assert _same(_run(loaded, native_cache, "greedy", 1, kv_cache_dtype, logprobs=None), want)


def test_a_model_is_freed_by_its_last_reference_after_a_greedy_step(tiny_hf_models, native_cache):
    """The engine freezes the collector's generations once loaded (gc.freeze), so a reference cycle
    through a model would keep its weights for good (the fused call's ends once held the model from
    its own ops: a gigabyte per engine of the default model): no cycle may hold it."""
    loaded = load_weights(str(tiny_hf_models["gemma3"]))
    runner = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=64),
                         torch.device("cpu"), {"q8"}, cache_dir=str(native_cache))
    seq = ScheduledSeq("a", "standard", (1, 2, 3), 0, (0,), True, SamplingParams(temperature=0))
    greedy_step, ran = runner.model.ops.greedy_step, []
    runner.model.ops.greedy_step = lambda *args: ran.append(greedy_step(*args)) or ran[-1]
    assert len(runner.execute(StepPlan(0, [seq], "q8")).tokens["a"]) == 1
    assert ran and ran[0] is not None  # the fused call ran
    del runner.model.ops.greedy_step
    model = weakref.ref(runner.model)
    gc.disable()
    try:
        del runner
        assert model() is None
    finally:
        gc.enable()


def test_a_kernel_without_native_weights_runs_layer_by_layer(tiny_hf_models, native_cache):
    loaded = load_weights(str(tiny_hf_models["llama"]))
    runner = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=64),
                         torch.device("cpu"), {"fp32"}, cache_dir=str(native_cache))
    seq = ScheduledSeq("a", "standard", (1, 2, 3), 0, (0,), True, SamplingParams(temperature=0))
    calls = []
    fused_run = runner.model.ops.run_layers
    runner.model.ops.run_layers = lambda *args: calls.append(fused_run(*args)) or calls[-1]
    assert len(runner.execute(StepPlan(0, [seq], "fp32")).tokens["a"]) == 1
    assert calls == [None]  # not run natively: the layers ran one by one


def test_an_unknown_kv_cache_dtype_is_refused(tiny_hf_models):
    loaded = load_weights(str(tiny_hf_models["llama"]))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16"):
        ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=64),
                    torch.device("cpu"), {"q8"}, kv_cache_dtype="fp8")


def test_the_auto_kv_cache_is_float16_on_the_cpu_but_float32_beside_the_pinned_fp32_kernel():
    cpu = torch.device("cpu")
    assert kv_dtype_for(cpu, "auto", {"q8"}) == torch.float16
    assert kv_dtype_for(cpu, "auto", {"int8", "q8"}) == torch.float16
    assert kv_dtype_for(cpu, "auto", {"fp32"}) == torch.float32  # it then matches transformers exactly
    assert kv_dtype_for(torch.device("cuda"), "auto", {"bf16"}) == torch.bfloat16
    assert kv_dtype_for(cpu, "float32", {"q8"}) == torch.float32


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_rotary_tables_grown_mid_run_give_the_bits_of_whole_ones(tiny_hf_models, native_cache, name, monkeypatch):
    """Tables that start at 8 positions and double as the steps reach further (Rotary.cover) give
    the tokens and caches of tables made whole at the start, in the fused calls too (their layer
    descriptors, which point at the tables, are made anew)."""
    from tollway.model.layers import Rotary

    loaded = load_weights(str(tiny_hf_models[name]))
    whole = _run(loaded, native_cache, "layers", 2, "float32")
    monkeypatch.setattr(Rotary, "INITIAL_POSITIONS", 8)
    assert _same(_run(loaded, native_cache, "layers", 2, "float32"), whole)
    assert _same(_run(loaded, native_cache, "no", 2, "float32"), whole)

    rotary = Rotary(16, 10000.0, 256, None, torch.device("cpu"))
    assert len(rotary.cos) == 8
    rotary.cover(9)
    assert len(rotary.cos) == 16  # doubled
    rotary.cover(200)
    made_whole = Rotary(16, 10000.0, 256, None, torch.device("cpu"))
    made_whole.cover(256)
    assert torch.equal(rotary.cos, made_whole.cos[:200]) and torch.equal(rotary.sin, made_whole.sin[:200])
    with pytest.raises(ValueError, match="past the model's 256 positions"):
        rotary.cover(257)


def _run_paused(loaded, cache, kv_cache_dtype: str, logprobs: int | None):
    """_run's steps, each asked to stop after every layer and run on, with a step of another
    request run while the second step is paused: each step's tokens, the caches after the last,
    and that other request's tokens."""
    runner = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=64),
                         torch.device("cpu"), {"q8"}, cache_dir=str(cache), kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, logprobs=logprobs)
    steps, layers = _steps(loaded.config.vocab_size, params), loaded.config.num_layers
    beside = StepPlan(99, [ScheduledSeq("e", "fast", tuple(range(3, 14)), 0, (60, 61, 62), True, params)], "q8")
    results, pauses, other = [], 0, None
    runner.step_yield.ask()
    for plan in steps:
        result = runner.execute(plan, pausable=True)
        while result is None:
            pauses += 1
            if plan.step_id == 1 and other is None:  # the fast step between: it must leave the paused one be
                assert runner.execute(beside) is not None
                other = runner.execute(beside).tokens["e"]  # and once more, from its scratch's reused buffer
            result = runner.resume()
        results.append(result.tokens)
    assert pauses == len(steps) * (layers - 1) and runner.paused_step is None
    tokens = [{r: [(t.token_id, t.logprob, t.top_logprobs) for t in toks] for r, toks in step.items()}
              for step in results]
    return (tokens, [(c.k.clone(), c.v.clone()) for c in runner.caches]), other


@pytest.mark.parametrize("logprobs", [None, 5])  # decoder_greedy's path, and the layers' then the head's
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_a_step_stopped_between_layers_and_run_on_gives_the_same_bits(tiny_hf_models, native_cache, name, logprobs):
    """A step asked to stop (a fast request arrived) stops after the layer it is in, and run on
    from there computes what it would have whole: the same tokens and logprobs, the same KV
    caches, even with another step run between (the greedy path's rows live in a scratch buffer
    the next step reuses). The step between gets its own tokens, as alone."""
    loaded = load_weights(str(tiny_hf_models[name]))
    want = _run(loaded, native_cache, "layers" if logprobs else "greedy", 2, "float16", logprobs=logprobs)
    got, other = _run_paused(loaded, native_cache, "float16", logprobs)
    ours = 60 * 4  # the slots of _steps' blocks: the step between wrote its own past them
    assert _same((got[0], [(k[:ours], v[:ours]) for k, v in got[1]]), (want[0], [(k[:ours], v[:ours]) for k, v in want[1]]))
    alone = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=64),
                        torch.device("cpu"), {"q8"}, cache_dir=str(native_cache), kv_cache_dtype="float16")
    params = SamplingParams(temperature=0, logprobs=logprobs)
    seq = ScheduledSeq("e", "fast", tuple(range(3, 14)), 0, (60, 61, 62), True, params)
    assert alone.execute(StepPlan(0, [seq], "q8")).tokens["e"] == other


def test_a_step_that_may_not_pause_runs_whole_whatever_is_asked(tiny_hf_models, native_cache):
    loaded = load_weights(str(tiny_hf_models["llama"]))
    runner = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=64),
                         torch.device("cpu"), {"q8"}, cache_dir=str(native_cache))
    seq = ScheduledSeq("a", "standard", (1, 2, 3), 0, (0,), True, SamplingParams(temperature=0))
    runner.step_yield.ask()
    assert runner.execute(StepPlan(0, [seq], "q8")) is not None and runner.paused_step is None
    with pytest.raises(RuntimeError, match="no step is paused"):
        runner.resume()
