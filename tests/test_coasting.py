"""Coasting is only a faster way to the same simulation: with plain decodes carried as groups,
every request's times, tokens and bill match planning every sequence in every step, under
tight time targets, KV pressure and preemption, batch windows falling due, several
replicas and a closed loop; and a coaster stopped from outside is brought up to date."""
from __future__ import annotations

import dataclasses
import math

import pytest

from tollway.config import EngineConfig, SchedulerConfig
from tollway.request import Request, SamplingParams
from tollway.scheduler.plan import SampledToken, StepResult
from tollway.scheduler.scheduler import Scheduler
from tollway.sim.coasting import Coasting
from tollway.sim.coasting_groups import CoastingGroups
from tollway.sim.hardware import estimated_profile
from tollway.sim.simulator import Simulator
from tollway.traffic.patterns import Limits, LoadPattern
from tollway.traffic.workload import Lengths, Workload

MIXED = {"fast": 0.2, "standard": 0.6, "batch": 0.2}


@pytest.fixture(scope="module")
def h200():
    # Small steps (about 2 ms for gemma3-270m), so millisecond targets cap them.
    return dataclasses.replace(estimated_profile("H200", "gemma3-270m"), jitter=[0.9, 1.0, 1.05, 1.3])


def _config(policy="lanes", fast=None, standard=None, batch_window=None) -> SchedulerConfig:
    config = EngineConfig().scheduler
    config.policy = policy
    for tier, target in (("fast", fast), ("standard", standard)):
        if target is not None:
            config.tiers[tier].tpot_target = target
    if batch_window is not None:
        config.tiers["batch"].window = batch_window
    return config


def _simulate(config, profile, coast, replicas=1, load=None, mix=MIXED, requests=250):
    work = Workload(Lengths(256, 64, 32, 1024), Lengths(96, 32, 16, 256), True, mix, None, 0)
    sim = Simulator(config, profile, replicas, "tier_aware", seed=0, token_times=10**9, coast=coast)
    stage = sim.run_stage(work, load or LoadPattern("rate", rate=300.0), Limits(requests), progress=False)
    return sim, stage


def _same(a, b) -> bool:
    return a is b if a is None or b is None else math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


SCENARIOS = {
    "lanes, millisecond targets that cap steps": dict(config=dict(fast=0.0019, standard=0.0021), coasted=0.08, requests=150),
    "lanes, KV for a few requests (preemption), 2 replicas": dict(
        config=dict(fast=0.0018), kv_tokens=6000, replicas=2, mix={"fast": 0.3, "standard": 0.4, "batch": 0.3}, coasted=0.6),
    "lanes, batch windows falling due": dict(config=dict(standard=0.0019, batch_window=1.0),
                                            mix={"fast": 0.1, "standard": 0.3, "batch": 0.6}, coasted=0.6),
    "fcfs, KV pressure": dict(config=dict(policy="fcfs"), kv_tokens=5000, load=LoadPattern("rate", rate=500.0), coasted=0.6),
    "lanes, closed loop of 48 users": dict(config=dict(fast=0.002), load=LoadPattern("users", concurrency=48), coasted=0.6),
    # Steps stop between layers for fast arrivals: fast steps run beside the suspended one.
    "lanes, steps paused for fast arrivals": dict(config=dict(fast=0.0025), pause_layers=18, coasted=0.5, requests=800,
                                                 mix={"fast": 0.04, "standard": 0.76, "batch": 0.2},
                                                 load=LoadPattern("rate", rate=80.0)),
    "lanes, paused steps under KV pressure, 2 replicas": dict(
        config=dict(fast=0.0025), kv_tokens=6000, replicas=2, pause_layers=18, coasted=0.4, requests=400,
        mix={"fast": 0.08, "standard": 0.62, "batch": 0.3}, load=LoadPattern("rate", rate=60.0)),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_coasting_gives_the_same_simulation_as_planning_every_sequence(name, h200):
    s = SCENARIOS[name]
    profile = dataclasses.replace(h200, kv_tokens=s.get("kv_tokens", h200.kv_tokens), pause_layers=s.get("pause_layers", 0))
    runs = {coast: _simulate(_config(**s["config"]), profile, coast, s.get("replicas", 1), s.get("load"),
                             s.get("mix", MIXED), s.get("requests", 250)) for coast in (False, True)}
    (plain, plain_stage), (coasting, coast_stage) = runs[False], runs[True]
    assert [x[1:3] for x in plain.steps] == [x[1:3] for x in coasting.steps]  # sequences, tokens per step
    assert plain.coasted == 0 and coasting.coasted > s['coasted'] * sum(x[1] for x in coasting.steps)
    assert plain.steps_paused == coasting.steps_paused and (coasting.steps_paused > 5) == bool(s.get("pause_layers"))
    for a, b in zip(plain_stage.records, coast_stage.records, strict=True):
        assert (a.tier, a.error, a.output_tokens) == (b.tier, b.error, b.output_tokens)
        assert _same(a.first_token, b.first_token) and _same(a.end, b.end)
        assert a.engine_seconds is b.engine_seconds is None or math.isclose(a.engine_seconds, b.engine_seconds, rel_tol=1e-7)
        assert len(a.chunk_times) == len(b.chunk_times) and all(map(_same, a.chunk_times, b.chunk_times))
    assert sum(r.error is not None for r in coast_stage.records) < len(coast_stage.records)


def test_a_coaster_finished_from_outside_has_every_token_it_ran_for():
    config = SchedulerConfig(num_blocks=256, max_num_seqs=8, kernel="fp32")
    stand_ins = iter(range(10_000, 20_000))
    ended = []
    sched = Scheduler(config, groups=CoastingGroups(Coasting(lambda k: [next(stand_ins) for _ in range(k)],
                                                             lambda r, first, last, offset: ended.append((first, last)))))
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    for i in range(3):
        sched.add(Request(f"r{i}", list(range(1, 40)), params))
    for _ in range(12):  # one prefill step, then decodes that coast
        plan = sched.plan()
        tokens = {s.request_id: [SampledToken(7)] for s in plan.seqs if s.sample}
        sched.commit(plan, StepResult(plan.step_id, tokens, 0.01))
    plan = sched.plan()
    assert plan.num_seqs == 3 and plan.coasting and not plan.seqs  # all three coast: none is spelled out
    request = sched.finish("r1", "abort")
    # The prefill's token, then 11 committed decode steps (2..12); the plan in flight has not run.
    assert len(request.output_token_ids) == 12 and request.num_computed_tokens == 39 + 11
    assert ended == [(2, 12)]
