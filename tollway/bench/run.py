"""`tollway bench`: one workload against one OpenAI-compatible server, under a load pattern
(or a sweep of them), measured per tier and written as JSON (every request's timings) and a
self-contained HTML report."""
from __future__ import annotations

import asyncio
import datetime
from dataclasses import asdict, dataclass, field

from tollway.bench.client import OpenAIClient, now_clock
from tollway.bench.load import run_stage
from tollway.bench.server_metrics import StepScraper
from tollway.traffic.console import LiveView
from tollway.traffic.patterns import Limits, LoadPattern, Stage, sweep_rates
from tollway.traffic.results import FORMAT, stage_dict
from tollway.traffic.stats import SLO, summarize
from tollway.traffic.workload import Requests, Workload

@dataclass
class BenchConfig:
    url: str
    model: str
    workload: Workload
    limits: Limits
    patterns: list[LoadPattern] = field(default_factory=list)  # fixed stages; empty with sweep
    sweep: int | None = None  # stages in a sweep (>= 2): synchronous, rates between, saturated
    sweep_concurrency: int = 64  # the saturated end of a sweep
    slo: SLO = field(default_factory=lambda: SLO({}))
    usd_per_hour: float | None = None
    api_key: str | None = None
    endpoint: str = "completions"
    label: str | None = None  # names this run in merged reports; default: the URL
    timeout: float = 600.0

    def check(self) -> None:
        self.limits.check()
        if self.sweep is not None and self.sweep < 2:
            raise ValueError(f"--sweep needs at least 2 stages, got {self.sweep}")
        if self.sweep is None and not self.patterns:
            raise ValueError("give one of --concurrency, --rate or --sweep")


def run_bench(config: BenchConfig, tokenizer=None, show: bool = True) -> dict:
    config.check()
    requests = Requests(config.workload, tokenizer)
    return asyncio.run(_run(config, requests, show))


async def _run(config: BenchConfig, requests: Requests, show: bool) -> dict:
    clock = now_clock()
    client = OpenAIClient(config.url, config.model, config.api_key, config.endpoint, config.timeout,
                          config.workload.ignore_eos)
    scraper = StepScraper(client.http, client.base)
    started = datetime.datetime.now(datetime.timezone.utc)
    stages: list[Stage] = []
    view = LiveView(config.limits, config.slo, show)

    async def stage(pattern: LoadPattern) -> Stage:
        with view.stage(pattern) as on_record:
            done = await run_stage(client, requests, pattern, config.limits, clock, scraper, on_record)
        stages.append(done)
        return done

    try:
        with view:
            if config.sweep is None:
                for pattern in config.patterns:
                    await stage(pattern)
            else:
                slowest = await stage(LoadPattern("synchronous", concurrency=1))
                fastest = await stage(LoadPattern(f"saturated ({config.sweep_concurrency})",
                                              concurrency=config.sweep_concurrency))
                ends = [summarize(s.records, config.slo, None)["all"]["requests_per_s"] or 0.0
                        for s in (slowest, fastest)]
                for rate in sweep_rates(ends[0], ends[1], config.sweep - 2):
                    await stage(LoadPattern(f"rate {rate:.3g}/s", rate=rate))
    finally:
        await client.close()
    stages.sort(key=lambda s: (s.pattern.concurrency != 1, s.pattern.concurrency or 0, s.pattern.rate or 0))
    return {
        "format": FORMAT, "label": config.label or config.url, "url": config.url, "model": config.model,
        "endpoint": config.endpoint, "date": started.isoformat(timespec="seconds"),
        "workload": config.workload.to_dict(), "limits": asdict(config.limits), "slo": config.slo.limits,
        "usd_per_hour": config.usd_per_hour, "steps_exposed": scraper.available,
        "stages": [stage_dict(s, config.slo, config.usd_per_hour) for s in stages],
    }
