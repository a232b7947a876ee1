"""Speculative decoding: n-gram proposals, the payoff rule, verification that keeps greedy output
identical and sampled output distributed as without drafts, and the fast lane end to end."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tollway.config import SchedulerConfig
from tollway.model.sampling import sample
from tollway.request import Request, SamplingParams
from tollway.scheduler.plan import SampledToken, ScheduledSeq, StepResult
from tollway.scheduler.scheduler import Scheduler
from tollway.scheduler.speculation import NgramIndex, best_draft_count


def brute_force_propose(tokens: list[int], k: int, max_n: int = 3) -> list[int]:
    for n in range(min(max_n, len(tokens)), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(max_n=3)
    # "1 2 3" occurred twice before the tail; the latest occurrence was followed by 7 8.
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    assert index.propose(tokens, 2) == [7, 8]
    assert NgramIndex().propose([5, 6, 7], 4) == []  # nothing repeats


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 5))
def test_incremental_index_agrees_with_a_scan(tokens, k, step):
    """Appending tokens a few at a time and proposing as we go gives what a fresh scan gives."""
    index = NgramIndex(max_n=3)
    for end in range(1, len(tokens) + 1, step):
        assert index.propose(tokens[:end], k) == brute_force_propose(tokens[:end], k)
    assert index.propose(tokens, k) == brute_force_propose(tokens, k)


def test_draft_count_pays_off_only_when_acceptance_is_high_enough():
    flat = lambda k: 0.1  # noqa: E731 -- drafts cost nothing: send all that are available
    assert best_draft_count(4, 0.5, flat, min_rate=0.25) == 4
    assert best_draft_count(4, 0.2, flat, min_rate=0.25) == 0
    assert best_draft_count(0, 0.9, flat, min_rate=0.25) == 0
    steep = lambda k: 0.1 * (1 + k)  # noqa: E731 -- each draft costs a whole step: never worth it
    assert best_draft_count(4, 0.9, steep, min_rate=0.25) == 0
    mild = lambda k: 0.1 + 0.01 * k  # noqa: E731
    assert best_draft_count(4, 0.9, mild, 0.25) == 4 and best_draft_count(4, 0.3, mild, 0.25) < 4


def _seq(drafts, params, start=9) -> ScheduledSeq:
    return ScheduledSeq("r", "fast", (5,) + tuple(drafts), start, (0, 1), True, params, num_draft=len(drafts))


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement():
    logits = torch.full((4, 10), -5.0)
    for row, best in enumerate([3, 4, 9, 1]):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0)
    ids = lambda drafts: [t.token_id for t in sample(logits[:len(drafts) + 1], [_seq(drafts, greedy)], torch.Generator())[0]]  # noqa: E731
    assert ids([3, 4, 9]) == [3, 4, 9, 1]  # all accepted, plus the bonus token
    assert ids([3, 7, 9]) == [3, 4]  # the second draft is wrong: the model's choice replaces it
    assert ids([8, 4, 9]) == [3]
    assert ids([]) == [3]


def test_sampled_verification_keeps_the_models_distribution():
    """With drafts, the first token is still distributed as p1 and, when the draft was kept, the
    second as p2: chi-square over 6000 draws each."""
    torch.manual_seed(0)
    p1 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p2 = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p3 = torch.tensor([0.25, 0.25, 0.25, 0.25])
    logits = torch.stack([p1, p2, p3]).log()
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1)
    firsts, seconds = [], []
    for _ in range(6000):
        out = [t.token_id for t in sample(logits, [_seq([1, 3], params)], gen)[0]]
        firsts.append(out[0])
        if out[0] == 1:
            seconds.append(out[1])
        if len(out) == 3:
            assert out[:2] == [1, 3]
    for draws, p in ((firsts, p1), (seconds, p2)):
        counts = torch.bincount(torch.tensor(draws), minlength=4).float()
        expected = p * len(draws)
        assert float(((counts - expected) ** 2 / expected).sum()) < 20  # 3 dof: p < 2e-4 if correct


def test_seeded_sampling_is_the_same_with_and_without_drafts_when_drafts_are_rejected():
    """A rejected first draft re-draws from p without it; with a seed the stream is keyed by
    position, so repeating a step gives the same tokens."""
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=7)
    a = sample(logits, [_seq([4, 5], params)], torch.Generator().manual_seed(1))
    b = sample(logits, [_seq([4, 5], params)], torch.Generator().manual_seed(2))
    assert [t.token_id for t in a[0]] == [t.token_id for t in b[0]]


def test_scheduler_sends_drafts_for_fast_decodes_only_and_commits_accepted_ones():
    config = SchedulerConfig(int8_max_tokens=32, speculative_tokens=3)
    sched = Scheduler(config)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    fast = Request("f", list(prompt), SamplingParams(max_tokens=8, temperature=0), tier="fast")
    std = Request("s", list(prompt), SamplingParams(max_tokens=8, temperature=0), tier="standard")
    sched.add(fast)
    sched.add(std)
    plan = sched.plan()  # prefill both, sample 3 for each
    sched.commit(plan, StepResult(plan.step_id, {"f": [SampledToken(3)], "s": [SampledToken(3)]}, 0.1))
    plan = sched.plan()
    seqs = {s.request_id: s for s in plan.seqs}
    assert seqs["s"].num_draft == 0
    assert seqs["f"].drafts == (4, 1, 2) and seqs["f"].token_ids == (3, 4, 1, 2)
    # The model agrees with two drafts and then says 9.
    sched.commit(plan, StepResult(plan.step_id, {"f": [SampledToken(4), SampledToken(1), SampledToken(9)],
                                                 "s": [SampledToken(4)]}, 0.1))
    assert fast.output_token_ids == [3, 4, 1, 9]
    assert fast.num_computed_tokens == len(prompt) + 3  # 3, 4, 1 have KV; 9 does not yet
    assert sched.speculation.proposed == 3 and sched.speculation.accepted == 2


def test_a_result_that_keeps_tokens_other_than_the_drafts_is_refused():
    sched = Scheduler(SchedulerConfig(int8_max_tokens=32, speculative_tokens=2))
    sched.add(Request("f", [1, 2, 1, 2, 1], SamplingParams(max_tokens=8, temperature=0), tier="fast"))
    plan = sched.plan()
    sched.commit(plan, StepResult(plan.step_id, {"f": [SampledToken(2)]}, 0.1))
    plan = sched.plan()
    assert plan.seqs[0].drafts == (1, 2)
    with pytest.raises(ValueError, match="keeps tokens that are not its drafts"):
        sched.commit(plan, StepResult(plan.step_id, {"f": [SampledToken(1), SampledToken(7), SampledToken(3)]}, 0.1))
    with pytest.raises(ValueError, match="has 4 sampled tokens for f, expected 1..3"):
        sched.commit(plan, StepResult(plan.step_id, {"f": [SampledToken(1)] * 4}, 0.1))


@pytest.mark.parametrize("kernel", ["fp32", "int8"])
def test_fast_lane_speculation_leaves_greedy_output_unchanged(make_engine, run_to_completion, kernel):
    """On the real model: a repetitive prompt makes n-gram drafts hit; the fast lane's greedy
    text equals the standard lane's, which never speculates."""
    prompt = "one two three four five, one two three four five, one two three four five, one two"
    params = SamplingParams(temperature=0, max_tokens=24)
    engine = make_engine(kernel=kernel)
    [plain], _ = run_to_completion(engine, [prompt], params)
    engine.add_request(prompt, params, tier="fast", request_id="fast")
    fast, plans = None, []
    while engine.has_unfinished():
        report = engine.step()
        for out in report.outputs:
            fast = out if out.finished else fast
        plans.append(report.plan)
    assert fast.token_ids == plain.token_ids and fast.text == plain.text
    drafted = [s for p in plans for s in p.seqs if s.num_draft]
    assert drafted, "no drafts were sent"
    spec = engine.scheduler.speculation
    assert spec.accepted > 0 and len(plans) < len(plain.token_ids)  # fewer steps than tokens
