"""What a stage's request records add up to, per tier and over all: latency percentiles,
throughput, goodput under SLOs, errors by kind, and cost per million tokens.

Definitions (those of `vllm bench serve`): TTFT is sent to first text; E2E is sent to the last
byte; TPOT is (E2E - TTFT) / (output tokens - 1), per request; ITL is the gap between text
chunks; tok/s per user is 1 / TPOT. Throughput divides by the measured window: the first
measured request's send to the last one's end.
"""
from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass

from tollway.traffic.records import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2e")
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    return _at(sorted(values), q) if values else None


def _at(ordered: list[float], q: float) -> float:
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)  # once: a large simulation's inter-token gaps are millions
    out = {"mean": sum(values) / len(values) if values else None}
    out.update((name, _at(ordered, q) if ordered else None) for name, q in QUANTILES)
    return out


@dataclass
class SLO:
    """Per-tier limits in seconds; a tier not named uses the limits given without a tier."""

    limits: dict[str, dict[str, float]]  # tier or "*" -> metric -> seconds

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """'ttft=500ms,tpot=50ms,fast:tpot=20ms' (units ms or s; bare numbers are seconds)."""
        limits: dict[str, dict[str, float]] = {}
        for item in filter(None, (p.strip() for p in (text or "").split(","))):
            key, _, value = item.partition("=")
            tier, _, metric = key.rpartition(":")
            if metric not in SLO_METRICS or not value:
                raise ValueError(f"--slo: expected [tier:]{'|'.join(SLO_METRICS)}=VALUE(ms|s), got {item!r}")
            limits.setdefault(tier or "*", {})[metric] = _seconds(value, item)
        return cls(limits)

    def for_tier(self, tier: str) -> dict[str, float]:
        return {**self.limits.get("*", {}), **self.limits.get(tier, {})}

    def met(self, record: RequestRecord) -> bool:
        values = request_latencies(record)
        return record.ok and all(values.get(m) is not None and values[m] <= limit
                                 for m, limit in self.for_tier(record.tier).items())


def _seconds(value: str, item: str) -> float:
    try:
        seconds = float(value[:-2]) / 1e3 if value.endswith("ms") else float(value.removesuffix("s"))
    except ValueError:
        raise ValueError(f"--slo: cannot read the time in {item!r}") from None
    if not seconds > 0:
        raise ValueError(f"--slo: limits must be > 0, got {item!r}")
    return seconds


def request_latencies(r: RequestRecord) -> dict[str, float | None]:
    if not r.ok:
        return {"ttft": None, "tpot": None, "e2e": None}
    if r.first_token is None:  # completed without text (e.g. only tokens that decode to nothing)
        return {"ttft": None, "tpot": None, "e2e": r.end - r.sent}
    tpot = (r.end - r.first_token) / (r.output_tokens - 1) if (r.output_tokens or 0) > 1 else None
    return {"ttft": r.first_token - r.sent, "tpot": tpot, "e2e": r.end - r.sent}


def summarize(records: list[RequestRecord], slo: SLO, usd_per_hour: float | None) -> dict:
    """{'window': seconds, 'all': {...}, 'tiers': {tier: {...}}} over the measured records."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        return {"window": 0.0, "all": _metrics([], 0.0, slo, None), "tiers": {}}
    window = max(r.end for r in measured) - min(r.sent for r in measured)
    machine_cost = usd_per_hour * window / 3600 if usd_per_hour is not None else None
    tiers = sorted({r.tier for r in measured})
    return {
        "window": window,
        "all": _metrics(measured, window, slo, machine_cost),
        "tiers": {t: _metrics([r for r in measured if r.tier == t], window, slo,
                              _tier_share(measured, t, machine_cost), priced=machine_cost is not None)
                  for t in tiers},
    }


def _gaps(records: list[RequestRecord]) -> list[float]:
    """Every gap between consecutive chunks (map, not a comprehension: millions, simulated)."""
    gaps: list[float] = []
    for r in records:
        gaps.extend(map(operator.sub, r.chunk_times[1:], r.chunk_times))
    return gaps


def _tier_share(records: list[RequestRecord], tier: str, machine_cost: float | None) -> float | None:
    """A tier's part of the machine's cost: all of it for a lone tier; else split by the engine
    time the server metered to each (tollway's usage.engine_seconds); unknown otherwise."""
    if machine_cost is None:
        return None
    if all(r.tier == tier for r in records):
        return machine_cost
    done = [r for r in records if r.ok]
    if not done or any(r.engine_seconds is None for r in done):
        return None
    total = sum(r.engine_seconds for r in done)
    return machine_cost * sum(r.engine_seconds for r in done if r.tier == tier) / total if total > 0 else None


def _metrics(records: list[RequestRecord], window: float, slo: SLO, machine_cost: float | None,
             priced: bool | None = None) -> dict:
    """`machine_cost`: these records' part of the machine's price over the window. Where the
    machine is `priced` (by default: where that part is known), that is the cost, known or
    not; otherwise the cost is the server's own usage.cost, summed."""
    done = [r for r in records if r.ok]
    latencies = [request_latencies(r) for r in done]
    output = sum(r.output_tokens or 0 for r in done)
    prompt = sum(r.prompt_tokens or 0 for r in done)
    tpots = [x["tpot"] for x in latencies if x["tpot"]]
    per_second = (lambda n: n / window) if window > 0 else (lambda n: None)
    server_costs = [r.cost for r in done if r.cost is not None]
    server_cost = sum(server_costs) if done and len(server_costs) == len(done) else None
    # The machine's price, where given, includes its idle time; the server's cost is engine time.
    priced = machine_cost is not None if priced is None else priced
    cost, cost_source = (machine_cost, "usd_per_hour") if priced else (server_cost, "server")
    engine = [r.engine_seconds for r in done if r.engine_seconds is not None]
    good = sum(slo.met(r) for r in done)
    return {
        "requests": len(records), "completed": len(done),
        "errors": dict(Counter(r.error for r in records if r.error)),
        "prompt_tokens": prompt, "output_tokens": output,
        "ttft": distribution([x["ttft"] for x in latencies if x["ttft"] is not None]),
        "tpot": distribution(tpots),
        "e2e": distribution([x["e2e"] for x in latencies]),
        "itl": distribution(_gaps(done)),
        "tok_s_per_user": distribution([1 / t for t in tpots]),
        "requests_per_s": per_second(len(done)), "output_tok_s": per_second(output),
        "total_tok_s": per_second(output + prompt),
        # Mean requests in flight: each request's time, over the window (Little's law).
        "concurrency": per_second(sum(r.end - r.sent for r in records)),
        "goodput_requests_per_s": per_second(good) if slo.limits else None,
        "goodput_share": good / len(records) if slo.limits and records else None,
        # Engine time the server attributed to these requests (tollway's usage.engine_seconds).
        "engine_seconds": sum(engine) if done and len(engine) == len(done) else None,
        "cost": cost, "cost_source": cost_source if cost is not None else None,
        "cost_per_m_output": cost / output * 1e6 if cost is not None and output else None,
        "cost_per_m_total": cost / (output + prompt) * 1e6 if cost is not None and output + prompt else None,
        "cost_per_request": cost / len(done) if cost is not None and done else None,
    }
