"""The server's step size over time, read from its Prometheus `/metrics` while a stage runs:
tollway exposes sequences and tokens per step as histograms, so the change in their sums and
counts between two scrapes is the mean step in that interval. A server without them (vLLM,
llama.cpp, a hosted API) simply yields no points."""
from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

_SERIES = {"tollway:step_num_sequences": "seqs", "tollway:step_num_tokens": "tokens", "tollway:step_seconds": "seconds"}


def read_step_totals(text: str) -> dict[str, float] | None:
    """{'steps', 'seqs', 'tokens', 'seconds'} summed since the server started; None without them."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = _SERIES.get(family.name)
        if name is None:
            continue
        totals.setdefault(name, 0.0)  # a labelled histogram has no samples before its first step
        totals.setdefault("steps", 0.0)
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                totals[name] = totals.get(name, 0.0) + sample.value
            elif sample.name.endswith("_count") and name == "seqs":
                totals["steps"] = totals.get("steps", 0.0) + sample.value
    return totals if {"steps", "seqs", "tokens", "seconds"} <= set(totals) else None


class StepScraper:
    def __init__(self, http: aiohttp.ClientSession, base_url: str, interval: float = 1.0):
        self.http, self.url, self.interval = http, base_url.rstrip("/") + "/metrics", interval
        self._points: list[dict] = []
        self._last: tuple[float, dict] | None = None
        self.available = True

    async def scrape(self, clock) -> None:
        try:
            async with self.http.get(self.url, timeout=aiohttp.ClientTimeout(total=5.0)) as response:
                totals = read_step_totals(await response.text()) if response.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            totals = None
        if totals is None:
            self.available = False
            return
        now = clock()
        if self._last is not None:
            then, before = self._last
            steps = totals["steps"] - before["steps"]
            if steps > 0:
                self._points.append({
                    "t": now, "interval": now - then, "steps": steps,
                    "seqs_per_step": (totals["seqs"] - before["seqs"]) / steps,
                    "tokens_per_step": (totals["tokens"] - before["tokens"]) / steps,
                    "seconds_per_step": (totals["seconds"] - before["seconds"]) / steps,
                })
        self._last = (now, totals)

    async def run(self, clock) -> None:
        while self.available:
            await self.scrape(clock)
            await asyncio.sleep(self.interval)

    async def finish(self, task: asyncio.Task, clock) -> list[dict]:
        """Stop `task` (run), scrape once more, and hand over the stage's points."""
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        if self.available:
            await self.scrape(clock)
        points, self._points, self._last = self._points, [], None
        return points
