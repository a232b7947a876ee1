"""Load patterns: a fixed concurrency (closed loop), a request rate (open loop, Poisson or gamma
with burstiness), and a sweep from one request at a time to saturation with rates in between,
as GuideLLM sweeps; bench drives them over HTTP, the simulator on simulated replicas."""
from __future__ import annotations

from dataclasses import dataclass

from tollway.traffic.records import RequestRecord


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


def pattern_from_args(concurrency: int | None, rate: float | None, burstiness: float) -> LoadPattern:
    if (concurrency is None) == (rate is None):
        raise ValueError("give one of --concurrency, --rate or --sweep")
    if concurrency is not None:
        if concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
        return LoadPattern(f"concurrency {concurrency}", concurrency=concurrency)
    if not rate > 0 or not burstiness > 0:
        raise ValueError("--rate and --burstiness must be > 0")
    return LoadPattern(f"rate {rate:g}/s", rate=rate, burstiness=burstiness)


def sweep_rates(synchronous_rps: float, saturated_rps: float, between: int) -> list[float]:
    """`between` request rates evenly spaced strictly between the two measured ends."""
    if between <= 0 or not saturated_rps > synchronous_rps:
        return []
    step = (saturated_rps - synchronous_rps) / (between + 1)
    return [synchronous_rps + step * (i + 1) for i in range(between)]
