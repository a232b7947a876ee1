"""Simulator fidelity: one mixed-lane workload on the real engine, then in the simulator on
this machine's measured profile, compared per tier.

    python benchmarks/sim_fidelity.py          # about 22 min on a quiet 2-core machine
    python benchmarks/sim_fidelity.py --quick  # a smaller run, for development; writes benchmarks/out/ only
    python benchmarks/sim_fidelity.py --resimulate  # the simulator again, on the last run's profile and engine run

The profile comes from `tollway profile`'s measurement (the runner timed over a grid, its
jitter, the engine's own time per step), taken in the same run. The workload is a closed loop
of standard and fast users under the default lanes policy. Speculation is off on both sides:
the simulator's synthetic tokens give n-gram drafts nothing to find. Targets, per tier:
throughput and p50 TPOT within 10%, p99 TTFT within 25%. Writes benchmarks/sim_fidelity.json
(results for the full run) and a section of benchmarks/README.md.

A simulated run draws every step's jitter at random, and a few hundred requests' p50 and p99
move with the draw (standard TPOT p50 by ±9% here). So the simulator runs SIM_SEEDS times with
different draws; the error is that of their mean, and the range is reported beside it. The
engine's side is one draw, so it runs 480 requests: with 240, standard's p99 TTFT was its
third-longest wait, and its eight longest all queued in one 16-second stretch.

Both sides also report their steps (how many per second, their mean size and time), so that a
per-tier error can be traced to steps sized or timed otherwise.

This machine's speed drifts: grid steps timed again 15 minutes after a profile ran 13% faster
than in it, and during that run's engine half the runner took 1.15x the profile's fit for its
steps. A profile measured before the run is then a level off, whatever the simulator does. So
the engine run also measures that level (each step's runner time over the profile's fit for it,
averaged), and the simulator is judged with the profile's jitter scaled from its own mean to that
level: one number, from step times alone, never from the requests' figures. The errors of the
profile as measured are reported beside them.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from common import machine_info, targets_line, write_record  # noqa: E402
from tollway.config import EngineConfig, SchedulerConfig  # noqa: E402
from tollway.engine import Engine  # noqa: E402
from tollway.model.machine_profiler import Grid, measure  # noqa: E402
from tollway.scheduler.machine_profile import MachineProfile  # noqa: E402
from tollway.scheduler.step_model import StepTimeModel  # noqa: E402
from tollway.sim.engine_run import run_on_engine  # noqa: E402
from tollway.sim.simulator import simulate  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402
from tollway.traffic.results import stage_dict  # noqa: E402
from tollway.traffic.stats import SLO  # noqa: E402
from tollway.traffic.workload import Lengths, Workload  # noqa: E402

FULL = dict(users=24, requests=480, warmup=15.0, prompt=(64, 24, 16, 128), output=(48, 16, 16, 96),
            mix={"fast": 0.1, "standard": 0.9}, grid=None)
QUICK = dict(users=8, requests=40, warmup=5.0, prompt=(32, 8, 16, 48), output=(16, 4, 8, 24),
             mix={"fast": 0.2, "standard": 0.8}, grid=dict(decodes=(1, 8, 32), prefills=(0, 64), repeats=1))
TARGETS = {"throughput_rel_err": 0.10, "tpot_p50_rel_err": 0.10, "ttft_p99_rel_err": 0.25}
SIM_SEEDS = 32


def measure_real(s: dict, saved: Path) -> None:
    """The engine's half: the profile, then the workload on the engine; both saved, so the
    simulator's half can be rerun on them alone (--resimulate)."""
    machine, date = machine_info(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    scheduler = SchedulerConfig(speculative_tokens=0)
    engine = Engine(EngineConfig(scheduler=scheduler), progress=True)
    started = time.perf_counter()
    profile = measure(engine, Grid(**s["grid"]) if s["grid"] else Grid())
    profile_seconds = time.perf_counter() - started
    # Both sides plan from the model fitted to this profile (the engine's start-up profile is a
    # subset of it) and refit from their own steps: the check is of the simulated dynamics.
    engine.step_model = engine.scheduler.step_model = StepTimeModel.fit(profile.shapes())
    workload, load, limits = _workload(s)
    # How the runner's steps in the run compared with the profile's fit for them: the simulator
    # draws that ratio from the profile's jitter, so a machine that ran slower (or faster)
    # during the run than while profiled shows here.
    fitted, ratios = profile.step_model(adaptive=False), []
    real = stage_dict(run_on_engine(engine, workload, load, limits,
                                    on_step=lambda r: ratios.append(r.result.seconds / fitted.predict(r.plan.shape))),
                      SLO({}), None)
    saved.parent.mkdir(parents=True, exist_ok=True)
    # The engine's kernel crossover goes with the profile; the model bounds the context.
    saved.write_text(json.dumps({"machine": machine, "date": date,
                                 "profile": profile.to_dict(), "profile_seconds": profile_seconds,
                                 "max_model_len": engine.scheduler.config.max_model_len, "real": real,
                                 "runner_over_profile": statistics.fmean(ratios)}))


def _workload(s: dict) -> tuple[Workload, LoadPattern, Limits]:
    return (Workload(Lengths(*s["prompt"]), Lengths(*s["output"]), True, s["mix"], None, seed=11),
            LoadPattern(f"concurrency {s['users']}", concurrency=s["users"]),
            Limits(max_requests=s["requests"], warmup=s["warmup"]))


def run(s: dict, saved: Path) -> dict:
    """The simulator on the saved engine run's profile, twice: as profiled, and at the level the
    runner ran at during the engine run (see the module's docstring); judged on the second."""
    data = json.loads(saved.read_text())
    profile, profile_seconds, real = MachineProfile.from_dict(data["profile"]), data["profile_seconds"], data["real"]
    level = {"real": data["runner_over_profile"], "sim": statistics.fmean(profile.jitter)}
    at_run_level = dataclasses.replace(profile, jitter=[j * level["real"] / level["sim"] for j in profile.jitter])
    sim_config = SchedulerConfig(speculative_tokens=0, max_model_len=data["max_model_len"])
    judged, as_profiled = (_compare(real, _draws(sim_config, p, s, name)) for p, name in
                           ((at_run_level, "at the run's level"), (profile, "as profiled")))
    targets = {f"{tier}_{metric}_within_{limit:.0%}": (t[metric] is not None and t[metric] <= limit)
               for tier, t in judged["tiers"].items() for metric, limit in TARGETS.items()}
    simulated = judged.pop("first")
    as_profiled.pop("first")
    for stage in (real, simulated):
        stage.pop("requests")  # the figures are what is kept; the runs are repeatable
    workload, _, limits = _workload(s)
    return {"command": "python benchmarks/sim_fidelity.py", "machine": data["machine"], "date": data["date"],
            "settings": {**s, "workload": workload.to_dict(), "limits": asdict(limits)},
            "profile": {"hardware": profile.hardware, "steps": len(profile.samples), "overhead": profile.overhead,
                        "jitter_p90": sorted(profile.jitter)[int(0.9 * (len(profile.jitter) - 1))],
                        "seconds": profile_seconds},
            # the runner's time per step over the profile's fit: measured in the engine run; the jitter's mean
            "runner_over_profile": level,
            "sim_seeds": SIM_SEEDS, **judged, "as_profiled": as_profiled, "targets": targets,
            "real": real, "simulated": simulated}


def _draws(config: SchedulerConfig, profile: MachineProfile, s: dict, name: str) -> list[dict]:
    workload, load, limits = _workload(s)
    return [simulate(config, profile, workload, [load], limits, progress=False, seed=workload.seed + k)["stages"][0]
            for k in tqdm(range(SIM_SEEDS), desc=f"simulating {name}", unit="run")]


def _compare(real: dict, runs: list[dict]) -> dict:
    """Per tier, the real figure, the draws' mean and range, and the mean's relative error; the
    steps of both sides; and the first draw's whole stage."""
    def figures(summary: dict, tier: str) -> dict:
        t = summary["tiers"].get(tier)
        return {"throughput": t and t["output_tok_s"], "tpot_p50": t and t["tpot"]["p50"], "ttft_p99": t and t["ttft"]["p99"]}

    tiers = {}
    for tier in sorted(real["summary"]["tiers"]):
        drawn = [figures(run["summary"], tier) for run in runs]
        tiers[tier] = {"requests": real["summary"]["tiers"][tier]["completed"]}
        for name, measured in figures(real["summary"], tier).items():
            sims = [d[name] for d in drawn if d[name] is not None]
            sim = sum(sims) / len(sims) if sims else None
            tiers[tier] |= {f"{name}_real": measured, f"{name}_sim": sim,
                            f"{name}_sim_range": [min(sims), max(sims)] if sims else None,
                            f"{name}_rel_err": abs(sim - measured) / measured if measured and sim is not None else None}
    steps = {"real": step_figures(real), "sim": _mean_figures([step_figures(r) for r in runs])}
    return {"tiers": tiers, "steps": steps, "first": runs[0]}


def step_figures(stage: dict) -> dict | None:
    """The run's steps in all: how many per second, and their mean size and time. Where the
    per-tier figures differ, these say whether the simulated steps were sized or timed otherwise."""
    series = stage["steps"]
    n = sum(p["steps"] for p in series)
    if not n:
        return None
    return {"steps_per_s": n / (stage["end"] - stage["start"]),
            **{k: sum(p[k] * p["steps"] for p in series) / n for k in ("seqs_per_step", "tokens_per_step", "seconds_per_step")}}


def _mean_figures(figures: list[dict | None]) -> dict | None:
    drawn = [f for f in figures if f]
    return {k: sum(f[k] for f in drawn) / len(drawn) for k in drawn[0]} if drawn else None


def markdown(r: dict, raw: str) -> str:
    m, s, level = r["machine"], r["settings"], r["runner_over_profile"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {m['cpu']} ({m['cores']} cores). Raw: `{raw}`.",
        "",
        f"Workload: {s['users']} closed-loop users (tiers {', '.join(f'{t} {v:.0%}' for t, v in s['mix'].items())}), "
        f"prompts {s['prompt'][0]}±{s['prompt'][1]} tokens, outputs {s['output'][0]}±{s['output'][1]}, "
        f"{s['requests']} measured requests after {s['warmup']:.0f} s; lanes policy, speculation off. The simulator ran "
        f"on the profile `tollway profile` measured in the same run ({r['profile']['steps']} steps, "
        f"{r['profile']['seconds']:.0f} s), {r['sim_seeds']} times with different jitter draws: sim is their mean "
        f"(range in brackets), err is the mean's.",
        "",
        f"During the engine run the runner took {level['real']:.2f}x the profile's fitted time for each step on "
        f"average; the profile's jitter, which the simulator draws, averages {level['sim']:.2f}x. Judged: the "
        f"simulator with the jitter scaled to the run's level ({level['real'] / level['sim']:.2f}x):",
        "",
        *_table(r),
        "",
        "As profiled (the jitter unscaled):",
        "",
        *_table(r["as_profiled"]),
        "",
        targets_line(r["targets"]),
    ]
    return "\n".join(lines)


def _table(compared: dict) -> list[str]:
    lines = ["| tier | requests | output tok/s real / sim | err | TPOT p50 ms real / sim | err | TTFT p99 ms real / sim | err |",
             "|---|---|---|---|---|---|---|---|"]
    for tier, t in compared["tiers"].items():
        def cell(name, scale=1.0, fmt=".1f"):
            real, sim, (lo, hi) = t[f"{name}_real"], t[f"{name}_sim"], t[f"{name}_sim_range"] or (None, None)
            both = (f"{real * scale:{fmt}} / {sim * scale:{fmt}} [{lo * scale:{fmt}}–{hi * scale:{fmt}}]"
                    if real is not None and sim is not None else "–")
            err = t[f"{name}_rel_err"]
            return f"{both} | {'–' if err is None else f'{err:.0%}'}"
        lines.append(f"| {tier} | {t['requests']} | {cell('throughput')} | {cell('tpot_p50', 1e3, '.0f')} | "
                     f"{cell('ttft_p99', 1e3, '.0f')} |")
    real, sim = compared["steps"]["real"], compared["steps"]["sim"]
    if real and sim:
        lines += ["", "Steps, real / sim: " + ", ".join(
            f"{name} {real[k] * scale:{fmt}} / {sim[k] * scale:{fmt}}" for name, k, scale, fmt in (
                ("steps/s", "steps_per_s", 1, ".2f"), ("sequences per step", "seqs_per_step", 1, ".1f"),
                ("tokens per step", "tokens_per_step", 1, ".1f"), ("ms per step", "seconds_per_step", 1e3, ".0f"))) + "."]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run for development; writes benchmarks/out/ only")
    parser.add_argument("--resimulate", action="store_true",
                        help="rerun only the simulator, on the profile and engine run the last run saved")
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    settings = QUICK if args.quick else FULL
    saved = here / "out" / f"sim_fidelity-real{'-quick' if args.quick else ''}.json"
    if not args.resimulate:
        measure_real(settings, saved)
    elif not saved.exists():
        parser.error(f"--resimulate needs {saved.relative_to(here)} from an earlier run")
    print(write_record("sim_fidelity", run(settings, saved), args.quick, markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
