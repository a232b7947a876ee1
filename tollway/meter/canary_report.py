"""The canary's comparison (`tollway report --canary`, /v1/usage/canary, the dashboard): its
promoted requests against its control over the same period, latency and money, each as a
ratio with a bootstrap 95% interval (bootstrap.py) and the n behind it."""
from __future__ import annotations

import numpy as np

from tollway.meter.bootstrap import ratio_interval
from tollway.meter.ledger import CONTROL, PROMOTED, LedgerRow
from tollway.meter.report import format_table

# The ledger keeps no per-token times, so a request's TPOT is derived from what it does keep.
TPOT_DERIVATION = "(e2e - ttft) / (completion_tokens - 1), for requests with 2+ output tokens"
LATENCIES = ("ttft", "tpot", "e2e")
MONEY = ("cost_per_request", "price_per_request", "cost_per_m_output", "price_per_m_output")


def _percentile(q: float):
    return lambda x: np.percentile(x, q, axis=-1)


def _mean(x: np.ndarray) -> np.ndarray:
    return x.mean(axis=-1)


def _per_m(dollars: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return dollars.sum(axis=-1) / tokens.sum(axis=-1) * 1e6


def _columns(rows: list[LedgerRow]) -> dict[str, tuple[np.ndarray, ...]]:
    """Each metric's input columns, from the rows that have it."""
    ttft = [r for r in rows if r.ttft_seconds is not None]
    multi = [r for r in ttft if r.completion_tokens >= 2]
    return {
        "ttft": (np.array([r.ttft_seconds for r in ttft], float),),
        "tpot": (np.array([(r.e2e_seconds - r.ttft_seconds) / (r.completion_tokens - 1) for r in multi], float),),
        "e2e": (np.array([r.e2e_seconds for r in rows], float),),
        "cost": (np.array([r.cost for r in rows], float),),
        "price": (np.array([r.price for r in rows], float),),
        "cost_tokens": (np.array([r.cost for r in rows], float), np.array([r.completion_tokens for r in rows], float)),
        "price_tokens": (np.array([r.price for r in rows], float),
                         np.array([r.completion_tokens for r in rows], float)),
    }


def _metrics():
    """(name, input columns, statistic) for every figure compared."""
    for latency in LATENCIES:
        for q in (50, 99):
            yield f"{latency}_p{q}", latency, _percentile(q)
    yield "cost_per_request", "cost", _mean
    yield "price_per_request", "price", _mean
    yield "cost_per_m_output", "cost_tokens", _per_m
    yield "price_per_m_output", "price_tokens", _per_m


def compare(rows: list[LedgerRow], seed: int = 0) -> dict:
    """Promoted against control: per metric both values, their ratio, its 95% interval, the n
    of each side and whether the interval excludes 1; and the one-line summary."""
    arms = {arm: _columns([r for r in rows if r.canary == arm]) for arm in (PROMOTED, CONTROL)}
    metrics = {}
    for name, column, statistic in _metrics():
        p, c = arms[PROMOTED][column], arms[CONTROL][column]
        n = {PROMOTED: len(p[0]), CONTROL: len(c[0])}
        figure = {PROMOTED: None, CONTROL: None, "ratio": None, "ci": None, "n": n, "significant": False}
        if min(n.values()) > 0:
            figure[PROMOTED], figure[CONTROL] = float(statistic(*p)), float(statistic(*c))
            figure["ratio"] = figure[PROMOTED] / figure[CONTROL] if figure[CONTROL] else None
        if figure["ratio"] is not None and min(n.values()) >= 2:
            figure["ci"] = ratio_interval(p, c, statistic, seed=seed)
            figure["significant"] = figure["ci"] is not None and not figure["ci"][0] <= 1 <= figure["ci"][1]
        metrics[name] = figure
    report = {"requests": {arm: sum(r.canary == arm for r in rows) for arm in (PROMOTED, CONTROL)},
              "canary_cost": sum(r.canary_cost for r in rows), "tpot": TPOT_DERIVATION, "metrics": metrics}
    report["summary"] = summary(report)
    return report


def summary(report: dict) -> str:
    """E.g. "fast mode cut TPOT p50 by 71% [64-77%] for 2.40x cost per output token [2.10-2.70x]"."""
    tpot, cost = report["metrics"]["tpot_p50"], report["metrics"]["cost_per_m_output"]
    if tpot["ratio"] is None or cost["ratio"] is None:
        return "fast mode: not enough promoted and control requests with 2+ output tokens to compare yet"
    cut = tpot["ratio"] < 1
    sign = -1 if cut else 1  # the change in the direction named, so a cut reads as a positive share
    percent = f"{sign * (tpot['ratio'] - 1):.0%}"
    if tpot["ci"] is not None:
        lo, hi = sorted(sign * (r - 1) for r in tpot["ci"])
        percent += f" [{lo:.0%}–{hi:.0%}]"
    times = f"{cost['ratio']:.2f}×"
    if cost["ci"] is not None:
        times += f" [{cost['ci'][0]:.2f}–{cost['ci'][1]:.2f}×]"
    caveat = "" if tpot["significant"] and cost["significant"] else " (not significant at 95%)"
    return (f"fast mode {'cut' if cut else 'raised'} TPOT p50 by {percent} for {times} engine cost per output token{caveat}; "
            f"n = {tpot['n'][PROMOTED]} promoted, {tpot['n'][CONTROL]} control")


def format_canary(report: dict) -> str:
    """The comparison as a table, then the TPOT note and the summary line."""
    rows = []
    for name, f in report["metrics"].items():
        money = name in MONEY
        change = None if f["ratio"] is None else (f"{f['ratio']:.2f}×" if money else f"{f['ratio'] - 1:+.0%}")
        ci = None if f["ci"] is None else (f"{f['ci'][0]:.2f}–{f['ci'][1]:.2f}×" if money
                                           else f"{f['ci'][0] - 1:+.0%} to {f['ci'][1] - 1:+.0%}")
        rows.append({"metric": name, PROMOTED: f[PROMOTED], CONTROL: f[CONTROL], "change": change, "95% CI": ci,
                     "n": f"{f['n'][PROMOTED]}/{f['n'][CONTROL]}", "significant": "yes" if f["significant"] else "no"})
    return "\n".join([format_table(rows), f"latencies in seconds, money in dollars; TPOT: {report['tpot']}",
                      f"canary cost (fast premium not billed): ${report['canary_cost']:.6f}", report["summary"]])
