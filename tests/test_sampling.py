"""Sampling on synthetic logits: greedy, temperature, top-k, top-p, seeds, logprobs, penalties and logit_bias."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tollway.model.sampling import adjust_logits, native_draw, only_argmax_needed, sample
from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq

NATIVE = native_draw()
# Every sampled-row test runs on both draws: torch's, and sampling.c's where it compiled.
DRAWS = pytest.mark.parametrize("draw", [None, pytest.param(NATIVE, id="native", marks=pytest.mark.skipif(
    NATIVE is None, reason="sampling.c did not compile"))], ids=["torch", "native"])


def _seq(params: SamplingParams, position: int = 10, rid: str = "r") -> ScheduledSeq:
    return ScheduledSeq(rid, "standard", (1,), position - 1, (0,), True, params)


def _draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0, draw=None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # sample() adjusts the logits in place (min_p, allowed_token_ids): each draw gets its own copy
    return torch.tensor([sample(logits.unsqueeze(0).clone(), [_seq(params)], gen, draw)[0][0].token_id
                         for _ in range(n)])


LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_picks_argmax_per_row():
    logits = torch.randn(5, 1000)
    seqs = [_seq(SamplingParams(temperature=0), rid=str(i)) for i in range(5)]
    got = [t.token_id for [t] in sample(logits, seqs, torch.Generator())]
    assert got == logits.argmax(dim=-1).tolist()


@DRAWS
def test_temperature_sampling_follows_softmax(draw):
    n = 4000
    counts = torch.bincount(_draws(LOGITS, SamplingParams(temperature=1.0), n, draw=draw), minlength=6).float()
    expected = torch.softmax(LOGITS, dim=-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25  # 5 degrees of freedom: p < 1e-4 that a correct sampler lands here


@DRAWS
def test_low_temperature_concentrates(draw):
    draws = _draws(LOGITS, SamplingParams(temperature=0.05), 200, draw=draw)
    assert (draws == 0).all()


@DRAWS
def test_top_k_restricts_support(draw):
    draws = _draws(LOGITS, SamplingParams(temperature=5.0, top_k=2), 500, draw=draw)
    assert set(draws.tolist()) == {0, 1}


@DRAWS
def test_top_p_keeps_smallest_prefix_reaching_p(draw):
    probs = torch.softmax(LOGITS, dim=-1)  # ~[.56, .21, .13, .08, .03, .004]
    p = float(probs[0] + probs[1]) - 1e-3  # needs tokens 0 and 1, not 2
    draws = _draws(LOGITS, SamplingParams(temperature=1.0, top_p=p), 600, draw=draw)
    assert set(draws.tolist()) == {0, 1}


@DRAWS
def test_seed_gives_same_tokens_whatever_the_generator(draw):
    params = SamplingParams(temperature=1.0, seed=1234)
    a = _draws(LOGITS, params, 20, seed=1, draw=draw)
    b = _draws(LOGITS, params, 20, seed=2, draw=draw)
    assert torch.equal(a, b)
    # ...and a different position draws independently.
    other = [sample(LOGITS.unsqueeze(0), [_seq(params, position=p)], torch.Generator(), draw)[0][0].token_id
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
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"),
    (dict(logit_bias={5: 101}), "logit_bias"),
    (dict(logit_bias={100: 1}), "logit_bias"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[100]), "allowed_token_ids"),
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


@DRAWS
def test_a_large_vocabulary_is_sampled_by_its_softmax(draw):
    """The draw inverts the running sum at one uniform: counts over 3,000 tokens follow softmax."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    logits[:4] = torch.tensor([6.0, 5.5, 5.0, 4.0])  # most of the mass in a few tokens
    n = 3000
    draws = _draws(logits, SamplingParams(temperature=1.0), n, draw=draw)
    probs = torch.softmax(logits, dim=-1)
    counts = torch.bincount(draws, minlength=3000).float()
    head = counts[:4], probs[:4] * n
    rest = torch.stack([counts[4:].sum(), probs[4:].sum() * n])
    observed, expected = torch.cat([head[0], rest[:1]]), torch.cat([head[1], rest[1:]])
    assert float(((observed - expected) ** 2 / expected).sum()) < 23  # 4 degrees of freedom: p < 1e-4


@pytest.mark.skipif(NATIVE is None, reason="sampling.c did not compile")
@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=40), dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.3, top_k=500, top_p=0.8), dict(temperature=0.5, top_p=0.999),
], ids=["t", "top_k", "top_p", "both", "flat_top_p"])
def test_the_native_draw_picks_the_token_torch_picks_from_the_same_uniform(params):
    """One row per seed over a 262k vocabulary, as the LM head gives it, some tokens banned: the
    two draws invert the same distribution at the same uniform, so they agree but for a uniform
    that lands within rounding of a boundary between two tokens (of 262k nearly equal ones here)."""
    rows, vocab = 24, 262_144
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    logits[:, :8] += torch.linspace(6, 2, 8)  # a few likely tokens, as a language model has
    seqs = [_seq(SamplingParams(seed=i, **params), rid=str(i)) for i in range(rows)]
    seqs[0] = seqs[0]._replace(banned_token_ids=(0, 1))
    want = [t.token_id for [t] in sample(logits.clone(), seqs, torch.Generator())]
    got = [t.token_id for [t] in sample(logits.clone(), seqs, torch.Generator(), NATIVE)]
    assert sum(a != b for a, b in zip(want, got)) <= 2
    assert got[0] not in (0, 1)
    if params.get("top_k"):
        kept = set(torch.topk(logits, params["top_k"]).indices.flatten().tolist())
        assert set(got) <= kept


@pytest.mark.skipif(NATIVE is None, reason="sampling.c did not compile")
def test_a_seeded_row_draws_the_same_token_alone_or_in_a_batch():
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(3))
    seqs = [_seq(SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i), rid=str(i)) for i in range(64)]
    batched = [t.token_id for [t] in sample(logits.clone(), seqs, torch.Generator(), NATIVE)]
    alone = [sample(logits[i:i + 1].clone(), [seqs[i]], torch.Generator(), NATIVE)[0][0].token_id for i in range(64)]
    assert batched == alone and len(set(batched)) > 10


def test_without_a_compiler_sampling_runs_on_torch(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert native_draw(tmp_path) is None
    assert "sampling.c" in caplog.text and "torch for sampling" in caplog.text


def _adjusted_by_definition(row: torch.Tensor, generated: list[int], params: SamplingParams) -> torch.Tensor:
    """OpenAI's definition, token by token, after logit_bias as in vLLM."""
    want = row.clone()
    for token, bias in params.logit_bias.items():
        want[token] += bias
    for token in set(generated):
        count = generated.count(token)
        want[token] -= params.presence_penalty * (count > 0) + params.frequency_penalty * count
    return want


def test_penalties_and_bias_follow_the_definition_over_the_requests_own_output():
    """Values exact in float32, so the adjusted logits must match bit for bit; the prompt's tokens
    (in token_ids) do not count, only the request's output and, per row, the drafts before it."""
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={7: -3.0, 2: 1.5})
    output = [3, 3, 3, 9, 2]
    seq = ScheduledSeq("r", "standard", (11, 12, 5, 9), 20, (0,), True, params, num_draft=2,
                       output_counts=dict(Counter(output)))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    got = logits.clone()
    adjust_logits(got, [seq])
    for i, drafts in enumerate([[], [5], [5, 9]]):
        assert torch.equal(got[i], _adjusted_by_definition(logits[i], output + drafts, params))
    assert torch.equal(got[0, 11], logits[0, 11])  # a prompt token: not counted


def _assert_adjusted_alone_as_in_a_batch(logits: torch.Tensor, seqs: list) -> None:
    batched = logits.clone()
    adjust_logits(batched, seqs)
    for i, seq in enumerate(seqs):
        alone = logits[i:i + 1].clone()
        adjust_logits(alone, [seq])
        assert torch.equal(batched[i], alone[0])
    assert not torch.equal(batched[-1], logits[-1])  # the last row was adjusted at all


def test_a_row_is_adjusted_the_same_alone_or_in_a_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 300, generator=gen)
    seqs = [_seq(SamplingParams(temperature=0, presence_penalty=0.1 * i, frequency_penalty=-0.2 * i,
                                logit_bias={i: 5.0 * i}), rid=str(i))._replace(
                output_counts=dict(Counter(torch.randint(0, 300, (10 * i,), generator=gen).tolist()))) for i in range(8)]
    _assert_adjusted_alone_as_in_a_batch(logits, seqs)


def test_greedy_rows_with_a_penalty_or_bias_take_the_adjusted_argmax():
    logits = LOGITS.clone().unsqueeze(0)  # argmax 0
    biased = _seq(SamplingParams(temperature=0, logit_bias={0: -100.0}))
    penalized = _seq(SamplingParams(temperature=0, frequency_penalty=2.0))._replace(output_counts={0: 1})
    assert not only_argmax_needed([biased]) and not only_argmax_needed([penalized])
    assert sample(logits.clone(), [biased], torch.Generator())[0][0].token_id == 1
    assert sample(logits.clone(), [penalized], torch.Generator())[0][0].token_id == 1


def _repetition_by_definition(row: torch.Tensor, seen: set[int], penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor (vLLM's too), in float64."""
    want = row.double().clone()
    for t in seen:
        want[t] = want[t] / penalty if want[t] > 0 else want[t] * penalty
    return want


@pytest.mark.parametrize("penalty", [1.3, 0.7, 4.0])
def test_repetition_penalty_follows_the_definition_over_prompt_output_and_drafts(penalty):
    """Prompt and output tokens (seen_token_ids), and per row the drafts before it, are divided
    where positive and multiplied where not; nothing else moves."""
    params = SamplingParams(temperature=0, repetition_penalty=penalty)
    seen = {3, 9, 11, 20}
    seq = ScheduledSeq("r", "standard", (11, 5, 31), 20, (0,), True, params, num_draft=2, seen_token_ids=seen)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 3
    got = logits.clone()
    adjust_logits(got, [seq])
    for i, drafts in enumerate([(), (5,), (5, 31)]):
        want = _repetition_by_definition(logits[i], seen | set(drafts), penalty)
        assert torch.allclose(got[i].double(), want, rtol=1e-6, atol=0)
        assert torch.equal(got[i, 40:], logits[i, 40:])


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_most_likely_after_temperature():
    """min_p's logit-space floor against its definition on probabilities, in float64."""
    gen = torch.Generator().manual_seed(6)
    for temperature, min_p in [(1.0, 0.1), (0.5, 0.05), (1.7, 0.3), (1.0, 1.0)]:
        row = torch.randn(1000, generator=gen) * 2
        got = row.clone().unsqueeze(0)
        adjust_logits(got, [_seq(SamplingParams(temperature=temperature, min_p=min_p))])
        probs = torch.softmax(row.double() / temperature, dim=-1)
        keep = probs >= min_p * probs.max()
        assert torch.equal(~torch.isinf(got[0]), keep)
        assert torch.equal(got[0][keep], row[keep])


@DRAWS
def test_min_p_restricts_what_is_drawn(draw):
    # softmax(LOGITS) ~ [.56, .21, .13, .08, .03, .004]: min_p 0.3 keeps tokens 0 and 1 (0.37 of the top)
    draws = _draws(LOGITS, SamplingParams(temperature=1.0, min_p=0.3), 400, draw=draw)
    assert set(draws.tolist()) == {0, 1}


def test_greedy_rows_with_repetition_penalty_or_allowed_tokens_take_the_adjusted_argmax():
    """Greedy is the argmax after the penalties (as vLLM's), so these rows skip the raw-argmax path;
    min_p cannot move an argmax, so it keeps it."""
    logits = LOGITS.clone().unsqueeze(0)  # argmax 0, then 1
    penalized = _seq(SamplingParams(temperature=0, repetition_penalty=3.0))._replace(seen_token_ids={0})
    allowed = _seq(SamplingParams(temperature=0, allowed_token_ids=[2, 4]))
    assert not only_argmax_needed([penalized]) and not only_argmax_needed([allowed])
    assert only_argmax_needed([_seq(SamplingParams(temperature=0, min_p=0.5))])
    assert sample(logits.clone(), [penalized], torch.Generator())[0][0].token_id == 1  # 2/3 < 1
    assert sample(logits.clone(), [allowed], torch.Generator())[0][0].token_id == 2


@DRAWS
def test_allowed_token_ids_bound_what_is_drawn(draw):
    draws = _draws(LOGITS, SamplingParams(temperature=2.0, allowed_token_ids=[3, 5]), 300, draw=draw)
    assert set(draws.tolist()) == {3, 5}


def test_rows_with_every_vllm_adjustment_are_the_same_alone_or_in_a_batch():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(8, 300, generator=gen)
    seqs = [_seq(SamplingParams(temperature=0.1 * i, repetition_penalty=1 + 0.2 * i, min_p=0.02 * i,
                                frequency_penalty=0.1 * i, allowed_token_ids=list(range(i, 300, 2)) if i % 2 else None),
                 rid=str(i))._replace(seen_token_ids=set(torch.randint(0, 300, (10 * i,), generator=gen).tolist()),
                                      output_counts={i: 2}) for i in range(8)]
    _assert_adjusted_alone_as_in_a_batch(logits, seqs)


def test_bad_words_ban_their_last_token_after_the_rest():
    from tollway.request import Request

    request = Request("r", [1, 2], SamplingParams(bad_words_token_ids=[[7], [4, 5, 6]]))
    assert request.banned_tokens() == (7,)
    request.add_output([4, 5])
    assert request.banned_tokens() == (7, 6)
    request.add_output([9])
    assert request.banned_tokens() == (7,)


def test_a_request_tracks_its_prompt_and_output_tokens_only_for_repetition_penalty():
    from tollway.request import Request

    assert Request("a", [1, 2], SamplingParams()).seen_token_ids is None
    request = Request("b", [1, 2, 2], SamplingParams(repetition_penalty=1.2))
    request.add_output([5, 1])
    assert request.seen_token_ids == {1, 2, 5}
