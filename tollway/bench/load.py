"""Load patterns and the loop that drives them: a fixed concurrency (closed loop), a request
rate (open loop, Poisson or gamma with burstiness), and a sweep from one request at a time to
saturation with rates in between, as GuideLLM sweeps."""
from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from tollway.bench.client import OpenAIClient, RequestRecord
from tollway.bench.server_metrics import StepScraper
from tollway.bench.workload import Requests


@dataclass
class LoadPattern:
    """One stage of load: `concurrency` requests in flight, or `rate` new ones per second."""

    name: str
    concurrency: int | None = None
    rate: float | None = None
    burstiness: float = 1.0  # gamma shape of the gaps: 1 is Poisson, below 1 burstier

    def to_dict(self) -> dict:
        return {"name": self.name, "concurrency": self.concurrency, "rate": self.rate, "burstiness": self.burstiness}


@dataclass
class Limits:
    max_requests: int | None = None  # measured requests per stage (warm-up ones not counted)
    max_duration: float | None = None  # seconds per stage, warm-up included; then no new requests
    warmup: float = 0.0  # seconds at the start of a stage whose requests are not measured

    def check(self) -> None:
        if self.max_requests is None and self.max_duration is None:
            raise ValueError("give --max-requests or --max-duration (or both)")
        if (self.max_requests is not None and self.max_requests < 1) or (
                self.max_duration is not None and not self.max_duration > 0) or self.warmup < 0:
            raise ValueError("--max-requests must be >= 1, --max-duration > 0 and --warmup >= 0")


@dataclass
class Stage:
    pattern: LoadPattern
    start: float
    end: float
    records: list[RequestRecord]
    steps: list[dict]  # the server's step size over time, where it exposes /metrics


async def run_stage(client: OpenAIClient, requests: Requests, pattern: LoadPattern, limits: Limits, clock,
                    scraper: StepScraper | None = None, on_record=None) -> Stage:
    """Send requests under `pattern` until a limit is reached, then wait for those in flight."""
    start = clock()
    records: list[RequestRecord] = []
    measured = 0
    tasks: set[asyncio.Task] = set()
    scraping = asyncio.create_task(scraper.run(clock)) if scraper else None

    def more() -> bool:
        if limits.max_duration is not None and clock() - start >= limits.max_duration:
            return False
        return limits.max_requests is None or measured < limits.max_requests

    def launch() -> asyncio.Task:
        nonlocal measured
        warmup = clock() - start < limits.warmup
        measured += not warmup
        task = asyncio.create_task(client.send(requests.next(), pattern.name, warmup, clock))
        task.add_done_callback(lambda t: (records.append(t.result()), on_record and on_record(t.result())))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    if pattern.concurrency is not None:
        async def worker():
            while more():
                await launch()

        await asyncio.gather(*(worker() for _ in range(pattern.concurrency)))
    else:
        rng = random.Random(requests.workload.seed + 1)
        shape = pattern.burstiness
        due = clock()
        while more():
            launch()
            due += rng.gammavariate(shape, 1.0 / (pattern.rate * shape))
            wait = due - clock()
            if limits.max_duration is not None:
                wait = min(wait, start + limits.max_duration - clock())
            if wait > 0:
                await asyncio.sleep(wait)
    if tasks:
        await asyncio.gather(*tasks)
    end = clock()
    steps = []
    if scraping:
        steps = await scraper.finish(scraping, clock)
    return Stage(pattern, start, end, sorted(records, key=lambda r: r.index), steps)


def sweep_rates(synchronous_rps: float, saturated_rps: float, between: int) -> list[float]:
    """`between` request rates evenly spaced strictly between the two measured ends."""
    if between <= 0 or not saturated_rps > synchronous_rps:
        return []
    step = (saturated_rps - synchronous_rps) / (between + 1)
    return [synchronous_rps + step * (i + 1) for i in range(between)]
