"""The lanes policy, pure Python and deterministic: a fake step model stands in for the
runner, and a fake clock advances by each step's predicted time."""
import random
import statistics

import pytest

from tollway.config import SchedulerConfig, default_tiers
from tollway.request import QueueFullError, Request, SamplingParams
from tollway.scheduler.plan import SampledToken, StepResult
from tollway.scheduler.scheduler import Scheduler
from tollway.scheduler.step_model import StepShape, StepTimeModel

from coeffs_scale import COEFFS, at_this_scale


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def lanes(clock=None, tiers=None, **overrides) -> Scheduler:
    config = SchedulerConfig(**{"int8_max_tokens": 32, "dense_kernel": "fp32", "num_blocks": 1024, "block_size": 16, **overrides})
    at_this_scale(config.tiers)
    if tiers:
        for name, fields in tiers.items():
            for k, v in fields.items():
                setattr(config.tiers[name], k, v)
    return Scheduler(config, StepTimeModel(COEFFS), clock or Clock())


def request(rid, tier, prompt_len=32, max_tokens=64, arrival=1000.0) -> Request:
    rng = random.Random(rid)  # str hashes change per process; prompts must not
    prompt = [rng.randint(1, 50) for _ in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   tier=tier, arrival_time=arrival)


def run_step(sched: Scheduler):
    """Plan, 'execute' in the predicted time, commit. Returns the plan."""
    plan = sched.plan()
    seconds = plan.predicted_seconds or 0.0
    sched.clock.now += seconds
    tokens = {s.request_id: [SampledToken(7)] for s in plan.seqs if s.sample}
    sched.commit(plan, StepResult(plan.step_id, tokens, seconds))
    return plan


def fast_only_seconds(sched, plan) -> float:
    shape = StepShape("")
    for s in plan.seqs:
        if s.tier == "fast":
            shape = shape.plus(s.start_pos, s.num_new, s.num_logit_rows)
    return sched.step_model.predict(shape, sched.kernel_for(shape))


def with_one_more_decode(sched, plan) -> float:
    shape = StepShape.of(plan).plus(100, 1, 1)
    return sched.fastest(shape)[1]


def test_fast_steps_meet_the_target_and_fill_it():
    sched = lanes()
    target = sched.tiers["fast"].tpot_target
    for i in range(64):
        sched.add(request(f"s{i}", "standard", max_tokens=400))
    for _ in range(20):
        run_step(sched)
    for i in range(3):
        sched.add(request(f"f{i}", "fast", prompt_len=40, max_tokens=30, arrival=sched.clock.now))
    plans = [run_step(sched) for _ in range(40)]
    with_fast = [p for p in plans if any(s.tier == "fast" for s in p.seqs)]
    assert len(with_fast) >= 30
    for p in with_fast:
        assert p.budget_seconds == target
        assert p.predicted_seconds <= target + 1e-12 or fast_only_seconds(sched, p) > target
        # Standard work is waiting to run, so no room is wasted: the step is 90% full, or one
        # more decode would cost a whole row group more than the target leaves.
        assert p.predicted_seconds >= 0.9 * target or with_one_more_decode(sched, p) > target
    # The fast requests finished long before any standard one.
    assert all(sched.get(f"f{i}") is None for i in range(3))
    assert all(sched.get(f"s{i}") is not None for i in range(64))


def test_waiting_fast_is_prefilled_in_the_very_next_step():
    sched = lanes()
    for i in range(40):
        sched.add(request(f"s{i}", "standard", prompt_len=100, max_tokens=200))
    for _ in range(5):
        run_step(sched)
    # No fast request is decoding, so none has a TPOT at stake: the prompt goes in whole, alone
    # (anything added would only delay its first token).
    sched.add(request("f0", "fast", prompt_len=200, max_tokens=50))
    plan = run_step(sched)
    assert [(s.request_id, s.start_pos, s.num_new) for s in plan.seqs] == [("f0", 0, 200)]
    run_step(sched)
    # Now f0 decodes: a second fast prompt, just arrived, goes in chunks that keep f0's steps
    # near the target, but in no more chunks than the steps, as predicted, that fit in its TTFT
    # target: its first token comes in time.
    arrival = sched.clock.now
    sched.add(request("f1", "fast", prompt_len=200, max_tokens=5, arrival=arrival))
    fast = sched.tiers["fast"]
    plan = run_step(sched)
    (f1,) = [s for s in plan.seqs if s.request_id == "f1"]
    assert f1.start_pos == 0 and 16 <= f1.num_new < 200
    assert "f0" in {s.request_id for s in plan.seqs}
    # Within the target, unless f1's share is what takes it past.
    assert plan.predicted_seconds <= fast.tpot_target or {s.request_id for s in plan.seqs} == {"f0", "f1"}
    done, chunks = f1.num_new, 1
    while done < 200:
        plan = run_step(sched)
        done += sum(s.num_new for s in plan.seqs if s.request_id == "f1")
        chunks += 1
    assert 2 <= chunks <= int(fast.ttft_target / fast.tpot_target)
    assert sched.clock.now - arrival <= fast.ttft_target


def test_a_fast_prompt_whose_chunks_would_finish_late_goes_in_whole():
    """Each chunk's step pays the step's fixed cost again: when two steps, as the model
    predicts them, do not fit in the time left before the TTFT target, the prompt goes in whole
    though the TPOT target alone would leave room for several."""
    sched = lanes()
    sched.add(request("f0", "fast", prompt_len=20, max_tokens=50))
    run_step(sched)
    run_step(sched)  # f0 decodes
    fast = sched.tiers["fast"]
    half = StepShape("").plus(220, 1, 1).plus(0, 150, 1)
    two_steps = 2 * sched.fastest(half)[1]
    assert fast.ttft_target / fast.tpot_target >= 3  # the TPOT target alone would allow 3 chunks
    # It arrived long enough ago that two such steps no longer fit, one still does.
    sched.add(request("f1", "fast", prompt_len=300, max_tokens=5,
                      arrival=sched.clock.now - (fast.ttft_target - two_steps * 0.95)))
    plan = run_step(sched)
    assert [(s.start_pos, s.num_new) for s in plan.seqs if s.request_id == "f1"] == [(0, 300)]


def test_a_fast_prompt_that_has_waited_out_its_ttft_target_goes_in_whole():
    sched = lanes()
    sched.add(request("f0", "fast", prompt_len=20, max_tokens=50))
    run_step(sched)
    run_step(sched)  # f0 decodes: fast steps are shaped to its TPOT target
    late = sched.clock.now - sched.tiers["fast"].ttft_target
    sched.add(request("f1", "fast", prompt_len=300, max_tokens=5, arrival=late))
    plan = run_step(sched)
    assert [(s.start_pos, s.num_new) for s in plan.seqs if s.request_id == "f1"] == [(0, 300)]


def test_standard_batch_grows_to_the_largest_that_meets_its_slo():
    sizes = {}
    for slo in (0.2, 0.5, 1.0):
        sched = lanes(tiers={"standard": {"tpot_target": slo}}, max_num_seqs=256, max_num_batched_tokens=4096)
        for i in range(200):
            sched.add(request(f"s{i}", "standard", prompt_len=16, max_tokens=1000))
        for _ in range(60):
            plan = run_step(sched)
            assert plan.predicted_seconds <= slo
        sizes[slo] = sched.num_running
        # One more decode would break the SLO.
        shape = StepShape("")
        for r in sched.running.values():
            shape = shape.plus(r.num_tokens, 1, True)
        shape = shape.plus(16, 1, True)
        assert sched.step_model.predict(shape, sched.kernel_for(shape)) > slo
    assert sizes[0.2] < sizes[0.5] < sizes[1.0]


def test_batch_never_pushes_standard_past_its_slo():
    sched = lanes(tiers={"standard": {"tpot_target": 0.5}})
    last_token = {}
    gaps = []
    for i in range(30):
        sched.add(request(f"s{i}", "standard", max_tokens=50))
    for i in range(100):
        sched.add(request(f"b{i}", "batch", max_tokens=50))
    for _ in range(300):
        plan = run_step(sched)
        assert plan.predicted_seconds is None or plan.predicted_seconds <= 0.5
        for s in plan.seqs:
            if s.tier == "standard" and s.sample:
                if s.request_id in last_token:
                    gaps.append(sched.clock.now - last_token[s.request_id])
                last_token[s.request_id] = sched.clock.now
    assert gaps and max(gaps) <= 0.5 + 1e-9
    assert sum(r.tier == "batch" for r in sched.running.values()) > 0 or not sched.waiting["batch"]


def test_batch_finishes_within_its_window_under_steady_standard_load():
    window = 60.0
    sched = lanes(tiers={"batch": {"window": window}, "standard": {"tpot_target": 0.5}}, max_num_seqs=32)
    sched.add(request("b", "batch", max_tokens=20, arrival=sched.clock.now))
    start = sched.clock.now
    n = 0
    finished_at = None
    while sched.clock.now - start < 3 * window:
        # Keep standard saturating: there is always more standard work than seats.
        while len(sched.waiting["standard"]) < 40:
            sched.add(request(f"s{n}", "standard", max_tokens=30))
            n += 1
        run_step(sched)
        if finished_at is None and sched.get("b") is None:
            finished_at = sched.clock.now
    assert finished_at is not None and finished_at - start <= window
    # It was held back while it could wait: batch does not run early under full standard load.
    assert finished_at - start > window / 4


def test_a_due_batch_request_deep_in_a_long_queue_goes_first():
    """Deadlines are kept in a heap, not found by scanning the queue: the one due request among
    thousands is admitted ahead of standard in the next step, and the rest keep waiting."""
    window = 60.0
    sched = lanes(tiers={"batch": {"window": window, "max_queue": 10_000}, "standard": {"tpot_target": 0.5}},
                  max_num_seqs=32)
    for i in range(5000):
        sched.add(request(f"b{i}", "batch", max_tokens=20, arrival=sched.clock.now))
    sched.add(request("late", "batch", max_tokens=20, arrival=sched.clock.now - window))
    for i in range(40):
        sched.add(request(f"s{i}", "standard", max_tokens=30))
    plan = run_step(sched)
    assert plan.seqs[0].request_id == "late"
    assert {s.tier for s in plan.seqs[1:]} == {"standard"}
    assert len(sched.waiting["batch"]) == 5000


def test_batch_starves_without_aging():
    sched = lanes(tiers={"batch": {"window": None}, "standard": {"tpot_target": 0.5}}, max_num_seqs=32)
    sched.add(request("b", "batch", max_tokens=20))
    n = 0
    for _ in range(400):
        while len(sched.waiting["standard"]) < 40:
            sched.add(request(f"s{n}", "standard", max_tokens=30))
            n += 1
        plan = run_step(sched)
        assert all(s.tier == "standard" for s in plan.seqs)


def test_fast_preempts_batch_then_standard_newest_first_and_is_never_preempted():
    # 8 blocks of 4; fast holds a reservation of 1 block and 1 seat.
    sched = lanes(num_blocks=8, block_size=4, max_num_seqs=4, enable_prefix_caching=False,
                  tiers={"fast": {"reserved_kv_share": 0.125, "reserved_seq_share": 0.25}})
    for rid, tier in (("s0", "standard"), ("b0", "batch"), ("s1", "standard")):
        sched.add(request(rid, tier, prompt_len=7, max_tokens=40))
        run_step(sched)
    assert sched.num_running == 3  # the fourth seat is fast's
    sched.add(request("f0", "fast", prompt_len=8, max_tokens=40))
    plan = run_step(sched)
    assert plan.preempted == ["b0"] and "f0" in {s.request_id for s in plan.seqs}
    sched.add(request("f1", "fast", prompt_len=8, max_tokens=40))
    plan = run_step(sched)
    assert plan.preempted == ["s1"]
    for _ in range(200):
        plan = run_step(sched)
        assert not {"f0", "f1"} & set(plan.preempted)
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished()


def test_reservations_hold_back_seats_and_blocks():
    sched = lanes(num_blocks=40, block_size=4, max_num_seqs=8, enable_prefix_caching=False,
                  tiers={"fast": {"reserved_kv_share": 0.25, "reserved_seq_share": 0.25}})
    for i in range(20):
        sched.add(request(f"s{i}", "standard", prompt_len=10, max_tokens=100))
    seats, blocks = set(), set()
    for _ in range(60):
        run_step(sched)
        seats.add(sched.num_running)
        blocks.add(sched.pool.num_used)
    assert max(seats) == 6 and 26 < max(blocks) <= 30  # both caps were reached, neither passed
    sched.add(request("f", "fast", prompt_len=30, max_tokens=5))
    plan = run_step(sched)
    assert "f" in {s.request_id for s in plan.seqs} and not plan.preempted


def test_queue_bounds_refuse_cleanly():
    sched = lanes(tiers={"fast": {"max_queue": 2}})
    sched.add(request("f0", "fast"))
    sched.add(request("f1", "fast"))
    with pytest.raises(QueueFullError, match="fast queue is full") as refused:
        sched.add(request("f2", "fast"))
    assert refused.value.tier == "fast" and refused.value.retry_after >= 1
    assert sched.get("f2") is None and sched.num_waiting == 2
    sched.add(request("s0", "standard"))  # other lanes are unaffected
    run_step(sched)  # both fast requests are admitted: the queue has room again
    sched.add(request("f2", "fast"))


def test_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown tier 'gold'"):
        lanes().add(request("x", "gold"))


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_load_keeps_every_promise(seed):
    """Fast is never preempted, reserved seats and blocks hold, every request finishes, and
    steps carrying fast meet the target whenever fast work alone fits in it."""
    rng = random.Random(seed)
    sched = lanes(num_blocks=64, block_size=4, max_num_seqs=12, enable_prefix_caching=False,
                  tiers={"fast": {"reserved_kv_share": 0.25, "reserved_seq_share": 0.25, "max_queue": 4},
                         "batch": {"window": 30.0}})
    reserved_kv, reserved_seq = 16, 3
    added = []
    for i in range(400):
        if rng.random() < 0.3:
            tier = rng.choice(["fast", "standard", "standard", "batch"])
            try:
                sched.add(request(f"r{i}", tier, prompt_len=rng.randint(1, 40), max_tokens=rng.randint(1, 30),
                                  arrival=sched.clock.now))
                added.append(f"r{i}")
            except QueueFullError:
                assert tier == "fast"
        plan = run_step(sched)
        assert not [rid for rid in plan.preempted if rid.startswith("r") and sched.get(rid).tier == "fast"]
        non_fast = [r for r in sched.running.values() if r.tier != "fast"]
        assert len(non_fast) <= 12 - reserved_seq
        assert sum(len(sched.pool.table(r.request_id)) for r in non_fast) <= 64 - reserved_kv
        if any(s.tier == "fast" for s in plan.seqs):
            assert plan.predicted_seconds <= sched.tiers["fast"].tpot_target + 1e-12 or \
                fast_only_seconds(sched, plan) > sched.tiers["fast"].tpot_target * 0.5
    for _ in range(5000):
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished()
    assert sched.pool.num_free == sched.pool.num_blocks


def test_default_tiers_are_consistent():
    tiers = default_tiers()
    assert tiers["fast"].priority < tiers["standard"].priority < tiers["batch"].priority
    assert not tiers["fast"].preemptible and tiers["standard"].preemptible
    assert tiers["fast"].price_output_per_m > tiers["standard"].price_output_per_m > tiers["batch"].price_output_per_m
    SchedulerConfig(int8_max_tokens=32).validate()


def test_int8_is_never_chosen_past_the_measured_crossover():
    """The model has only seen int8 steps up to the crossover; past it, however cheap its
    extrapolation says int8 is, the dense kernel runs."""
    cheap_int8 = StepTimeModel({"int8": [0.01, 0.0001, 0.0, 0.0, 0.0], "fp32": [0.5, 0.01, 0.0, 0.0, 0.0]})
    sched = Scheduler(SchedulerConfig(int8_max_tokens=32, dense_kernel="fp32", num_blocks=64), cheap_int8, Clock())
    assert sched.kernel_for(StepShape("").plus(0, 32, 1)) == "int8"
    assert sched.kernel_for(StepShape("").plus(0, 33, 1)) == "fp32"


def test_after_fast_traffic_steps_stay_short_enough_for_a_newcomer():
    """A fast request arriving mid-step waits for that step: by default, while the fast lane
    is warm, no step is planned past half the fast TTFT target, and such steps say the fast
    lane capped them (the meter bills their idle capacity to fast). Without fast traffic, once
    the lane has cooled, or with `warm_for` unset, steps grow back to what standard's SLO allows."""
    def standard_steps(sched, n):
        plans = [run_step(sched) for _ in range(n)]
        return [p.predicted_seconds for p in plans], {p.capped_by for p in plans}

    fast = at_this_scale(default_tiers())["fast"]
    assert fast.ttft_target and fast.warm_for
    idle, warm, unset = lanes(), lanes(), lanes(tiers={"fast": {"warm_for": None}})
    for sched in (idle, warm, unset):
        for i in range(100):
            sched.add(request(f"s{i}", "standard", prompt_len=64, max_tokens=300))
    for sched in (warm, unset):
        sched.add(request("f0", "fast", max_tokens=3, arrival=sched.clock.now))
        while sched.get("f0") is not None:
            run_step(sched)
    cap = fast.ttft_target / 2
    assert max(standard_steps(idle, 30)[0]) > 1.5 * cap  # the SLO alone allows long steps
    assert max(standard_steps(unset, 30)[0]) > 1.5 * cap
    steps, capped_by = standard_steps(warm, 30)
    assert max(steps) <= cap and statistics.median(steps) >= 0.6 * cap  # capped, not starved
    assert capped_by == {"fast"}
    warm.clock.now += fast.warm_for
    steps, capped_by = standard_steps(warm, 30)
    assert max(steps) > 1.5 * cap and "fast" not in capped_by


def test_a_step_that_nothing_fits_still_runs_its_first_sequence():
    """When the time target is shorter than even one sequence's predicted step (a slow machine,
    or a large overrun headroom), the step takes one anyway: an empty plan would repeat forever
    and the lanes below fast would never move."""
    sched = lanes(tiers={"fast": {"ttft_target": 0.02}})  # readiness cap 10 ms: below any step here
    sched.add(request("f0", "fast", max_tokens=2))
    while sched.get("f0") is not None:
        run_step(sched)
    for i in range(3):
        sched.add(request(f"s{i}", "standard", max_tokens=4, arrival=sched.clock.now))
    plans = [run_step(sched) for _ in range(30)]
    assert all(p.seqs for p in plans[:10]) and all(p.capped_by == "fast" for p in plans[:10])
    assert not sched.has_unfinished()
