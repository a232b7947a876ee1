"""No step copies a request's whole token list: what the scheduler reads of a request's tokens
grows with what each step adds (its new tokens, a full block's hash, a draft lookup's tail),
so a long request costs in proportion to its length, not its length squared."""
from __future__ import annotations

from tollway.config import SchedulerConfig
from tollway.request import Request, SamplingParams
from tollway.scheduler.plan import SampledToken, StepResult
from tollway.scheduler.scheduler import Scheduler


class CountingList(list):
    """A list that counts the elements read out of it: by slices, iteration, copies and joins."""

    read = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.read += len(got)
        return got

    def __iter__(self):
        CountingList.read += len(self)
        return super().__iter__()

    def __add__(self, other):
        CountingList.read += len(self) + len(other)
        return list(super().__iter__()) + list(other)

    def __radd__(self, other):
        CountingList.read += len(self) + len(other)
        return list(other) + list(super().__iter__())

    def copy(self):
        CountingList.read += len(self)
        return list(super().__iter__())


def _reads_for(output_tokens: int, tier: str, **params) -> int:
    """Elements read from one request's token lists over its whole life: a prompt of 512
    tokens, then `output_tokens` generated one step at a time (the fast lane drafts from an
    n-gram index over them)."""
    sched = Scheduler(SchedulerConfig(int8_max_tokens=4, dense_kernel="fp32", speculative_tokens=4))
    prompt = [(7 * i) % 50 + 1 for i in range(512)]
    request = Request("r", CountingList(prompt), SamplingParams(max_tokens=output_tokens, ignore_eos=True, **params),
                      tier=tier)
    request.output_token_ids = CountingList()
    sched.add(request)
    CountingList.read = 0
    while sched.has_unfinished():
        plan = sched.plan()
        tokens = {}
        for s in plan.seqs:
            if s.sample:  # the drafts are always right, then one more: the tokens cycle
                n = len(request.output_token_ids)
                tokens[s.request_id] = [SampledToken(t) for t in s.drafts] + [SampledToken((7 * (512 + n + s.num_draft)) % 50 + 1)]
        sched.commit(plan, StepResult(plan.step_id, tokens, 0.01))
    assert len(request.output_token_ids) == output_tokens
    return CountingList.read


def test_a_requests_tokens_are_read_in_proportion_to_its_length():
    for tier, params in (("standard", {}), ("fast", {}), ("standard", {"frequency_penalty": 0.5})):
        short, long = _reads_for(500, tier, **params), _reads_for(2000, tier, **params)
        # Linear work: the 1,500 extra tokens each cost a few reads (a draft lookup reads the
        # n-grams ending at each new token and the tail's); whole-list reads would cost thousands.
        assert long - short < 20 * 1500, (tier, params, short, long)


def test_the_check_fails_where_a_step_joins_the_whole_list(monkeypatch):
    """The bound above can fail: with all_token_ids joining prompt and output (as it once did),
    each fast step's draft lookup reads the whole request."""
    monkeypatch.setattr(Request, "all_token_ids", property(lambda r: r.prompt_token_ids + r.output_token_ids))
    short, long = _reads_for(500, "fast"), _reads_for(2000, "fast")
    assert long - short > 100 * 1500
