"""A workload on the real engine, in process and on the wall clock, recorded the way the
simulator records it: the measured side of the simulator's fidelity check.

Requests are drawn exactly as the simulator draws them (Workload.draw with the same seed), and
the closed loop behaves as the simulator's: a finished request's user sends the next before
the engine plans its next step. No HTTP in between, since the simulator models none.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable

from tqdm import tqdm

from tollway.request import QueueFullError, SamplingParams
from tollway.step_report import StepReport
from tollway.sim.step_series import step_series
from tollway.traffic.patterns import Limits, LoadPattern, Stage
from tollway.traffic.records import RequestRecord
from tollway.traffic.workload import Workload

_TOKEN_IDS = (1000, 200_000)


def run_on_engine(engine, workload: Workload, pattern: LoadPattern, limits: Limits, progress: bool = True,
                  on_step: Callable[[StepReport], None] | None = None) -> Stage:
    """`on_step(report)` after every step that ran something."""
    limits.check()
    draws, ids, gaps = random.Random(workload.seed), random.Random(workload.seed + 2), random.Random(workload.seed + 1)
    start = time.perf_counter()
    clock = lambda: time.perf_counter() - start  # noqa: E731
    records: dict[str, RequestRecord] = {}
    steps: list[tuple[float, int, int, float]] = []  # (start, sequences, tokens, seconds), as the simulator keeps
    measured = 0
    vocab = min(_TOKEN_IDS[1], engine.model_config.vocab_size)

    def more(now: float) -> bool:
        if limits.max_duration is not None and now >= limits.max_duration:
            return False
        return limits.max_requests is None or measured < limits.max_requests

    def send(at: float) -> None:
        nonlocal measured
        tier, prompt_tokens, max_tokens = workload.draw(draws)
        warmup = at < limits.warmup
        measured += not warmup
        record = RequestRecord(len(records) + 1, pattern.name, tier, warmup, prompt_tokens, max_tokens, at)
        rid = f"engine-{record.index}"
        records[rid] = record
        prompt = [ids.randrange(_TOKEN_IDS[0], vocab) for _ in range(prompt_tokens)]
        try:
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               tier=tier, request_id=rid)
        except QueueFullError as e:
            record.error, record.error_message, record.end = "http_429", str(e), clock()

    closed = pattern.concurrency is not None
    due = 0.0
    if closed:
        for _ in range(pattern.concurrency):
            send(0.0)
    with tqdm(total=limits.max_requests, desc=f"engine {pattern.name}", unit="req", disable=not progress,
              leave=False) as bar:
        while True:
            now = clock()
            if not closed:
                while more(now) and due <= now:
                    send(due)  # its clock starts when it was due, mid-step if so, as a client's would
                    due += gaps.gammavariate(pattern.burstiness, 1.0 / (pattern.rate * pattern.burstiness))
            if not engine.has_unfinished():
                if closed or not more(now):
                    break
                time.sleep(max(0.0, due - clock()))
                continue
            began = clock()
            report = engine.step()
            now = clock()
            if report.ran:
                steps.append((began, report.plan.num_seqs, report.plan.num_tokens, now - began))
                if on_step is not None:
                    on_step(report)
            for out in report.outputs:
                record = records[out.request_id]
                if out.new_token_ids:
                    record.first_token = record.first_token if record.first_token is not None else now
                    record.chunk_times.append(now)
                if out.finished:
                    record.end, record.output_tokens = now, out.num_output_tokens
                    bar.update(not record.warmup)
                    if closed and more(now):
                        send(now)
    end = clock()
    return Stage(pattern, 0.0, end, sorted(records.values(), key=lambda r: r.index), step_series(steps, 0.0, end))
