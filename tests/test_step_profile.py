"""The runner profile that seeds the step-time model, and the model it gives on the real engine."""
from __future__ import annotations

import json

from tollway.config import EngineConfig, SchedulerConfig
from tollway.engine import Engine
from tollway.model.native.qmatmul import q8_library
from tollway.model.step_profile import profile_key, profile_plans, samples_from_json, samples_to_json
from tollway.request import SamplingParams
from tollway.scheduler.step_model import StepShape


def test_profile_spans_decode_batches_and_prefill_chunks_within_the_limits():
    sched = SchedulerConfig(int8_max_tokens=32, dense_kernel="fp32", max_num_seqs=64, max_num_batched_tokens=512)
    plans = profile_plans(sched)
    decode_sizes = sorted({len(p.seqs) for p in plans if all(s.is_decode for s in p.seqs)})
    assert decode_sizes == [1, 2, 4, 8, 16, 32, 64]
    chunks = {(p.seqs[0].start_pos, p.seqs[0].num_new) for p in plans if not p.seqs[0].is_decode}
    assert {n for _, n in chunks} >= {16, 128} and any(start > 0 for start, _ in chunks)
    # Both kernels of kernel="auto" are profiled: int8 up to 32 tokens, fp32 above.
    assert {p.kernel for p in plans} == {"int8", "fp32"}
    # The budget's whole chunk only where it runs a kernel that no smaller chunk does; else a
    # quarter of the context (512).
    assert max(n for _, n in chunks) == 128
    crossing = SchedulerConfig(int8_max_tokens=256, dense_kernel="fp32", max_num_seqs=64, max_num_batched_tokens=512)
    assert (0, 512) in {(p.seqs[0].start_pos, p.seqs[0].num_new) for p in profile_plans(crossing) if not p.seqs[0].is_decode}
    for p in plans:
        assert p.num_tokens <= 512 and len(p.seqs) <= 64
        for s in p.seqs:  # every position read or written lies inside the shared table
            assert s.context_len <= len(s.block_table) * sched.block_size


def test_profile_respects_a_small_pool_and_context():
    sched = SchedulerConfig(kernel="int8", num_blocks=8, block_size=16, max_model_len=100, max_num_seqs=4,
                            max_num_batched_tokens=64)
    for p in profile_plans(sched):
        assert all(s.context_len <= min(100, 8 * 16) and max(s.block_table) < 8 for s in p.seqs)
        assert p.num_tokens <= 64 and len(p.seqs) <= 4
    assert profile_key(sched) != profile_key(SchedulerConfig(kernel="int8"))


def test_samples_survive_json():
    samples = [(StepShape("int8", 3, 2, 1.5, 1), 0.25), (StepShape("fp32", 64, 64, 9.0, 0), 1.0)]
    assert samples_from_json(samples_to_json(samples)) == samples


def test_engine_step_model_comes_from_the_runner_and_learns_online(default_weights, run_to_completion, cache_with_shared_native):
    # The default CPU kernel: torch's int8 kernel swings 2-3x with machine load, too much to
    # tell a wrong model from a busy machine. A fresh cache: a profile remembered from an
    # earlier run timed that run's machine load, not this one's.
    config = EngineConfig(scheduler=SchedulerConfig(kernel="q8", max_num_seqs=8, max_num_batched_tokens=64),
                          profile_steps=True, cache_dir=str(cache_with_shared_native))
    engine = Engine(config, progress=False, loaded=default_weights)
    model = engine.step_model
    assert model is engine.scheduler.step_model
    # Remembered under the native build and KV cache dtype that were timed: a rebuilt kernel, or
    # a cache that reads twice the bytes, gets profiled afresh.
    remembered = json.loads((cache_with_shared_native / "step-profile.json").read_text())
    build = engine.runner.model.ops.build
    assert remembered and all(build in key and "|torch.float16|" in key for key in remembered)
    assert q8_library() is None or ("row_ops-" in build and "qmatmul-" in build and build.endswith(q8_library().isa))
    coeffs = model.coefficients["q8"]
    # Nothing negative. The fixed cost may fit to 0: rows count in whole row groups, so even a
    # one-token step is charged a group, which already carries it.
    assert all(c >= 0 for c in coeffs) and coeffs[0] + coeffs[1] + coeffs[2] > 0
    one, eight = (model.predict(StepShape("q8").plus(100, 1, 1)),
                  model.predict(StepShape("q8", 8, 8, 0.8)))
    assert 0 < one < eight
    prompts = [[1000 + i, 2000 + i, 3000 + i] * 10 for i in range(6)]
    run_to_completion(engine, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    error = model.error
    assert error.count >= 12  # every step was scored against its prediction
    assert error.mean_rel < 0.6  # loose: CI machines are noisy, but a wrong model is off by multiples
