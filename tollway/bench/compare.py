"""`tollway compare`: one workload run twice, all fast against all standard on one server (or
the same tier on two servers), and the side-by-side table operators ask for: throughput,
latency percentiles, machine time, cost per request and per 1k tokens, and the premium."""
from __future__ import annotations

import copy
from dataclasses import dataclass

from rich.table import Table

from tollway.bench.run import BenchConfig
from tollway.traffic.console import fmt_ms, fmt_num


@dataclass
class Side:
    label: str
    config: BenchConfig


def sides(base: BenchConfig, urls: list[str], tiers: list[str]) -> list[Side]:
    """Two runs of `base`: on two URLs (its tier mix each), or on one URL, all of each tier."""
    if len(urls) == 2:
        out = []
        for url in urls:
            config = copy.deepcopy(base)
            config.url, config.label = url, url
            out.append(Side(url, config))
        return out
    if len(urls) != 1 or len(tiers) != 2 or len(set(tiers)) != 2:
        raise ValueError("compare needs two --url values, or one --url and two different --tiers (e.g. fast,standard)")
    out = []
    for tier in tiers:
        config = copy.deepcopy(base)
        config.workload.mix, config.label = {tier: 1.0}, f"all {tier}"
        out.append(Side(f"all {tier}", config))
    return out


def side_figures(result: dict) -> dict:
    """One run's figures for the table: its heaviest stage, all tiers together."""
    stage = result["stages"][-1]
    m, window = stage["summary"]["all"], stage["summary"]["window"]
    # Machine time: what the server metered, else the whole window the run held the machine.
    gpu_seconds = m["engine_seconds"] if m["engine_seconds"] is not None else window
    tokens = m["output_tokens"] + m["prompt_tokens"]
    return {
        "output_tok_s": m["output_tok_s"], "tok_s_per_user": m["tok_s_per_user"]["mean"],
        "ttft_p50": m["ttft"]["p50"], "ttft_p99": m["ttft"]["p99"], "tpot_p50": m["tpot"]["p50"],
        "tpot_p99": m["tpot"]["p99"], "completed": m["completed"], "gpu_seconds": gpu_seconds,
        "gpu_seconds_per_request": gpu_seconds / m["completed"] if m["completed"] else None,
        "cost_per_request": m["cost_per_request"],
        "cost_per_1k_tokens": m["cost"] / tokens * 1e3 if m["cost"] is not None and tokens else None,
        "cost_per_1k_output": m["cost"] / m["output_tokens"] * 1e3 if m["cost"] is not None and m["output_tokens"] else None,
        "gpu_seconds_per_1k_output": gpu_seconds / m["output_tokens"] * 1e3 if m["output_tokens"] else None,
    }


def premium(a: dict, b: dict) -> float | None:
    """How many times b's cost an output token of a costs: in dollars where both have them,
    else in machine seconds."""
    for key in ("cost_per_1k_output", "gpu_seconds_per_1k_output"):
        if a[key] is not None and b[key]:
            return a[key] / b[key]
    return None


def table(labels: list[str], figures: list[dict]) -> Table:
    rows = (("output tok/s", "output_tok_s", fmt_num), ("tok/s per user", "tok_s_per_user", fmt_num),
            ("TTFT p50 ms", "ttft_p50", fmt_ms), ("TTFT p99 ms", "ttft_p99", fmt_ms),
            ("TPOT p50 ms", "tpot_p50", fmt_ms), ("TPOT p99 ms", "tpot_p99", fmt_ms),
            ("requests", "completed", lambda v: str(v)), ("GPU-seconds", "gpu_seconds", fmt_num),
            ("GPU-seconds per request", "gpu_seconds_per_request", lambda v: fmt_num(v, ".3f")),
            ("$ per request", "cost_per_request", lambda v: fmt_num(v, ".6f")),
            ("$ per 1k tokens", "cost_per_1k_tokens", lambda v: fmt_num(v, ".6f")))
    out = Table(title="tollway compare", title_justify="left")
    out.add_column("")
    for label in labels:
        out.add_column(label, justify="right")
    for name, key, fmt in rows:
        out.add_row(name, *(fmt(f[key]) for f in figures))
    factor = premium(figures[0], figures[1])
    out.add_row(f"premium ({labels[0]} / {labels[1]}, per output token)", fmt_num(factor, ".2f") + "x"
                if factor is not None else "–", "")
    return out
