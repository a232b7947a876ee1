"""The meter on the real engine: over a mixed run of all three lanes, the attributed engine
time adds up to the busy time, and under the lanes policy a fast token costs more than a
standard one, while with the lanes off the two cost the same."""
from __future__ import annotations

import dataclasses

import pytest

from tollway.config import default_tiers
from tollway.meter.ledger import Ledger
from tollway.meter.meter import Meter
from tollway.meter.price_card import PriceCard
from tollway.meter.tab import Tab
from tollway.request import SamplingParams, Submission
from tollway.scheduler.occupancy import Occupancy
from tollway.scheduler.plan import ScheduledSeq, StepPlan, StepResult
from tollway.scheduler.step_model import StepTimeModel
from tollway.step_report import StepReport

from coeffs_scale import COEFFS, at_this_scale


def _mixed_run(make_engine, tmp_path, policy: str):
    engine = make_engine(policy=policy, max_num_seqs=24, dense_kernel="fp32", tiers=at_this_scale(default_tiers()))
    # Not refitted from the measured steps: the plans then depend on the model alone, not on
    # how fast this machine happens to run today.
    engine.step_model = engine.scheduler.step_model = StepTimeModel(COEFFS, refit_every=10**9)
    meter = Meter(PriceCard(3.6, default_tiers()), Ledger(tmp_path / f"{policy}.sqlite"))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    tiers, tabs = {}, {}
    lanes = [("standard" if i % 4 else "batch", 1000 + i) for i in range(16)] + [("fast", 2000 + i) for i in range(2)]
    for tier, token in lanes:
        tab = Tab()
        rid = engine.submit(Submission([token] * 24, params), tier, tab=tab)
        tiers[rid], tabs[rid] = tier, tab
    capped = 0
    while engine.has_unfinished():
        report = engine.step()
        plan = report.plan
        capped += plan.capped_by == "fast" and {s.tier for s in plan.seqs} > {"fast"}
        # Billed at the model's time for the step, not the measured one: a loaded machine
        # stretches small steps most (fixed costs), which would blur the premium under test.
        result = dataclasses.replace(report.result, seconds=engine.step_model.predict(plan.shape))
        meter.on_step(dataclasses.replace(report, result=result))
    seconds = {rid: tab.seconds for rid, tab in tabs.items()}
    return meter, seconds, tiers, capped


def _per_token(seconds, tiers, tier):
    return sum(s for rid, s in seconds.items() if tiers[rid] == tier) / sum(t == tier for t in tiers.values())


@pytest.fixture(scope="module")
def lanes_run(make_engine, tmp_path_factory):
    """The lanes run both tests below read: it is the same run for each."""
    return _mixed_run(make_engine, tmp_path_factory.mktemp("meter"), "lanes")


def test_attributed_time_adds_up_to_busy_time_over_a_mixed_run(lanes_run):
    meter, seconds, tiers, capped = lanes_run
    assert capped > 0  # fast requests shaped steps that others rode in
    assert set(tiers.values()) == {"fast", "standard", "batch"}
    # Steps kept short after the last fast request hold readiness for a fast arrival to come.
    assert sum(seconds.values()) + meter.readiness_seconds == pytest.approx(meter.busy_seconds, rel=1e-9)
    assert meter.attributed_seconds + meter.readiness_seconds == pytest.approx(meter.busy_seconds, rel=1e-9)
    assert all(s > 0 for s in seconds.values())


def test_fast_tokens_cost_more_under_lanes_and_the_same_without(make_engine, tmp_path, lanes_run):
    _, seconds, tiers, _ = lanes_run
    # Every request has the same prompt and output length, so per request is per token.
    assert _per_token(seconds, tiers, "fast") > 1.2 * _per_token(seconds, tiers, "standard")
    _, seconds, tiers, capped = _mixed_run(make_engine, tmp_path, "fcfs")
    assert capped == 0
    assert _per_token(seconds, tiers, "fast") == pytest.approx(_per_token(seconds, tiers, "standard"), rel=0.25)


def _report(plan: StepPlan, result: StepResult) -> StepReport:
    """A step's report as the engine gives it to the meter, planned with COEFFS."""
    return StepReport(plan, result, [], Occupancy({}, {}, 0, 1), step_model=StepTimeModel(COEFFS))


def test_readiness_is_charged_to_the_next_fast_request(tmp_path):
    meter = Meter(PriceCard(3.6, default_tiers()), Ledger(tmp_path / "ledger.sqlite"))
    tabs = {"s": Tab(), "f": Tab()}
    greedy = SamplingParams(temperature=0)

    def step(step_id, *seqs, capped_by="fast"):
        seqs = [ScheduledSeq(rid, tier, (1,), 100, (0,), True, greedy, tab=tabs[rid]) for rid, tier in seqs]
        meter.on_step(_report(StepPlan(step_id, seqs, "int8", capped_by=capped_by), StepResult(step_id, {}, 0.1)))

    step(1, ("s", "standard"))  # kept short for a fast lane with no request in it
    held = meter.readiness_seconds
    assert 0.05 < held < 0.1 and meter.attributed_seconds == pytest.approx(0.1 - held)
    step(2, ("s", "standard"), capped_by=None)  # a full step: nothing held back
    assert meter.readiness_seconds == held
    step(3, ("f", "fast"), ("s", "standard"))
    assert meter.readiness_seconds == 0 and meter.attributed_seconds == pytest.approx(0.3)
    fast, standard = tabs["f"].seconds, tabs["s"].seconds
    assert fast > held and fast + standard == pytest.approx(0.3)


def test_a_requests_own_work_is_charged_to_it_alone(tmp_path):
    """A grammar's mask is one request's work (StepResult.own_seconds): that request pays it on
    top of its share of the rest of the step, and the step still adds up."""
    greedy = SamplingParams(temperature=0)
    plain = Meter(PriceCard(3.6, default_tiers()), Ledger(tmp_path / "plain.sqlite"))
    masked = Meter(PriceCard(3.6, default_tiers()), Ledger(tmp_path / "masked.sqlite"))
    seconds = {}
    for meter, result in ((plain, StepResult(1, {}, 0.1)), (masked, StepResult(1, {}, 0.13, {"a": 0.03}))):
        tabs = {"a": Tab(), "b": Tab()}
        seqs = [ScheduledSeq(rid, "standard", (1,), 100, (0,), True, greedy, tab=tabs[rid]) for rid in tabs]
        meter.on_step(_report(StepPlan(1, seqs, "int8"), result))
        seconds[meter] = {rid: tab.seconds for rid, tab in tabs.items()}
    assert seconds[plain]["a"] == pytest.approx(0.05) and seconds[plain]["b"] == pytest.approx(0.05)
    assert seconds[masked]["a"] == pytest.approx(0.08) and seconds[masked]["b"] == pytest.approx(0.05)
    assert masked.attributed_seconds == pytest.approx(masked.busy_seconds)
