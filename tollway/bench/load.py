"""The loop that drives a load pattern (traffic/patterns.py) against a server over HTTP."""
from __future__ import annotations

import asyncio
import random
from tollway.bench.client import OpenAIClient
from tollway.bench.server_metrics import StepScraper
from tollway.traffic.patterns import Limits, LoadPattern, Stage
from tollway.traffic.records import RequestRecord
from tollway.traffic.workload import Requests


async def run_stage(client: OpenAIClient, requests: Requests, pattern: LoadPattern, limits: Limits, clock,
                    scraper: StepScraper | None = None, on_record=None) -> Stage:
    """Send requests under `pattern` until a limit is reached, then wait for those in flight."""
    start = clock()
    records: list[RequestRecord] = []
    measured = 0
    tasks: set[asyncio.Task] = set()
    failed: list[BaseException] = []  # a send that raised (a bug, not a request's error): the stage stops with it
    scraping = asyncio.create_task(scraper.run(clock)) if scraper else None

    def more() -> bool:
        if limits.max_duration is not None and clock() - start >= limits.max_duration:
            return False
        return limits.max_requests is None or measured < limits.max_requests

    def done(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            failed.append(task.exception())
        else:
            records.append(task.result())
            if on_record:
                on_record(task.result())

    def launch() -> asyncio.Task:
        nonlocal measured
        warmup = clock() - start < limits.warmup
        measured += not warmup
        task = asyncio.create_task(client.send(requests.next(), pattern.name, warmup, clock))
        task.add_done_callback(done)
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
        while more() and not failed:
            launch()
            due += rng.gammavariate(shape, 1.0 / (pattern.rate * shape))
            wait = due - clock()
            if limits.max_duration is not None:
                wait = min(wait, start + limits.max_duration - clock())
            if wait > 0:
                await asyncio.sleep(wait)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    if failed:
        if scraping:
            scraping.cancel()
        raise failed[0]
    end = clock()
    steps = []
    if scraping:
        steps = await scraper.finish(scraping, clock)
    return Stage(pattern, start, end, sorted(records, key=lambda r: r.index), steps)
