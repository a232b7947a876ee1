"""Batching never changes a greedy result: alone, in one batch of every prompt (64 on the default
kernel), chunked, or preempted."""
from __future__ import annotations

import pytest

from tollway.request import SamplingParams

_TEXTS = [
    "Hi", "The capital of France is", "def add(a, b):", "Once upon a time",
    "List three colors:", "2 + 2 =", "Translate 'cat' to Spanish:", "The quick brown fox",
    "Why is the sky blue? Explain briefly in simple words for a child who is five years old.",
    "import numpy as np\nx = np.arange(10)\nprint(", "Dear team,\nThank you for", "In 1969, astronauts",
    "Water boils at", "The opposite of hot is", "A haiku about autumn leaves:",
    "SELECT name FROM users WHERE", "The mitochondria is", "My favourite food is",
]
# 64 prompts of mixed lengths (2 to ~90 tokens).
PROMPTS = [_TEXTS[i % len(_TEXTS)] + (" and then" * (i // 4)) for i in range(64)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


# "auto" is the default: q8 on a CPU where the native matmul compiles (its 4-bit and int8 weight
# formats both), with the float16 KV cache. It batches all 64 prompts; torch's kernels, pinned by
# the rest, 8 of them (fp32's LM head reads 671 MB a step: 16 prompts alone took 40 s in CI).
@pytest.fixture(scope="module", params=["auto", "int8", "fp32"])
def kernel(request):
    return request.param


@pytest.fixture(scope="module")
def prompts(kernel):
    return PROMPTS if kernel == "auto" else PROMPTS[::8]


@pytest.fixture(scope="module")
def alone(make_engine, run_to_completion, kernel, prompts):
    engine = make_engine(kernel=kernel)
    return [run_to_completion(engine, [p], PARAMS)[0][0].token_ids for p in prompts]


def test_one_batch_of_every_prompt_matches_alone(make_engine, run_to_completion, kernel, prompts, alone):
    outs, plans = run_to_completion(make_engine(kernel=kernel), prompts, PARAMS)
    assert max(len(p.seqs) for p in plans) == len(prompts)
    assert [o.token_ids for o in outs] == alone


def test_chunked_prefill_matches_alone(make_engine, run_to_completion, kernel, prompts, alone):
    engine = make_engine(kernel=kernel, max_num_batched_tokens=40)
    outs, plans = run_to_completion(engine, prompts, PARAMS)
    chunked = [s for p in plans for s in p.seqs if not s.is_decode and s.start_pos > 0]
    mixed = [p for p in plans if p.num_decode and p.num_prefill_tokens]
    assert chunked and mixed  # prompts were split, and prefill chunks rode along with decodes
    assert [o.token_ids for o in outs] == alone


def test_preemption_matches_alone(make_engine, run_to_completion, kernel, prompts, alone):
    # 8 blocks of 16 tokens hold a few sequences at a time (the longest needs 6): the newest get
    # preempted.
    engine = make_engine(kernel=kernel, num_blocks=8, enable_prefix_caching=False)
    outs, plans = run_to_completion(engine, prompts, PARAMS)
    assert any(p.preempted for p in plans)
    assert [o.token_ids for o in outs] == alone


def test_requests_scoring_their_prompts_change_no_greedy_result(make_engine, kernel, prompts, alone):
    """Every other request also asks for its prompt's logprobs, which puts whole prefill chunks
    through the LM head and off the greedy path, in the steps everyone shares."""
    engine = make_engine(kernel=kernel, max_num_batched_tokens=40)
    scoring = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    some = prompts[:16]
    ids = [engine.add_request(p, scoring if i % 2 == 0 else PARAMS) for i, p in enumerate(some)]
    finals = {}
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step().outputs if o.finished)
    assert [finals[i].token_ids for i in ids] == alone[:len(some)]
    assert all(len(finals[i].prompt_logprobs) == len(finals[i].prompt_token_ids) for i in ids[::2])
    assert all(finals[i].prompt_logprobs is None for i in ids[1::2])


# vLLM's sampling fields: repetition_penalty moves greedy rows off the LM head's pruned argmax;
# seeded rows draw after min_p and top_k.
VLLM_PARAMS = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3),
               SamplingParams(temperature=0.8, top_k=20, min_p=0.05, repetition_penalty=1.2, seed=7, max_tokens=6,
                              ignore_eos=True)]


@pytest.mark.parametrize("params", VLLM_PARAMS, ids=["greedy", "seeded"])
def test_vllm_sampling_fields_match_alone(make_engine, run_to_completion, kernel, prompts, params):
    # The fields act on a row's logits, after the kernel: the fp32 kernel's own invariance is
    # the other tests', at a fifth of the int8 kernel's speed.
    if kernel == "fp32":
        pytest.skip("the sampler's fields are kernel-independent: int8 and auto check them")
    few = prompts[:8]
    engine = make_engine(kernel=kernel)
    alone = [run_to_completion(engine, [p], params)[0][0].token_ids for p in few]
    outs, plans = run_to_completion(engine, few, params)
    assert max(len(p.seqs) for p in plans) == len(few)
    assert [o.token_ids for o in outs] == alone
