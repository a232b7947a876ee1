"""`tollway profile` on the real runner: a grid of timed steps that the simulator can run on."""
from __future__ import annotations

from tollway.model.machine_profiler import Grid, grid_plans, measure
from tollway.scheduler.machine_profile import MachineProfile
from tollway.scheduler.step_model import StepShape
from tollway.sim.engine_run import run_on_engine
from tollway.sim.simulator import simulate
from tollway.traffic.patterns import Limits, LoadPattern
from tollway.traffic.workload import Lengths, Workload

TINY = Grid(decodes=(1, 4), contexts=(32, 96), prefills=(0, 16), repeats=1, jitter_repeats=4)


def test_the_grid_crosses_kernels_decodes_contexts_and_prefills(make_engine):
    sched = make_engine(max_num_seqs=4, num_blocks=64).scheduler.config
    plans = grid_plans(sched, ["fp32", "int8"], TINY)
    assert len(plans) == 2 * 2 * 2 * 2
    shapes = {(p.kernel, p.num_decode, p.num_prefill_tokens, max(s.start_pos for s in p.seqs)) for p in plans}
    assert ("int8", 4, 16, 96) in shapes and ("fp32", 1, 0, 32) in shapes


def test_a_measured_profile_round_trips_and_drives_the_simulator(make_engine, tmp_path):
    engine = make_engine(max_num_seqs=8, num_blocks=128)
    profile = measure(engine, TINY, progress=False)
    assert not profile.estimate and "this machine" in profile.hardware and profile.dense_kernel
    assert all(seconds > 0 for *_, seconds in profile.samples) 
    # Jitter: every timing (one per grid step, 4 of a middle step) against the fitted model.
    assert len(profile.jitter) == len(profile.samples) + 4
    assert 0.5 < sorted(profile.jitter)[len(profile.jitter) // 2] < 2
    assert profile.overhead[0] >= 0 and profile.overhead[1] >= 0
    # The fitted model sees that a step with a prefill chunk costs more than the bare decodes.
    model = profile.step_model(adaptive=False)
    decodes = StepShape("q8").plus(96, 1, 1).plus(96, 1, 1)
    assert model.predict(decodes.plus(0, 16, 1)) > model.predict(decodes)
    profile.save(tmp_path / "p.json")
    loaded = MachineProfile.load(tmp_path / "p.json")
    assert loaded == profile
    workload, load = Workload(Lengths(24), Lengths(6), True, {"standard": 1.0}), LoadPattern("concurrency 4", concurrency=4)
    result = simulate(engine.scheduler.config, loaded, workload, [load], Limits(max_requests=8), progress=False)
    assert result["stages"][0]["summary"]["all"]["completed"] == 8
    # The engine's side of the fidelity check records the same workload the same way, steps too.
    runner_seconds = []
    measured = run_on_engine(engine, workload, load, Limits(max_requests=8), progress=False,
                             on_step=lambda report: runner_seconds.append(report.result.seconds))
    assert [(r.prompt_tokens, r.output_tokens, len(r.chunk_times)) for r in measured.records] == [(24, 6, 6)] * 8
    assert len(runner_seconds) == sum(p["steps"] for p in measured.steps) and min(runner_seconds) > 0
    for steps in (measured.steps, result["stages"][0]["steps"]):
        assert steps and all(p["seqs_per_step"] >= 1 and p["seconds_per_step"] > 0 for p in steps)
        # every prompt and output token went through some step (the last output is sampled, not fed)
        assert sum(p["steps"] * p["tokens_per_step"] for p in steps) >= 8 * (24 + 5)


def test_a_gpu_profile_is_named_by_the_gpu(monkeypatch):
    import torch

    from tollway.model.measured import device_name

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert device_name() == "NVIDIA H200"


def test_a_fixed_kernel_profile_tells_the_simulator_that_kernel(make_engine):
    from tollway.model.machine_profiler import kernel_choice

    assert kernel_choice(make_engine(kernel="bf16", max_num_seqs=4, num_blocks=64).scheduler.config) == (0, "bf16")
    sched = make_engine(kernel="int8", max_num_seqs=4, num_blocks=64).scheduler.config
    assert kernel_choice(sched) == (sched.max_num_batched_tokens, sched.dense_kernel)


def test_a_steps_first_cold_run_is_not_timed(make_engine, monkeypatch):
    """A new shape's first run touches memory for the first time (KV, scratch) and can take 10x a
    warm one: it is run once untimed, so neither the samples nor the jitter the simulator draws
    carry it."""
    engine = make_engine(max_num_seqs=8, num_blocks=128)
    runner, seen, execute = engine.runner, set(), engine.runner.execute

    def cold_first(plan, pausable=False):
        result = execute(plan, pausable)
        if id(plan) not in seen:  # a plan's first run: as slow as a cold one at its worst
            seen.add(id(plan))
            result.seconds *= 10
        return result

    monkeypatch.setattr(runner, "execute", cold_first)
    profile = measure(engine, TINY, progress=False)
    # Timed cold, every sample would be 10x and the middle step's warm repeats 0.1x the fit.
    assert 0.2 < min(profile.jitter) and max(profile.jitter) < 5
