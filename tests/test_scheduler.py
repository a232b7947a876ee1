"""Scheduler: admission, chunked prefill, prefix hits, preemption, finishing; plus a random
workload over a tiny pool with the KV cache simulated slot by slot."""
import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tollway.config import POLICIES, SchedulerConfig
from tollway.request import InvalidRequest, Request, RequestState, SamplingParams, Submission
from block_checks import assert_ref_counts
from tollway.scheduler.plan import SampledToken, StepResult
from tollway.scheduler.scheduler import Scheduler
from tollway.scheduler.step_model import StepTimeModel

EOS = 0


def make(**overrides) -> Scheduler:
    return Scheduler(SchedulerConfig(**{"int8_max_tokens": 4, "dense_kernel": "fp32", **overrides}))


def req(rid, prompt, max_tokens=16, tier="standard", **params) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), tier=tier, eos_token_ids=(EOS,))


def token_for(rid: str, index: int) -> int:
    """The fake model's output: a pure function of position, never EOS, so a token appended twice
    or lost in a preemption changes the output."""
    return 1000 + 37 * index + len(rid)


def step(sched: Scheduler, tokens=None):
    """plan + commit, sampling token_for (or tokens[rid]) for each sampled sequence."""
    plan = sched.plan()
    sampled = {}
    for s in plan.seqs:
        if s.sample:
            index = len(sched.get(s.request_id).output_token_ids)
            sampled[s.request_id] = [SampledToken((tokens or {}).get(s.request_id, token_for(s.request_id, index)))]
    changed = sched.commit(plan, StepResult(plan.step_id, sampled, 0.01))
    return plan, changed


def check_blocks(pool, owners) -> None:
    """Through the public API: each ref count equals the number of `owners`' tables holding the
    block, and every block not held is free (a leak makes num_free too small, a double free too
    large)."""
    holders = assert_ref_counts(pool, owners)
    assert pool.num_free == pool.num_blocks - len(holders)
    assert pool.num_evictable <= min(pool.num_free, pool.num_cached_blocks)


def run_to_end(sched: Scheduler, max_steps=1000) -> list:
    plans = []
    while sched.has_unfinished():
        assert len(plans) < max_steps, "no progress"
        plans.append(step(sched)[0])
    return plans


# ---- add() --------------------------------------------------------------------------------

def test_a_submission_is_checked_once_at_the_edge_with_clear_messages():
    with pytest.raises(InvalidRequest, match="^prompt is empty$"):
        Submission.check([], SamplingParams(), 100, 10)
    with pytest.raises(InvalidRequest, match="^prompt is 10 tokens, but the context is 10$"):
        Submission.check(list(range(10)), SamplingParams(), 100, 10)
    with pytest.raises(InvalidRequest, match="^the prompt has token id 100, past this model's 100 tokens$"):
        Submission.check([1, 100], SamplingParams(), 100, 10)
    with pytest.raises(InvalidRequest, match=r"integers in \[0, 100\)"):
        Submission.check([1, -1], SamplingParams(), 100, 10)
    with pytest.raises(InvalidRequest, match="max_tokens") as refused:
        Submission.check([1], SamplingParams(max_tokens=0), 100, 10)
    assert refused.value.param == "max_tokens"
    assert Submission.check(list(range(9)), SamplingParams(), 100, 10).prompt_token_ids == list(range(9))


def test_add_refuses_what_only_the_scheduler_knows():
    sched = make(max_model_len=10, block_size=4, num_blocks=64)
    sched.add(req("a", range(9)))
    with pytest.raises(ValueError, match="'a' is already in use"):
        sched.add(req("a", [1]))
    assert sched.num_waiting == 1


def test_add_rejects_prompt_the_pool_can_never_hold():
    sched = make(block_size=4, num_blocks=2, max_model_len=100)
    with pytest.raises(ValueError, match="prompt is 9 tokens, but the KV cache holds only 8"):
        sched.add(req("a", range(9)))
    # 8 prompt tokens fit, and the one token sampled from them needs no KV: then "length".
    sched.add(req("b", range(8), max_tokens=5))
    run_to_end(sched)
    assert sched.get("b") is None


def test_pool_bounds_length_like_max_model_len():
    sched = make(block_size=4, num_blocks=2, max_model_len=100)
    r = req("b", range(6), max_tokens=50)
    sched.add(r)
    run_to_end(sched)
    assert r.finish_reason == "length" and r.num_tokens == 9


def test_finished_id_can_be_reused():
    sched = make()
    sched.add(req("a", [1, 2], max_tokens=1))
    run_to_end(sched)
    sched.add(req("a", [1, 2], max_tokens=1))
    assert sched.num_waiting == 1


# ---- the plan -----------------------------------------------------------------------------

def test_first_plan_prefills_whole_prompt_and_samples():
    sched = make(kernel="auto", int8_max_tokens=4, dense_kernel="bf16")
    r = req("a", [5, 6, 7], max_tokens=3)
    sched.add(r)
    plan, changed = step(sched)
    (s,) = plan.seqs
    assert (s.token_ids, s.start_pos, s.sample, s.params) == ((5, 6, 7), 0, True, r.params)
    assert s.block_table == sched.pool.table("a") and len(s.block_table) == 1
    assert plan.kernel == "int8" and plan.step_id == 1
    assert changed == [(r, [token_for("a", 0)])] and r.output_token_ids == [token_for("a", 0)]
    assert r.first_scheduled_time is not None and r.first_token_time >= r.first_scheduled_time
    plan, _ = step(sched)
    assert plan.seqs[0].token_ids == (token_for("a", 0),) and plan.seqs[0].is_decode
    assert plan.step_id == 2
    run_to_end(sched)
    assert r.output_token_ids == [token_for("a", i) for i in range(3)]
    assert r.finish_reason == "length" and r.finished_time is not None


def test_auto_kernel_needs_a_measured_crossover():
    with pytest.raises(ValueError, match="int8_max_tokens"):
        Scheduler(SchedulerConfig(kernel="auto", int8_max_tokens=None))
    assert make(kernel="bf16", int8_max_tokens=None).plan().kernel == "bf16"


def test_empty_plan_when_idle():
    sched = make()
    plan = sched.plan()
    assert plan.seqs == [] and plan.num_tokens == 0
    assert sched.commit(plan, StepResult(plan.step_id, {}, 0.0)) == []


def test_big_steps_use_dense_kernel():
    sched = make(kernel="auto", int8_max_tokens=4, dense_kernel="bf16")
    sched.add(req("a", range(10)))
    assert sched.plan().kernel == "bf16"


def test_prefix_cache_hit_skips_shared_blocks():
    sched = make(block_size=16, num_blocks=64)
    shared = list(range(100, 148))  # three full blocks
    a = req("a", shared + [1, 2, 3], max_tokens=4)
    sched.add(a)
    step(sched)  # a's prompt is now computed and its full blocks cached
    b = req("b", shared + [9, 9], max_tokens=2)
    sched.add(b)
    plan, _ = step(sched)
    seq = {s.request_id: s for s in plan.seqs}["b"]
    assert seq.start_pos == 48 and seq.token_ids == (9, 9) and seq.sample
    assert b.num_cached_prompt_tokens == 48
    assert seq.block_table[:3] == sched.pool.table("a")[:3]
    assert [sched.pool.ref_count(x) for x in seq.block_table[:3]] == [2, 2, 2]
    run_to_end(sched)
    # Finished requests leave their full blocks cached: a third one hits them with nothing running.
    c = req("c", shared + [4], max_tokens=1)
    sched.add(c)
    plan, _ = step(sched)
    assert plan.seqs[0].start_pos == 48 and c.num_cached_prompt_tokens == 48


def test_fully_cached_prompt_still_computes_one_token():
    sched = make(block_size=16, num_blocks=64)
    prompt = list(range(49))  # three full blocks and one token
    sched.add(req("a", prompt, max_tokens=1))
    run_to_end(sched)
    b = req("b", prompt, max_tokens=1)
    sched.add(b)
    plan, _ = step(sched)
    (s,) = plan.seqs
    assert (s.start_pos, s.token_ids, s.sample) == (48, (48,), True)
    assert b.output_token_ids == [token_for("b", 0)]


def test_block_aligned_cached_prompt_recomputes_last_block():
    # The last token's KV must be written, and it lies in the last block: rather than write
    # into a block other requests share, that block is recomputed into a private one.
    sched = make(block_size=16, num_blocks=64)
    prompt = list(range(48))
    sched.add(req("a", prompt, max_tokens=1))
    run_to_end(sched)
    sched.add(req("b", prompt, max_tokens=1))
    (s,) = sched.plan().seqs
    assert (s.start_pos, s.num_new, s.sample) == (32, 16, True)


def test_chunks_are_cached_before_the_prompt_is_done():
    sched = make(block_size=4, num_blocks=64, max_num_batched_tokens=24)
    prompt = list(range(100, 140))
    sched.add(req("a", prompt, max_tokens=1))
    step(sched)  # a: tokens 0..24 computed, six full blocks
    sched.add(req("b", prompt[:32] + [7], max_tokens=1))
    plan, _ = step(sched)  # a: 24..40, leaving 8 tokens of budget for b
    seqs = {s.request_id: s for s in plan.seqs}
    assert seqs["a"].start_pos == 24 and seqs["b"].start_pos == 24


def test_generated_tokens_are_cached_too():
    sched = make(block_size=4, num_blocks=64)
    a = req("a", [1, 2, 3], max_tokens=6)
    sched.add(a)
    run_to_end(sched)
    # a's KV covered its prompt and its first 5 outputs: two full blocks.
    b = req("b", list(a.all_token_ids) + [7], max_tokens=1)
    sched.add(b)
    (s,) = sched.plan().seqs
    assert s.start_pos == 8


def test_chunked_prefill_does_not_stall_decodes():
    sched = make(max_num_batched_tokens=32, block_size=4, num_blocks=128)
    decoders = [req(f"d{i}", [1, 2, 3], max_tokens=20) for i in range(2)]
    for d in decoders:
        sched.add(d)
    step(sched)
    long = req("long", range(100), max_tokens=2)
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        before = [len(d.output_token_ids) for d in decoders]
        plan, _ = step(sched)
        assert [len(d.output_token_ids) for d in decoders] == [b + 1 for b in before]
        assert plan.num_tokens <= 32
        assert [s.request_id for s in plan.seqs][:2] == ["d0", "d1"]
        chunks.append({s.request_id: s for s in plan.seqs}["long"])
    assert [c.num_new for c in chunks] == [30, 30, 30, 10]
    assert [c.start_pos for c in chunks] == [0, 30, 60, 90]
    assert [c.sample for c in chunks] == [False, False, False, True]
    assert long.num_computed_tokens == 100


def test_budget_limits_tokens_and_max_num_seqs_limits_running():
    sched = make(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        sched.add(req(f"r{i}", [1, 2, 3], max_tokens=2))
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["r0", "r1"]
    assert (sched.num_running, sched.num_waiting) == (2, 3)
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["r0", "r1"]
    plan, _ = step(sched)  # r0 and r1 finished last step: two seats free again
    assert [s.request_id for s in plan.seqs] == ["r2", "r3"]


@pytest.mark.parametrize("policy, order", [("fcfs", "abcd"), ("priority", "dacb"), ("lanes", "dacb")])
def test_admission_order_across_tiers(policy, order):
    sched = make(max_num_seqs=1, policy=policy)
    tiers = {"a": "standard", "b": "batch", "c": "standard", "d": "fast"}
    for rid, tier in tiers.items():
        sched.add(req(rid, [1, 2], max_tokens=1, tier=tier))
    assert "".join(p.seqs[0].request_id for p in run_to_end(sched)) == order


def test_admission_stops_at_head_that_does_not_fit():
    # FCFS: a small request behind a big one that does not fit waits too.
    sched = make(block_size=4, num_blocks=4, max_num_batched_tokens=64)
    sched.add(req("a", range(8), max_tokens=4))
    step(sched)
    sched.add(req("big", range(100, 112), max_tokens=1))
    sched.add(req("small", [1], max_tokens=1))
    plan, _ = step(sched)
    assert [s.request_id for s in plan.seqs] == ["a"]
    assert sched.pool.table("big") == ()  # its failed prefix match left nothing held
    run_to_end(sched)


# ---- preemption ---------------------------------------------------------------------------

def test_preemption_by_recompute_keeps_outputs():
    sched = make(block_size=4, num_blocks=6, enable_prefix_caching=False, max_num_seqs=2)
    a, b = req("a", range(8), max_tokens=10), req("b", range(50, 58), max_tokens=10)
    c = req("c", [1], max_tokens=1)
    for r in (a, b, c):
        sched.add(r)
    plans = []
    while not plans or not plans[-1].preempted:
        plans.append(step(sched)[0])
    assert plans[-1].preempted == ["b"]
    assert [s.request_id for s in plans[-1].seqs] == ["a"]
    assert b.state is RequestState.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    kept = list(b.output_token_ids)
    assert kept and sched.pool.table("b") == ()
    assert list(sched.waiting["standard"]) == [b, c]  # the victim goes back to the front
    later = run_to_end(sched)
    first_back = next(s.request_id for p in later for s in p.seqs if s.request_id in ("b", "c"))
    assert first_back == "b"
    for r in (a, b):
        assert r.output_token_ids == [token_for(r.request_id, i) for i in range(10)]
        assert r.finish_reason == "length"
    assert b.output_token_ids[:len(kept)] == kept


def test_recompute_prefills_prompt_and_outputs_then_continues():
    sched = make(block_size=4, num_blocks=6, enable_prefix_caching=False)
    a, b = req("a", range(8), max_tokens=10), req("b", range(50, 58), max_tokens=10)
    sched.add(a)
    sched.add(b)
    while not step(sched)[0].preempted:
        pass
    known = tuple(b.all_token_ids)
    while True:
        plan, _ = step(sched)
        seqs = {s.request_id: s for s in plan.seqs}
        if "b" in seqs:
            break
    assert seqs["b"].start_pos == 0 and seqs["b"].token_ids == known and seqs["b"].sample


def test_newest_preempts_itself():
    # a and b decode; b's next token needs a new block and none is free: b is the newest.
    sched = make(block_size=4, num_blocks=3, enable_prefix_caching=False)
    a, b = req("a", range(5), max_tokens=3), req("b", range(4), max_tokens=3)
    sched.add(a)
    sched.add(b)
    step(sched)  # a holds 2 blocks (5 tokens), b 1 block (4 tokens); b now has 5 tokens
    plan = sched.plan()
    assert plan.preempted == ["b"] and [s.request_id for s in plan.seqs] == ["a"]
    sched.commit(plan, StepResult(plan.step_id, {"a": [SampledToken(1)]}, 0.0))
    run_to_end(sched)
    assert a.finish_reason == b.finish_reason == "length"
    assert len(b.output_token_ids) == 3


def test_no_admission_in_a_step_that_preempted():
    # Same prompts, same outputs: after step 2, b's first block duplicates a's cached one.
    sched = make(block_size=2, num_blocks=3)
    a, b = req("a", [1], max_tokens=5), req("b", [1], max_tokens=5)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    # a takes the last free block, so b preempts itself. Its freed block plus a prefix hit on
    # a's block would let it straight back in; it waits a step instead of thrashing.
    plan, _ = step(sched)
    assert plan.preempted == ["b"] and [s.request_id for s in plan.seqs] == ["a"]
    plan, _ = step(sched)
    seqs = {s.request_id: s for s in plan.seqs}
    assert seqs["b"].start_pos == 2 and seqs["b"].block_table[0] == sched.pool.table("a")[0]
    run_to_end(sched)
    assert a.output_token_ids == b.output_token_ids == [token_for("a", i) for i in range(5)]


# ---- finishing ----------------------------------------------------------------------------

def test_eos_stops_unless_ignored():
    sched = make()
    r = req("a", [1], max_tokens=5)
    sched.add(r)
    _, changed = step(sched, {"a": EOS})
    assert changed == [(r, [EOS])] and r.finish_reason == "stop" and r.output_token_ids == [EOS]
    ignoring = req("b", [1], max_tokens=2, ignore_eos=True)
    sched.add(ignoring)
    step(sched, {"b": EOS})
    assert not ignoring.finished
    step(sched, {"b": EOS})
    assert ignoring.finish_reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos():
    sched = make()
    r = req("a", [1], max_tokens=5, stop_token_ids=[42], ignore_eos=True)
    sched.add(r)
    step(sched)
    step(sched, {"a": 42})
    assert r.finish_reason == "stop" and len(r.output_token_ids) == 2


def test_max_model_len_finishes_with_length():
    sched = make(max_model_len=6)
    r = req("a", [1, 2, 3, 4], max_tokens=100)
    sched.add(r)
    run_to_end(sched)
    assert r.finish_reason == "length" and r.num_tokens == 6


def test_logprobs_recorded_when_present():
    sched = make()
    r = req("a", [1], max_tokens=1, logprobs=1)
    sched.add(r)
    plan = sched.plan()
    sched.commit(plan, StepResult(plan.step_id, {"a": [SampledToken(7, -0.5, {7: -0.5})]}, 0.0))
    assert r.output_logprobs == [{"token_id": 7, "logprob": -0.5, "top_logprobs": {7: -0.5}}]


def test_abort_waiting_and_running_frees_blocks():
    sched = make(max_num_seqs=1, block_size=4, num_blocks=8)
    a, b = req("a", range(10)), req("b", range(3))
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.pool.num_free == 5
    assert sched.abort("b") is b and b.finish_reason == "abort" and b.finished_time is not None
    assert sched.abort("a") is a and a.finish_reason == "abort"
    assert sched.pool.num_free == 8 and not sched.has_unfinished()
    assert (sched.num_running, sched.num_waiting) == (0, 0)
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert a.finish_reason == "abort"


def test_abort_between_plan_and_commit_is_skipped():
    sched = make()
    a, b = req("a", [1, 2]), req("b", [3, 4])
    sched.add(a)
    sched.add(b)
    plan = sched.plan()
    sched.abort("a")
    reused = req("a", [5, 6, 7])  # the id is free again; the stale step must not touch it
    sched.add(reused)
    tokens = {s.request_id: [SampledToken(5)] for s in plan.seqs}
    changed = sched.commit(plan, StepResult(plan.step_id, tokens, 0.0))
    assert [c.request for c in changed] == [b] and changed[0].new_token_ids == b.output_token_ids == [5]
    assert a.output_token_ids == [] and a.finish_reason == "abort"
    assert reused.output_token_ids == [] and reused.num_computed_tokens == 0
    assert reused.state is RequestState.WAITING and sched.pool.table("a") == ()


def test_finish_for_stop_strings():
    sched = make()
    r = req("a", [1, 2])
    sched.add(r)
    step(sched)
    assert sched.finish("a", "stop") is r
    assert r.finish_reason == "stop" and sched.pool.num_free == sched.pool.num_blocks
    assert sched.get("a") is None


def test_commit_checks_the_plan_is_current():
    sched = make()
    sched.add(req("a", [1]))
    plan = sched.plan()
    with pytest.raises(ValueError, match="result of step 9"):
        sched.commit(plan, StepResult(9, {}, 0.0))
    sched.commit(plan, StepResult(plan.step_id, {"a": [SampledToken(3)]}, 0.0))
    with pytest.raises(ValueError, match="not the uncommitted plan in flight"):
        sched.commit(plan, StepResult(plan.step_id, {"a": [SampledToken(3)]}, 0.0))
    stale, current = plan, sched.plan()
    with pytest.raises(ValueError, match="not the uncommitted plan in flight"):
        sched.commit(stale, StepResult(stale.step_id, {}, 0.0))
    with pytest.raises(ValueError, match="has 0 sampled tokens for a"):
        sched.commit(current, StepResult(current.step_id, {}, 0.0))


# ---- random workloads ---------------------------------------------------------------------

class FakeRunner:
    """Executes plans against a simulated KV cache: each slot records the prefix its KV was
    computed from. Reading a context that does not match the request's tokens is the bug a
    wrong prefix hit, an early free, or an overwrite would cause."""

    def __init__(self, sched: Scheduler, seed: int):
        self.sched = sched
        self.kv: dict[tuple[int, int], tuple] = {}
        self.rng = random.Random(seed)

    def execute(self, plan, requests: dict | None = None) -> StepResult:
        """`requests`: the plan's requests as planned, for one that may have finished since."""
        bs = self.sched.pool.block_size
        tokens = {}
        for s in plan.seqs:
            r = (requests or {}).get(s.request_id) or self.sched.get(s.request_id)
            known = list(r.all_token_ids) + list(s.drafts)  # what the KV is computed from, drafts included
            assert s.num_new >= 1 and s.token_ids == tuple(known[s.start_pos:s.context_len])
            assert not s.num_draft or (r.tier == "fast" and s.start_pos == r.num_tokens - 1 and s.sample)
            assert len(s.block_table) * bs >= s.context_len
            for pos in range(s.start_pos):
                assert self.kv.get((s.block_table[pos // bs], pos % bs)) == tuple(known[:pos + 1]), (
                    f"{s.request_id} reads wrong KV at {pos}"
                )
            for pos in range(s.start_pos, s.context_len):
                block = s.block_table[pos // bs]
                assert self.sched.pool.ref_count(block) == 1, f"{s.request_id} writes into shared block {block}"
                self.kv[(block, pos % bs)] = tuple(known[:pos + 1])
            if s.sample:
                kept = list(s.drafts[:self.rng.randint(0, s.num_draft)])
                tokens[s.request_id] = [SampledToken(t) for t in kept] + [
                    SampledToken(EOS if self.rng.random() < 0.1 else self.rng.randrange(1, 4))]
        return StepResult(plan.step_id, tokens, 0.0)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(1, 4),
        num_blocks=st.integers(2, 12),
        max_num_seqs=st.integers(1, 4),
        budget=st.integers(1, 16),
        max_model_len=st.integers(4, 40),
        caching=st.booleans(),
        seed=st.integers(0, 2**16),
        policy=st.sampled_from(POLICIES),
        shaped=st.booleans(),
    )
    def setup(self, block_size, num_blocks, max_num_seqs, budget, max_model_len, caching, seed, policy, shaped):
        config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=budget, max_model_len=max_model_len,
                                 enable_prefix_caching=caching, int8_max_tokens=4, dense_kernel="fp32", policy=policy)
        # A step model makes lanes shape steps by time; tight targets make it skip and chunk.
        config.tiers["fast"].tpot_target, config.tiers["standard"].tpot_target = 0.05, 0.08
        config.tiers["fast"].reserved_kv_share = config.tiers["fast"].reserved_seq_share = 0.3
        model = StepTimeModel({k: [0.02, 0.004, 0.003, 0.0, 0.002] for k in ("int8", "fp32")}) if shaped else None
        self.sched = Scheduler(config, model)
        self.runner = FakeRunner(self.sched, seed)
        self.added: list[Request] = []
        self.lengths: dict[str, int] = {}  # outputs seen so far; they only ever grow

    @rule(prefix=st.sampled_from([(), (1, 2, 3, 1), (1, 2, 3, 1, 2, 3, 1, 2)]),
          tail=st.lists(st.integers(1, 3), max_size=10), max_tokens=st.integers(1, 8),
          ignore_eos=st.booleans(), tier=st.sampled_from(["fast", "standard", "batch"]))
    def add(self, prefix, tail, max_tokens, ignore_eos, tier):
        r = req(f"r{len(self.added)}", list(prefix) + tail, max_tokens=max_tokens, ignore_eos=ignore_eos, tier=tier)
        try:
            Submission.check(r.prompt_token_ids, r.params, 100, self.sched.config.context_limit())  # the edge's
            self.sched.add(r)
        except ValueError:
            assert r.num_tokens == 0 or r.num_tokens >= self.sched.max_len(r.tier)
            return
        self.added.append(r)

    @rule()
    def step(self):
        plan = self.sched.plan()
        assert len(plan.seqs) <= self.sched.config.max_num_seqs
        assert plan.num_tokens <= self.sched.config.max_num_batched_tokens
        assert len({s.request_id for s in plan.seqs}) == len(plan.seqs)
        assert not {s.request_id for s in plan.seqs} & set(plan.preempted)
        for rid in plan.preempted:
            assert self.sched.get(rid).state is RequestState.WAITING
            assert self.sched.policy != "lanes" or self.sched.get(rid).tier != "fast"
        changed = self.sched.commit(plan, self.runner.execute(plan))
        for r, new in changed:
            assert r.finished or r.state is RequestState.RUNNING
            assert new and r.output_token_ids[-len(new):] == new

    @precondition(lambda self: self.added)
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def finish(self, data, reason):
        r = data.draw(st.sampled_from(self.added))
        was_finished = r.finished
        self.sched.finish(r.request_id, reason)
        assert r.finished and (was_finished or r.finish_reason == reason)

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def abort_mid_step(self, data):
        plan = self.sched.plan()
        result = self.runner.execute(plan)
        victim = data.draw(st.sampled_from(self.added))
        self.sched.abort(victim.request_id)
        before = list(victim.output_token_ids)
        changed = self.sched.commit(plan, result)
        assert victim.output_token_ids == before and victim not in [c.request for c in changed]

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def fast_steps_beside_a_paused_one(self, data):
        """A step stops between layers (the engine's answer to a fast arrival): plans beside it
        take only fast requests not in it and preempt none of its requests; a request of it
        aborted meanwhile keeps its blocks until it ends, for its step still writes them (the
        fake runner writes its KV only at the end, after the fast steps')."""
        paused = self.sched.plan()
        self.sched.suspend()
        mine = {s.request_id: self.sched.get(s.request_id) for s in paused.seqs}
        for _ in range(data.draw(st.integers(0, 3))):
            if data.draw(st.booleans()):
                self.add((), data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=6)), 3, True, "fast")
            if data.draw(st.booleans()):
                self.sched.abort(data.draw(st.sampled_from(self.added)).request_id)
            plan = self.sched.plan()
            planned = {s.request_id for s in plan.seqs}
            assert not planned & set(mine) and not set(plan.preempted) & set(mine)
            assert all(s.tier == "fast" for s in plan.seqs)
            for rid in mine:
                r = self.sched.get(rid)
                assert r is None or r.state is RequestState.RUNNING  # finished (aborted), or still its
            self.sched.commit(plan, self.runner.execute(plan))
        self.sched.resume()
        self.sched.commit(paused, self.runner.execute(paused, mine))

    @invariant()
    def consistent(self):
        sched = self.sched
        check_blocks(sched.pool, sched.running)
        waiting = [r for q in sched.waiting.values() for r in q]
        assert len(waiting) + len(sched.running) == sum(not r.finished for r in self.added)
        for r in self.added:
            assert len(r.output_token_ids) >= self.lengths.get(r.request_id, 0), "lost outputs"
            self.lengths[r.request_id] = len(r.output_token_ids)
            assert len(r.output_token_ids) <= r.params.max_tokens and r.num_tokens <= sched.max_len(r.tier)
            if r.finished:
                assert r.finish_reason in ("stop", "length", "abort") and sched.get(r.request_id) is None
                assert sched.pool.table(r.request_id) == ()
            elif r.state is RequestState.RUNNING:
                assert sched.running[r.request_id] is r
                assert 0 < r.num_computed_tokens < r.num_tokens
                # Rejected drafts leave blocks that the next steps fill.
                held = len(sched.pool.table(r.request_id))
                spare = sched.config.speculative_tokens if r.tier == "fast" else 0
                assert sched.pool.blocks_for(r.num_computed_tokens) <= held
                assert held <= sched.pool.blocks_for(r.num_computed_tokens + 1 + spare)
            else:
                assert r in waiting and r.num_computed_tokens == 0
                assert sched.pool.table(r.request_id) == ()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self.step()
            self.consistent()
        assert not self.sched.has_unfinished(), "requests never finished"
        assert all(r.finished for r in self.added)
        assert self.sched.pool.num_free == self.sched.pool.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None, derandomize=True)
test_scheduler_machine = SchedulerMachine.TestCase
