"""Meter benchmark: what a fast token really costs in engine time, against a standard one.

    python benchmarks/meter.py           # full run: about 5 min on a quiet 2-core machine
    python benchmarks/meter.py --quick   # a smaller load, for development; writes benchmarks/out/ only

One engine, the real step model, the meter attributing every step (tollway/meter/). The same
saturating workload of standard and batch requests, arriving interleaved, runs three ways:
under the lanes policy with fast requests in it, under FCFS (the lanes off) with the same
fast requests, and under the lanes with no fast traffic. The fast premium is fast engine cost per output token over
standard's, measured in the same run; it is set against the price card's premium.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from tqdm import tqdm  # noqa: E402

from common import machine_info, run_benchmark, targets_line, text_prompts  # noqa: E402
from tollway.config import EngineConfig, SchedulerConfig  # noqa: E402
from tollway.engine import Engine  # noqa: E402
from tollway.meter.ledger import Ledger  # noqa: E402
from tollway.meter.meter import Meter  # noqa: E402
from tollway.meter.price_card import PriceCard  # noqa: E402
from tollway.meter.tab import Tab  # noqa: E402
from tollway.model.weights import load_weights  # noqa: E402
from tollway.request import SamplingParams  # noqa: E402

FULL = dict(standard=48, batch=16, fast=8, prompt_len=96, new_tokens=64, price_per_hour=2.5)
QUICK = dict(standard=12, batch=4, fast=3, prompt_len=32, new_tokens=16, price_per_hour=2.5)
SCENARIOS = (("lanes", "lanes", True), ("fcfs", "fcfs", True), ("lanes_no_fast", "lanes", False))


def run_scenario(engine: Engine, policy: str, with_fast: bool, settings: dict, meter: Meter) -> dict:
    """Every request added at once (a saturated engine), run to the end; per tier totals."""
    params = SamplingParams(temperature=0, max_tokens=settings["new_tokens"], ignore_eos=True)
    counts = {"standard": settings["standard"], "batch": settings["batch"], "fast": settings["fast"] if with_fast else 0}
    prompts = iter(text_prompts(sum(counts.values()), settings["prompt_len"], len(policy) + with_fast))
    # Arrivals interleave the tiers evenly, so that under FCFS no tier is left alone at the tail.
    order = sorted(((i + 0.5) / n, tier) for tier, n in counts.items() for i in range(n))
    tabs = {tier: [] for tier in counts}  # each request's meter tab, by its tier
    for _, tier in order:
        tabs[tier].append(Tab())
        engine.submit(engine.check(next(prompts), params), tier, tab=tabs[tier][-1])
    total = sum(counts.values()) * settings["new_tokens"]
    steps = 0
    with tqdm(total=total, desc=f"{policy}{'' if with_fast else ' (no fast)'}", unit="tok", leave=False) as bar:
        while engine.has_unfinished():
            report = engine.step()
            meter.on_step(report)
            bar.update(sum(len(o.new_token_ids) for o in report.outputs))
            steps += 1
    per_tier = {}
    for tier, n in counts.items():
        if n:
            engine_seconds = sum(tab.seconds for tab in tabs[tier])
            per_tier[tier] = {"requests": n, "output_tokens": n * settings["new_tokens"], "engine_seconds": engine_seconds,
                              "cost_per_m_output": meter.cost(engine_seconds) / (n * settings["new_tokens"]) * 1e6}
    return {"steps": steps, "busy_seconds": meter.busy_seconds, "attributed_seconds": meter.attributed_seconds,
            "readiness_unbilled_seconds": meter.readiness_seconds, "tiers": per_tier}


def run(settings: dict, quick: bool) -> dict:
    loaded = load_weights()
    tiers = SchedulerConfig().tiers
    card = PriceCard(settings["price_per_hour"], tiers)
    result = {"machine": machine_info(), "settings": settings, "scenarios": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, policy, with_fast in SCENARIOS:
            engine = Engine(EngineConfig(scheduler=SchedulerConfig(policy=policy)), progress=False, loaded=loaded)
            meter = Meter(card, Ledger(Path(tmp) / f"{name}.sqlite"))
            result["scenarios"][name] = run_scenario(engine, policy, with_fast, settings, meter)
            del engine  # its KV cache goes before the next one's
    result["price_card_premium"] = tiers["fast"].price_output_per_m / tiers["standard"].price_output_per_m
    result["summary"] = summarize(result)
    return result


def summarize(r: dict) -> dict:
    s = r["scenarios"]

    def per_token(scenario: str, tier: str) -> float:
        return s[scenario]["tiers"][tier]["cost_per_m_output"]

    premium_lanes = per_token("lanes", "fast") / per_token("lanes", "standard")
    premium_fcfs = per_token("fcfs", "fast") / per_token("fcfs", "standard")
    standard_ratio = per_token("lanes_no_fast", "standard") / per_token("fcfs", "standard")
    # Readiness held after the last fast request has no later fast request to bill: still counted.
    conservation = max(abs((x["attributed_seconds"] + x["readiness_unbilled_seconds"]) / x["busy_seconds"] - 1)
                       for x in s.values())
    return {
        "fast_premium_lanes": premium_lanes, "fast_premium_fcfs": premium_fcfs,
        "standard_no_fast_over_fcfs": standard_ratio, "conservation_error": conservation,
        "targets": {
            "lanes_fast_token_costs_more": premium_lanes > 1.0,
            "fcfs_fast_equals_standard_within_10pct": abs(premium_fcfs - 1) <= 0.10,
            "conserved_to_1e-9": conservation <= 1e-9,
        },
    }


def markdown(r: dict, raw: str) -> str:
    s, m, st = r["summary"], r["machine"], r["settings"]
    lines = [
        f"Measured with `python benchmarks/meter.py` on {m['cpu']} ({m['cores']} cores), torch {m['torch']}. "
        f"Raw figures: `{raw}`.",
        "",
        f"Workload, all at once: {st['standard']} standard and {st['batch']} batch requests, plus {st['fast']} fast "
        f"ones where the scenario has them; {st['prompt_len']}-token prompts, {st['new_tokens']} new tokens each. "
        f"Engine time at ${st['price_per_hour']:.2f}/hour.",
        "",
        "| scenario | steps | fast $/1M out | standard $/1M out | batch $/1M out | fast / standard |",
        "|---|---|---|---|---|---|",
    ]
    for name, x in r["scenarios"].items():
        t = x["tiers"]
        cell = lambda tier: f"{t[tier]['cost_per_m_output']:.4f}" if tier in t else "-"  # noqa: E731
        ratio = f"{t['fast']['cost_per_m_output'] / t['standard']['cost_per_m_output']:.2f}" if "fast" in t else "-"
        lines.append(f"| {name} | {x['steps']} | {cell('fast')} | {cell('standard')} | {cell('batch')} | {ratio} |")
    lines += [
        "",
        f"**Measured fast premium: {s['fast_premium_lanes']:.2f}x** engine cost per output token under the lanes "
        f"(the price card bills {r['price_card_premium']:.1f}x); {s['fast_premium_fcfs']:.2f}x with the lanes off. "
        f"With the fast lane empty, a standard token costs {s['standard_no_fast_over_fcfs']:.2f}x what it does under "
        f"FCFS (the lanes batch standard to its SLO instead; no premium is charged to anyone). "
        f"Attributed time, plus the readiness held after the last fast request "
        f"({r['scenarios']['lanes']['readiness_unbilled_seconds']:.1f} s, for a fast request yet to come), equals "
        f"busy time to {s['conservation_error']:.1e}.",
        "",
        targets_line(s["targets"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("meter", __doc__, run, markdown, FULL, QUICK)
