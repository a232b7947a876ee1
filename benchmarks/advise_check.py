"""The mode advisor against a real run: `tollway advise` on this machine's profile recommends a
lane for each class of a mixed workload; then every class's traffic runs at once, each in its
recommended lane, against `tollway serve`, and is judged as the advisor judged it.

    python benchmarks/advise_check.py          # about 4 min on a 2-core machine
    python benchmarks/advise_check.py --quick  # about 1 min, for development; writes benchmarks/out/ only
    python benchmarks/advise_check.py --profile tollway-profile.json  # reuse a profile instead of measuring one

The profile is `tollway profile`, measured at the start of the run (this machine's speed
drifts; see sim_fidelity.py); `--quick` takes `tollway profile --quick`, whose single timing of
each step keeps the first, cold run of the warm-up shapes (a 16-sequence decode at 227 ms beside
27 ms in the grid) and so predicts far slower steps than the engine takes. Either profile's
jitter, which the simulator draws for every step, also holds those cold runs (4 of 156 draws
3.9-16.6x the fit in the run recorded): the advisor's TTFT and TPOT p99 then come out pessimistic.

The advisor simulates the classes' rates for as long as the real run measures them, priced at
the meter's default $/hour, so its cost per 1M output tokens and the server's usage.cost are the
same engine seconds at the same price. The real run sends each class as its own open loop
(Poisson arrivals at its rate, its lengths, `ignore_eos`) through `tollway bench`'s stage loop,
all in one event loop against one server, with the lane's OpenAI name as service_tier (priority,
default, flex). The first seconds warm the server up and are not measured; the advisor's trace
starts from idle. Speculation is off on both sides: the simulator does not draft, and n-gram
drafts on the bench's repetitive greedy replies would make the fast lane faster than any
simulation of it.

Targets, per class: where the advisor predicted that its lane meets the class's SLOs, the
measured TTFT and TPOT at the class's percentile meet them too; the measured cost per 1M output
tokens is within 15% of the predicted. Writes benchmarks/results/advise_check.json and a
section of benchmarks/README.md.
"""
from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from bench_example import free_port  # noqa: E402
from common import machine_info, run_benchmark, targets_line  # noqa: E402
from vs_llamacpp import _tollway_command, _tollway_source, serving  # noqa: E402
from tollway.bench.client import OpenAIClient, now_clock  # noqa: E402
from tollway.bench.load import run_stage  # noqa: E402
from tollway.checkpoint import DEFAULT_MODEL, tokenizer_path  # noqa: E402
from tollway.config import TIERS, MeterConfig, load_config  # noqa: E402
from tollway.scheduler.machine_profile import MachineProfile  # noqa: E402
from tollway.tier_names import WIRE_NAME  # noqa: E402
from tollway.sim import advice_report  # noqa: E402
from tollway.sim.advisor import Advisor, ClassAdvice, judge_class  # noqa: E402
from tollway.sim.traffic_classes import TrafficClass, make_class  # noqa: E402
from tollway.text.tokenizer import Tokenizer  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402
from tollway.traffic.records import RequestRecord  # noqa: E402
from tollway.traffic.stats import SLO, summarize  # noqa: E402
from tollway.traffic.workload import Requests, Workload  # noqa: E402

# name, req/s, prompt tokens, output tokens, SLO (at p99): chat needs the first token soon and
# a steady per-token speed, which bulk's long prompts deny it outside the fast lane (their
# prefill chunks land in its steps; on a profile of this run's kind the advisor predicts chat's
# TTFT p99 at about 0.8 s and TPOT p99 at about 43 ms in standard, 80 ms and 15 ms in fast);
# bulk only needs to finish. Chosen well short of this machine's capacity: near it (bulk with
# 256-token replies at 1.5 req/s) the run's latencies and costs followed the machine's drift more
# than the advisor. With chat's TPOT at 30 ms beside short bulk work both classes went to batch
# (recorded before 2026-12-02), which checked no fast-lane prediction.
CLASSES = [("chat", 0.5, "64", "64", "ttft=500ms,tpot=30ms"),
           ("bulk", 0.3, "mean=768,stdev=128,min=256,max=2048", "64", "ttft=60s,tpot=2s")]
FULL = dict(classes=CLASSES, seconds=150.0, warmup=10.0, profile_flags=[])
QUICK = dict(classes=CLASSES, seconds=40.0, warmup=5.0, profile_flags=["--quick"])
COST_TOLERANCE = 0.15
# Only speculation differs from the defaults `tollway serve` runs with (see the docstring).
SERVER_CONFIG = "[scheduler]\nspeculative_tokens = 0\n"


def run(settings: dict, quick: bool) -> dict:
    machine, source = machine_info(), _tollway_source()  # before anything runs: others may commit meanwhile
    classes = [make_class(name, rate, prompt, output, slo, 99, TIERS, f"class {name}")
               for name, rate, prompt, output, slo in settings["classes"]]
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    config = out / "advise_check-engine.toml"
    config.write_text(SERVER_CONFIG)
    profile_path = Path(settings["profile"]) if settings["profile"] else _measure_profile(config, out, settings)
    profile = MachineProfile.load(profile_path)
    profile.usd_per_hour = MeterConfig().price_per_hour  # what the server's meter charges an engine hour
    requests = round(sum(c.rate for c in classes) * settings["seconds"])
    advice = Advisor(load_config(config).scheduler, profile, classes, requests=requests).advise()
    lanes = [c.lane or "standard" for c in advice.classes]  # a class no lane serves runs in standard
    with tempfile.TemporaryDirectory(prefix="tollway-advise-check-") as tmp:
        tmp, port = Path(tmp), free_port()
        command = [*_tollway_command(DEFAULT_MODEL, DEFAULT_MODEL, port, tmp, os.cpu_count()), "--config", str(config)]
        with serving("tollway", command, port, tmp / "tollway.log"):
            load_average = {"start": os.getloadavg()[0]}
            records = asyncio.run(_traffic(f"http://127.0.0.1:{port}", classes, lanes, settings))
            load_average["end"] = os.getloadavg()[0]
    checked = [_check(c, lane, advice.classes[i], records[c.name]) for i, (c, lane) in enumerate(zip(classes, lanes))]
    return {"command": "python benchmarks/advise_check.py" + (" --quick" if quick else "")
                       + (f" --profile {settings['profile']}" if settings["profile"] else ""),
            "date": datetime.date.today().isoformat(), "machine": machine, "tollway_source": source,
            "settings": {"seconds": settings["seconds"], "warmup": settings["warmup"], "server_config": SERVER_CONFIG,
                         "profile_flags": settings["profile_flags"], "cost_tolerance": COST_TOLERANCE},
            "profile": {"path": os.path.relpath(profile_path, ROOT), "steps": len(profile.samples),
                        "hardware": profile.hardware, "usd_per_hour": profile.usd_per_hour},
            "load_average": load_average, "advice": advice.to_dict(),
            "advice_summary": advice_report.summary_line(advice), "classes": checked,
            "targets": {name: ok for c in checked for name, ok in c["targets"].items()}}


def _measure_profile(config: Path, out: Path, settings: dict) -> Path:
    path = out / "advise_check-profile.json"
    # Its own process, so that its engine's memory is gone before the server starts; run from the
    # checkout's root, `python -m` imports this checkout's tollway.
    subprocess.run([sys.executable, "-m", "tollway", "profile", *settings["profile_flags"], "--config", str(config),
                    "--output", str(path)], cwd=ROOT, check=True)
    return path


async def _traffic(url: str, classes: list[TrafficClass], lanes: list[str],
                   settings: dict) -> dict[str, list[RequestRecord]]:
    """Every class's open loop at once, in its lane; its measured records by class."""
    tokenizer = Tokenizer.load(tokenizer_path(DEFAULT_MODEL))
    client, clock = OpenAIClient(url, DEFAULT_MODEL), now_clock()
    counts = [round(c.rate * settings["seconds"]) for c in classes]
    try:
        with tqdm(total=sum(counts), desc="the classes' traffic", unit="req") as bar:
            stages = await asyncio.gather(*(
                run_stage(client, Requests(Workload(c.prompt, c.output, True, {lane: 1.0}, seed=31 * k + 5),
                                           tokenizer),
                          LoadPattern(c.name, rate=c.rate), Limits(max_requests=n, warmup=settings["warmup"]), clock,
                          on_record=lambda r: r.warmup or bar.update())
                for k, (c, lane, n) in enumerate(zip(classes, lanes, counts))))
    finally:
        await client.close()
    measured = {c.name: [r for r in s.records if not r.warmup] for c, s in zip(classes, stages)}
    for name, records in measured.items():
        if not any(r.error is None for r in records):  # a run that served nothing judges nothing
            raise SystemExit(f"advise_check: class {name} completed no request; errors: "
                             f"{sorted({r.error_message for r in records})[:3]}")
    return measured


def _check(c: TrafficClass, lane: str, advised: ClassAdvice, records: list[RequestRecord]) -> dict:
    """The class's measured outcome beside the advisor's prediction for its lane, and its targets."""
    predicted = advised.lanes[lane]
    summary = summarize(records, SLO({}), None)["all"]  # no machine price: the cost is usage.cost
    measured = judge_class(c, lane, records, summary["cost_per_m_output"])
    cost_err = (abs(measured.cost_per_m_output - predicted.cost_per_m_output) / predicted.cost_per_m_output
                if measured.cost_per_m_output and predicted.cost_per_m_output else None)
    targets = {f"{c.name}_cost_within_{COST_TOLERANCE:.0%}": cost_err is not None and cost_err <= COST_TOLERANCE}
    if advised.lane is not None:
        targets[f"{c.name}_meets_its_slo_in_{lane}"] = measured.meets
    return {"class": c.to_dict(), "lane": lane, "service_tier": WIRE_NAME[lane], "advised": advised.lane,
            "requests": len(records), "completed": summary["completed"], "errors": summary["errors"],
            "output_tokens": summary["output_tokens"], "predicted": predicted.to_dict(), "measured": measured.to_dict(),
            "cost_rel_err": cost_err, "targets": targets}


def markdown(r: dict, raw: str) -> str:
    m, s, source = r["machine"], r["settings"], r["tollway_source"]
    dirty = f" with uncommitted changes to {len(source['uncommitted'])} files" if source["uncommitted"] else ""
    rows = []
    for x in r["classes"]:
        c, p, q = x["class"], x["predicted"], x["measured"]
        slo = ", ".join(f"{metric} {limit * 1e3:.0f} ms" for metric, limit in c["slo"].items())
        err = "–" if x["cost_rel_err"] is None else f"{x['cost_rel_err']:.0%}"
        rows.append(f"| {c['name']} | {c['rate']:g} | {slo} at p{c['percentile'] * 100:g} | {x['lane']} "
                    f"({x['service_tier']}) | {x['completed']}/{x['requests']} | "
                    f"{_ms(p['ttft_p99'])} / {_ms(q['ttft_p99'])} | {_ms(p['tpot_p99'])} / {_ms(q['tpot_p99'])} | "
                    f"{_usd(p['cost_per_m_output'])} / {_usd(q['cost_per_m_output'])} | {err} | "
                    f"{_verdict(p['meets'])} / {_verdict(q['meets'])} |")
    workload = "; ".join(f"{c['name']} {c['rate']:g} req/s, prompts {_lengths(c['prompt'])}, "
                         f"outputs {_lengths(c['output'])} tokens" for c in (x["class"] for x in r["classes"]))
    return (f"Measured {r['date']} with `{r['command']}` on {m['cpu']} ({m['cores']} cores; "
            f"{', '.join(m['isa_flags'])}), torch {m['torch']}; tollway at {source['commit'][:10]}{dirty}. "
            f"Load average {r['load_average']['start']:.1f} when the traffic started, {r['load_average']['end']:.1f} "
            f"when it ended. Raw: `{raw}`.\n\n"
            f"Classes: {workload}; Poisson arrivals, `ignore_eos`. `tollway advise` simulated them on this "
            f"machine's profile (`{r['profile']['path']}`, {r['profile']['steps']} steps) at "
            f"${r['profile']['usd_per_hour']:.2f}/hour (the meter's default), {r['advice']['requests']} requests "
            f"({s['seconds']:.0f} s of the rates): {r['advice_summary']}. Then `tollway serve` (speculation off "
            f"on both sides) took every class's traffic at once, each in its recommended lane, for "
            f"{s['seconds']:.0f} s measured after {s['warmup']:.0f} s of warm-up; cost is the meter's usage.cost.\n\n"
            "| class | req/s | SLO | lane (service_tier) | completed | TTFT p99 ms predicted / measured | "
            "TPOT p99 ms predicted / measured | $/1M out predicted / measured | cost err | "
            "SLO predicted / measured |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + f"\n\n{targets_line(r['targets'])}")


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.0f}"


def _usd(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


def _verdict(meets: bool) -> str:
    return "meets" if meets else "misses"


def _lengths(x: dict) -> str:
    return str(x["mean"]) if not x["stdev"] else f"{x['mean']}±{x['stdev']:g}"


if __name__ == "__main__":
    run_benchmark("advise_check", __doc__, run, markdown, FULL, QUICK, options={"profile": dict(
        help="a profile JSON from `tollway profile` to reuse (default: measure one first)")})
