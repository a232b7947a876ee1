"""Sampling on synthetic logits: greedy, temperature, top-k, top-p, seeds, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from tollway.model.sampling import sample
from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq


def _seq(params: SamplingParams, position: int = 10, rid: str = "r") -> ScheduledSeq:
    return ScheduledSeq(rid, "standard", (1,), position - 1, (0,), True, params)


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([sample(logits.unsqueeze(0), [_seq(params)], gen)[0][0].token_id for _ in range(n)])


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_picks_argmax_per_row():
    logits = torch.randn(5, 1000)
    seqs = [_seq(SamplingParams(temperature=0), rid=str(i)) for i in range(5)]
    got = [t.token_id for [t] in sample(logits, seqs, torch.Generator())]
    assert got == logits.argmax(dim=-1).tolist()


def test_temperature_sampling_follows_softmax():
    n = 4000
    counts = torch.bincount(_draws(LOGITS, SamplingParams(temperature=1.0), n), minlength=6).float()
    expected = torch.softmax(LOGITS, dim=-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25  # 5 degrees of freedom: p < 1e-4 that a correct sampler lands here


def test_low_temperature_concentrates():
    draws = _draws(LOGITS, SamplingParams(temperature=0.05), 200)
    assert (draws == 0).all()


def test_top_k_restricts_support():
    draws = _draws(LOGITS, SamplingParams(temperature=5.0, top_k=2), 500)
    assert set(draws.tolist()) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.softmax(LOGITS, dim=-1)  # ~[.56, .21, .13, .08, .03, .004]
    p = float(probs[0] + probs[1]) - 1e-3  # needs tokens 0 and 1, not 2
    draws = _draws(LOGITS, SamplingParams(temperature=1.0, top_p=p), 600)
    assert set(draws.tolist()) == {0, 1}


def test_seed_gives_same_tokens_whatever_the_generator():
    params = SamplingParams(temperature=1.0, seed=1234)
    a = _draws(LOGITS, params, 20, seed=1)
    b = _draws(LOGITS, params, 20, seed=2)
    assert torch.equal(a, b)
    # ...and a different position draws independently.
    other = [sample(LOGITS.unsqueeze(0), [_seq(params, position=p)], torch.Generator())[0][0].token_id
             for p in range(40)]
    assert len(set(other)) > 1


def test_logprobs_are_log_softmax_of_raw_logits():
    params = SamplingParams(temperature=0, logprobs=3)
    [[tok]] = sample(LOGITS.unsqueeze(0), [_seq(params)], torch.Generator())
    ref = torch.log_softmax(LOGITS, dim=-1)
    assert tok.token_id == 0 and math.isclose(tok.logprob, float(ref[0]), rel_tol=1e-6)
    assert list(tok.top_logprobs) == [0, 1, 2]
    assert math.isclose(tok.top_logprobs[2], float(ref[2]), rel_tol=1e-6)


@pytest.mark.parametrize("bad, message", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"),
])
def test_bad_values_are_rejected_with_a_clear_message(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad).validate(vocab_size=100)


def _top_p_by_sort(scaled: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort, keep a token while the mass before it is below top_p."""
    values, order = torch.sort(scaled, descending=True)
    probs = torch.softmax(values, dim=-1)
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    return scaled.scatter(0, order[drop], float("-inf"))


@pytest.mark.parametrize("spread, top_p", [(0.1, 0.9), (1.0, 0.5), (3.0, 0.95), (0.01, 0.999), (5.0, 0.1)])
def test_top_p_without_a_sort_keeps_what_the_sorted_definition_keeps(spread, top_p):
    """Flat rows need thousands of tokens for the mass (the search grows past its first 64)."""
    from tollway.model.sampling import _top_p

    scaled = torch.randn(20_000, generator=torch.Generator().manual_seed(int(spread * 100))) * spread
    kept, want = _top_p(scaled, top_p), _top_p_by_sort(scaled, top_p)
    assert torch.equal(torch.isinf(kept), torch.isinf(want))
    assert torch.equal(kept[~torch.isinf(kept)], scaled[~torch.isinf(want)])


def test_a_large_vocabulary_is_sampled_by_its_softmax():
    """The draw inverts the running sum at one uniform: counts over 3,000 tokens follow softmax."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    logits[:4] = torch.tensor([6.0, 5.5, 5.0, 4.0])  # most of the mass in a few tokens
    n = 3000
    draws = _draws(logits, SamplingParams(temperature=1.0), n)
    probs = torch.softmax(logits, dim=-1)
    counts = torch.bincount(draws, minlength=3000).float()
    head = counts[:4], probs[:4] * n
    rest = torch.stack([counts[4:].sum(), probs[4:].sum() * n])
    observed, expected = torch.cat([head[0], rest[:1]]), torch.cat([head[1], rest[1:]])
    assert float(((observed - expected) ** 2 / expected).sum()) < 23  # 4 degrees of freedom: p < 1e-4
