"""Splitting a step's cost over its sequences: conserved, proportional, and fast pays for the
capacity its cap left idle."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tollway.meter.attribution import READINESS, attribute
from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq, StepPlan

COEFFS = [0.04, 0.003, 0.01, 0.00002, 0.004]  # fixed, tokens, LM-head rows, attention, chunks
GREEDY = SamplingParams(temperature=0)


def decode(rid: str, tier: str, context: int = 100) -> ScheduledSeq:
    return ScheduledSeq(rid, tier, (1,), context, (0,), True, GREEDY)


def prefill(rid: str, tier: str, n: int) -> ScheduledSeq:
    return ScheduledSeq(rid, tier, (1,) * n, 0, (0,), False, GREEDY)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fast", "standard", "batch"]), st.integers(1, 64), st.integers(0, 500)),
                min_size=1, max_size=20),
       st.floats(0.001, 5.0), st.booleans())
def test_costs_add_up_to_the_step(seqs, seconds, capped):
    plan = StepPlan(1, [ScheduledSeq(f"r{i}", tier, (1,) * n, start, (0,), True, GREEDY)
                        for i, (tier, n, start) in enumerate(seqs)], "int8", budget_seconds=0.12, capped_by="fast" if capped else None)
    costs = attribute(plan, seconds, COEFFS, price_per_second=0.5)
    ids = {s.request_id for s in plan.seqs}
    assert set(costs) == ids or (capped and not any(s.tier == "fast" for s in plan.seqs)
                                 and set(costs) == ids | {READINESS})
    assert sum(costs.values()) == pytest.approx(seconds * 0.5, rel=1e-12)
    assert all(c >= 0 for c in costs.values())


def test_uncapped_steps_split_by_marginal_work():
    plan = StepPlan(1, [decode("a", "standard"), decode("b", "standard"), prefill("c", "standard", 32)], "int8")
    costs = attribute(plan, 1.0, COEFFS, 1.0)
    assert costs["a"] == pytest.approx(costs["b"])  # the same work pays the same
    assert costs["c"] > 5 * costs["a"]  # 32 tokens of prefill against one decode


def test_a_fast_capped_step_charges_its_idle_capacity_to_fast():
    seqs = [decode("f", "fast"), decode("s1", "standard"), decode("s2", "standard")]
    capped = attribute(StepPlan(1, seqs, "int8", budget_seconds=0.12, capped_by="fast"), 0.1, COEFFS, 1.0)
    even = attribute(StepPlan(1, seqs, "int8", budget_seconds=0.12), 0.1, COEFFS, 1.0)  # the cap left nothing out
    # Same work per sequence; the cap moves the fixed cost onto the fast request.
    assert even["f"] == pytest.approx(even["s1"])
    assert capped["f"] > 2 * capped["s1"] and capped["s1"] == pytest.approx(capped["s2"])
    assert capped["s1"] < even["s1"]
    assert sum(capped.values()) == pytest.approx(0.1)


def test_a_step_kept_short_for_the_fast_lane_returns_its_idle_capacity_as_readiness():
    seqs = [decode("s1", "standard"), decode("s2", "batch")]
    capped = attribute(StepPlan(1, seqs, "int8", budget_seconds=0.4, capped_by="fast"), 0.1, COEFFS, 1.0)
    even = attribute(StepPlan(1, seqs, "int8", budget_seconds=0.4, capped_by="standard"), 0.1, COEFFS, 1.0)
    assert set(even) == {"s1", "s2"} and capped["s1"] < even["s1"]
    assert capped[READINESS] > capped["s1"] + capped["s2"]  # the fixed cost, no one in the step to pay it
    assert sum(capped.values()) == pytest.approx(0.1)


def test_a_step_of_fast_requests_alone_splits_among_them():
    costs = attribute(StepPlan(1, [decode("f1", "fast"), decode("f2", "fast", 300)], "int8", budget_seconds=0.12,
                               capped_by="fast"), 0.08, COEFFS, 1.0)
    assert sum(costs.values()) == pytest.approx(0.08) and costs["f2"] > costs["f1"]  # more context, more work


def test_empty_step_and_workless_model():
    assert attribute(StepPlan(1, [], "int8"), 0.1, COEFFS, 1.0) == {}
    costs = attribute(StepPlan(1, [decode("a", "standard"), decode("b", "batch")], "int8"), 0.2, [0.1, 0, 0, 0, 0], 1.0)
    assert costs == {"a": pytest.approx(0.1), "b": pytest.approx(0.1)}
