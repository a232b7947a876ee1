"""`tollway profile`: time the real runner over a grid of steps and write the machine profile
the simulator runs on (tollway/sim/machine_profile.py).

The grid crosses decode sequences, context length, prefill tokens and kernel, on top of the
engine's own start-up profile (step_profile.py). Beside it: the jitter (every timing against
the model fitted to the grid), and the engine's time per step outside the runner (planning,
committing, detokenizing), from a short real run.
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from tollway.model.measured import device_name
from tollway.model.step_profile import block_tables, profile_plans, samples_to_json
from tollway.request import SamplingParams
from tollway.scheduler.machine_profile import MachineProfile, overhead_line
from tollway.scheduler.plan import ScheduledSeq, StepPlan
from tollway.scheduler.step_model import StepTimeModel

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class Grid:
    decodes: tuple[int, ...] = (1, 4, 16, 64)
    contexts: tuple[int, ...] = (128, 512)
    prefills: tuple[int, ...] = (0, 64, 256)
    repeats: int = 3  # each step timed this many times; the median is kept
    jitter_repeats: int = 12


def grid_plans(sched, kernels: list[str], grid: Grid) -> list[StepPlan]:
    """Every (kernel, decodes, context, prefill) step of the grid that fits the scheduler.
    Each sequence reads its own KV blocks (block_tables)."""
    context = min(max(grid.contexts), sched.context_limit() - 2, sched.num_blocks * sched.block_size - 2)
    table = block_tables(sched, context)
    plans = []
    for kernel in kernels:
        for c in sorted({min(c, context) for c in grid.contexts}):
            for b in (b for b in grid.decodes if b <= sched.max_num_seqs):
                for p in (p for p in grid.prefills if b + p <= sched.max_num_batched_tokens):
                    seqs = [ScheduledSeq(f"d{i}", "standard", (1,), c, table(i), True, _GREEDY) for i in range(b)]
                    if p:
                        seqs.append(ScheduledSeq("prefill", "standard", (1,) * p, 0, table(b), True, _GREEDY))
                    plans.append(StepPlan(0, seqs, kernel))
    return plans


def measure(engine, grid: Grid | None = None, progress: bool = True) -> MachineProfile:
    grid = grid or Grid()
    sched, runner = engine.scheduler.config, engine.runner
    warm = profile_plans(sched)
    plans = warm + grid_plans(sched, sorted(runner.kernels), grid)
    timed = [_timed(runner, plan, grid.repeats)
             for plan in tqdm(plans, desc="profiling the runner", unit="step", disable=not progress, leave=False)]
    samples = [(plan.shape, statistics.median(times)) for plan, times in zip(plans, timed)]
    middle = plans[len(warm) + (len(plans) - len(warm)) // 2]
    plans.append(middle)
    timed.append([runner.execute(middle).seconds for _ in range(grid.jitter_repeats)])
    # Jitter is every timing against the fitted model, not one step's spread: a scheduler on
    # this machine plans by that model, so its misses (the model's misfit and the machine's
    # hiccups alike) are what its headroom must cover, and the simulator must draw.
    fitted = StepTimeModel.fit(samples)
    jitter = [t / fitted.predict(plan.shape) for plan, times in zip(plans, timed) for t in times]
    int8_max_tokens, dense_kernel = kernel_choice(sched)
    return MachineProfile(hardware_name(engine.device), engine.config.model, samples_to_json(samples), int8_max_tokens,
                          dense_kernel, estimate=False, overhead=engine_overhead(engine), jitter=jitter,
                          pause_layers=sched.pause_layers,
                          notes=f"tollway profile, {len(samples)} steps")


def hardware_name(device: torch.device) -> str:
    """What a profile says it was measured on."""
    return f"this machine: {device_name()}" + ("" if device.type == "cuda" else f" ({os.cpu_count()} cores)")


def _timed(runner, plan, repeats: int) -> list[float]:
    """`plan`'s step times, after one run not timed: a first run of a new shape pays for memory
    first touched (KV blocks, scratch), up to 10x a warm step, which jitter would otherwise
    carry into every simulated step."""
    runner.execute(plan)
    return [runner.execute(plan).seconds for _ in range(repeats)]


def kernel_choice(sched) -> tuple[int, str]:
    """(int8_max_tokens, dense_kernel): the engine's kernel choice as a simulator with
    kernel="auto" reads it. A fixed kernel (--kernel bf16) left those two at their defaults,
    which name a crossover never measured and a dense kernel never timed."""
    if sched.kernel == "auto":
        return sched.int8_max_tokens, sched.dense_kernel
    if sched.kernel == "int8":
        return sched.max_num_batched_tokens, sched.dense_kernel
    return 0, sched.kernel


def engine_overhead(engine, sizes: tuple[int, ...] = (1, 16), new_tokens: int = 12) -> list[float]:
    """[a, b]: the engine's seconds per step beside the runner, a + b x sequences, fitted over
    real decode steps of `sizes` concurrent requests."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    points = []
    for n in sizes:
        for i in range(n):
            engine.add_request([100 + i] * 16, params)
        # in inference mode, as the server's engine thread runs its steps: else each step's
        # overhead would carry the guard ModelRunner.execute enters outside it
        with torch.inference_mode():
            while engine.has_unfinished():
                start = time.perf_counter()
                report = engine.step()
                wall = time.perf_counter() - start
                if report.ran:
                    points.append((len(report.plan.seqs), max(0.0, wall - report.result.seconds)))
    return overhead_line(points)
