"""Time the real runner on synthetic steps: the starting point of the scheduler's StepTimeModel.

The steps span what the scheduler will plan: decode batches from 1 to max_num_seqs at a short
and a long context, and prefill chunks up to the token budget, with and without earlier
context. Each decode reads its own blocks of the KV cache, as real sequences do; the profile
needs no real requests, and nothing a request could read is left in the prefix cache.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

from tqdm import tqdm

from tollway.config import SchedulerConfig
from tollway.model.host_memory import populate
from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq, StepPlan
from tollway.scheduler.step_model import StepShape

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
# Sequences with blocks of their own in a profile step: each layer's keys and values of 8 of them
# are megabytes, as of 32 (which timed the same steps alike), and every page of them is faulted
# in before the profile can start, on a model's first start.
DISTINCT_SEQS = 8


def block_tables(sched: SchedulerConfig, context: int) -> Callable[[int], tuple[int, ...]]:
    """table(i): the i-th sequence's own blocks for `context` tokens, for the first
    DISTINCT_SEQS sequences (wrapping round the pool only past its size). Sequences sharing one
    table would find each other's keys in cache, and attention would time faster than in real
    traffic; past DISTINCT_SEQS, the KV a whole step reads is past the CPU's caches anyway, and
    fresh tables would only fault in the pool's pages in the timed steps (slowly, in a VM)."""
    per_seq = -(-(context + 1) // sched.block_size)

    def table(i: int) -> tuple[int, ...]:
        start = (i % DISTINCT_SEQS * per_seq) % max(1, sched.num_blocks - per_seq + 1)
        return tuple(range(start, start + per_seq))
    return table


def profile_plans(sched: SchedulerConfig) -> list[StepPlan]:
    bs = sched.block_size
    context = min(512, sched.context_limit() - 2, sched.num_blocks * bs - 2)
    tables = block_tables(sched, context)
    table = tables(0)
    budget = sched.max_num_batched_tokens

    def plan(seqs: list[ScheduledSeq]) -> StepPlan:
        return StepPlan(0, seqs, sched.kernel_for(sum(s.num_new for s in seqs)))

    def prefill(start: int, n: int) -> ScheduledSeq:
        return ScheduledSeq("profile", "standard", (1,) * n, start, table, True, _GREEDY)

    # A start's first profile is part of the wait for it: each shape once, as few as pin the
    # step model's five features per kernel (every real step refines them after). A short chunk at
    # the start and a longer one after it tell chunk tokens from attention (decode steps at two
    # contexts pin attention too); the budget's whole chunk, the longest step here, is timed only
    # where it runs a kernel that no smaller chunk does.
    chunks = [c for c in ((0, 16), (context // 2, 128)) if c[1] <= budget and sum(c) <= context]
    if sched.kernel_for(budget) != sched.kernel_for(min(128, budget)) or not chunks:
        chunks.insert(0, (0, min(budget, context)))
    plans = [plan([prefill(start, n)]) for start, n in dict.fromkeys(chunks)]
    most = min(sched.max_num_seqs, budget)
    sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= most} | {most})
    # The long context at every size; the short one, which tells attention from the rest, at three.
    for c, batch_sizes in ((context // 4, sorted({1, min(8, most), min(32, most)})), (context, sizes)):
        for b in batch_sizes:
            plans.append(plan([ScheduledSeq(f"p{i}", "standard", (1,), c, tables(i), True, _GREEDY) for i in range(b)]))
    return plans


def profile_key(sched: SchedulerConfig) -> str:
    """What the profile plans depend on."""
    return (f"steps-v5|{sched.kernel}|{sched.int8_max_tokens}|{sched.dense_kernel}|{sched.block_size}|"
            f"{sched.max_num_seqs}|{sched.max_num_batched_tokens}|{_context(sched)}")


def _context(sched: SchedulerConfig) -> int:
    return min(512, sched.context_limit() - 2, sched.num_blocks * sched.block_size - 2)


def profile_step_times(runner, sched: SchedulerConfig, repeats: int = 1,
                       progress: bool = True) -> list[tuple[StepShape, float]]:
    """(shape, median seconds) for each profile plan, timed on `runner`."""
    if runner.device.type == "cpu":
        # The pool's pages the profile writes, faulted in before it times anything: a VM backs a
        # fresh page slowly at its first touch, and the steps that met them first would carry it.
        slots = min(DISTINCT_SEQS * -(-(_context(sched) + 1) // sched.block_size), sched.num_blocks) * sched.block_size
        populate([t[:slots] for cache in runner.caches for t in (cache.k, cache.v)])
    samples = []
    for plan in tqdm(profile_plans(sched), desc="profiling steps", unit="step", disable=not progress, leave=False):
        seconds = statistics.median(runner.execute(plan).seconds for _ in range(repeats))
        samples.append((plan.shape, seconds))
    return samples


def samples_to_json(samples: list[tuple[StepShape, float]]) -> list[list]:
    return [[s.kernel, s.tokens, s.sampled, s.attention, s.chunks, seconds] for s, seconds in samples]


def samples_from_json(rows: list[list]) -> list[tuple[StepShape, float]]:
    return [(StepShape(kernel, tokens, sampled, attention, chunks), seconds)
            for kernel, tokens, sampled, attention, chunks, seconds in rows]
