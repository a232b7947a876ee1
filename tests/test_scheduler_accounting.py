"""The scheduler's books, under every interleaving of add, plan, commit and abort: a property test
(hypothesis, pure Python, no model) over requests in every state (waiting, mid-prefill, running
with speculative drafts, preempted, batch requests fallen due) in a pool small enough that
preemption and chunked prefill are the rule. After every operation the block pool's counts add
up, no block is owned twice, each tier's held blocks and running count match its requests, and
every request is in exactly one place."""
from __future__ import annotations

import random
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tollway.config import POLICIES, SchedulerConfig
from tollway.request import Request, RequestState, SamplingParams
from tollway.scheduler.plan import SampledToken, StepPlan, StepResult
from tollway.scheduler.scheduler import Scheduler
from tollway.scheduler.step_model import StepTimeModel

from block_checks import assert_ref_counts

EOS = 0
WINDOW = 4.0  # the batch lane's window, in the machine's clock: requests fall due within a few ticks


class Books(RuleBasedStateMachine):
    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(3, 14), max_num_seqs=st.integers(1, 4),
                budget=st.integers(2, 16), caching=st.booleans(), policy=st.sampled_from(POLICIES),
                shaped=st.booleans(), drafts=st.integers(0, 3), seed=st.integers(0, 2**16))
    def setup(self, block_size, num_blocks, max_num_seqs, budget, caching, policy, shaped, drafts, seed):
        config = SchedulerConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=budget, max_model_len=48, enable_prefix_caching=caching,
                                 int8_max_tokens=4, dense_kernel="fp32", policy=policy, speculative_tokens=drafts,
                                 speculation_min_rate=0.0)
        config.tiers["fast"].tpot_target, config.tiers["standard"].tpot_target = 0.05, 0.08
        config.tiers["fast"].reserved_kv_share = config.tiers["fast"].reserved_seq_share = 0.3
        config.tiers["batch"].window = WINDOW
        model = StepTimeModel({k: [0.02, 0.004, 0.003, 0.0, 0.002] for k in ("int8", "fp32")}) if shaped else None
        self.now = 0.0
        self.sched = Scheduler(config, model, clock=lambda: self.now)
        self.rng = random.Random(seed)
        self.added: list[Request] = []

    # ---- operations ---------------------------------------------------------------------

    @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=14), max_tokens=st.integers(1, 10),
          tier=st.sampled_from(["fast", "standard", "batch"]), ignore_eos=st.booleans())
    def add(self, prompt, max_tokens, tier, ignore_eos):
        # Prompts over a three-token alphabet repeat themselves: n-gram drafts find matches.
        r = Request(f"r{len(self.added)}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                    tier=tier, eos_token_ids=(EOS,), arrival_time=self.now)
        try:
            self.sched.add(r)
        except ValueError:
            assert len(prompt) >= self.sched.max_len(tier)
            return
        self.added.append(r)

    @rule(seconds=st.floats(0.0, 3.0))
    def tick(self, seconds):
        self.now += seconds  # batch requests fall due as their window closes

    @rule()
    def step(self):
        plan = self.sched.plan()
        self.sched.commit(plan, self._result(plan))

    @precondition(lambda self: self.added)
    @rule(data=st.data(), reason=st.sampled_from(["abort", "stop"]))
    def end(self, data, reason):
        """An abort (or a stop string) for a request in any state, finished ones included."""
        r = data.draw(st.sampled_from(self.added))
        was_finished = r.finished
        assert (self.sched.finish(r.request_id, reason) is None) == was_finished
        assert r.finished and (was_finished or r.finish_reason == reason)

    @precondition(lambda self: self._preempted())
    @rule(data=st.data())
    def abort_preempted(self, data):
        """Preempted requests wait briefly before they run again: aim at them."""
        r = data.draw(st.sampled_from(self._preempted()))
        assert self.sched.abort(r.request_id) is r and r.finish_reason == "abort"

    def _preempted(self) -> list[Request]:
        return [r for r in self.added if r.state is RequestState.WAITING and r.num_preemptions]

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def abort_mid_step(self, data):
        """Aborts land while a step runs: between its plan and its commit."""
        plan = self.sched.plan()
        result = self._result(plan)
        victims = data.draw(st.lists(st.sampled_from(self.added), max_size=3))
        before = {v.request_id: list(v.output_token_ids) for v in victims}
        for v in victims:
            self.sched.abort(v.request_id)
        changed = self.sched.commit(plan, result)
        for v in victims:
            assert v.output_token_ids == before[v.request_id] and v not in [c.request for c in changed]

    def _result(self, plan: StepPlan) -> StepResult:
        """The model's answer: some of the drafts kept, then a token (EOS now and then)."""
        tokens = {}
        for s in plan.seqs:
            if s.sample:
                kept = list(s.drafts[:self.rng.randint(0, s.num_draft)])
                last = EOS if self.rng.random() < 0.1 else self.rng.randrange(1, 4)
                tokens[s.request_id] = [SampledToken(t) for t in kept] + [SampledToken(last)]
        return StepResult(plan.step_id, tokens, 0.01)

    # ---- the books ----------------------------------------------------------------------

    @invariant()
    def books_balance(self):
        sched, pool = self.sched, self.sched.pool
        unfinished = [r for r in self.added if not r.finished]
        waiting = [r for q in sched.waiting.values() for r in q]
        running = list(sched.running.values())
        # Every unfinished request in exactly one place, in the state that place means.
        places = Counter(r.request_id for r in waiting + running)
        assert all(n == 1 for n in places.values()), f"listed twice: {[k for k, n in places.items() if n > 1]}"
        assert set(places) == {r.request_id for r in unfinished} == set(sched.request_ids())
        assert all(r.state is RequestState.WAITING for r in waiting)
        assert all(r.state is RequestState.RUNNING for r in running)
        for tier, queue in sched.waiting.items():
            assert all(r.tier == tier for r in queue)
        for r in unfinished:
            assert sched.get(r.request_id) is r
        # Blocks: owned by running requests only, never twice by one, and ref counts = owners.
        holders = assert_ref_counts(pool, [r.request_id for r in self.added])
        assert all(pool.table(r.request_id) == () for r in self.added if r.state is not RequestState.RUNNING)
        # A block two requests hold is a prefix-cache hit: its content is cached.
        shared = [b for b, n in holders.items() if n > 1]
        assert not shared or pool.enable_prefix_caching
        # Free + in use = all; cached blocks are in use or evictable; evictable ones count as free.
        assert pool.num_free + len(holders) == pool.num_blocks
        assert pool.num_used == len(holders)
        assert pool.num_evictable <= min(pool.num_free, pool.num_cached_blocks) and pool.num_cached_blocks <= pool.num_blocks
        # Per tier: the blocks and slots the reservations are worked out from.
        for tier in sched.tiers:
            mine = [r for r in running if r.tier == tier]
            assert sched.capacity.held(tier) == sum(len(pool.table(r.request_id)) for r in mine), f"{tier} blocks"
            assert sched.running_in(tier) == len(mine), f"{tier} slots"

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(3000):
            if not self.sched.has_unfinished():
                break
            self.now += 0.5
            self.step()
            self.books_balance()
        assert not self.sched.has_unfinished(), "requests never finished"
        pool = self.sched.pool
        assert pool.num_free == pool.num_blocks and pool.num_used == 0
        assert all(self.sched.capacity.held(t) == 0 and self.sched.running_in(t) == 0 for t in self.sched.tiers)


Books.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True)
test_scheduler_books = Books.TestCase
