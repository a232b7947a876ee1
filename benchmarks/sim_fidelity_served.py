"""The simulator's latencies against a served run: `tollway serve` over HTTP with streaming, at
30%, 60%, 90% and 110% of the machine's capacity, each lane's TTFT and TPOT at p50 and p99 and
the output tok/s, beside `tollway simulate` of the same workloads.

    python benchmarks/sim_fidelity_served.py          # about 15 min on a quiet 2-core machine
    python benchmarks/sim_fidelity_served.py --quick  # a smaller run, for development; writes benchmarks/out/ only

Two profiles are judged, each taken before the loads it predicts (and a third, the grid again
after the loads, is judged against the first: two profiles minutes apart should agree within 5%):
- the grid: `tollway profile` in its own process, the runner timed alone over a grid of steps;
- served: `tollway profile --from` the server, fitted to its own steps during closed loops of 2
  and 8 users and then the capacity run (a closed loop at saturation), the first things the
  server serves, so the server's own work on the cores (HTTP, streaming, detokenizing) and the
  machine's level that minute are in it, over small steps and large.

The workload is the issue's: Poisson arrivals, 10% fast, fixed prompt and output lengths,
`ignore_eos`, greedy, speculation off on both sides (the simulator does not draft). Capacity is
the capacity run's completed requests per second. Each load is simulated SIM_SEEDS times with
different jitter draws; a figure's simulated value is the draws' mean. Targets (the issue's):
every lane's TTFT and TPOT at p50 and p99 within 10%, output tok/s within 5%.
"""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from bench_example import free_port  # noqa: E402
from common import machine_info, run_benchmark, targets_line  # noqa: E402
from sim_fidelity import step_figures  # noqa: E402
from vs_llamacpp import _tollway_source, serving  # noqa: E402
from tollway.bench.client import OpenAIClient, now_clock  # noqa: E402
from tollway.bench.load import run_stage  # noqa: E402
from tollway.checkpoint import DEFAULT_MODEL, tokenizer_path  # noqa: E402
from tollway.config import load_config  # noqa: E402
from tollway.scheduler.machine_profile import MachineProfile  # noqa: E402
from tollway.scheduler.step_model import StepShape  # noqa: E402
from tollway.sim.live_profile import live_profile  # noqa: E402
from tollway.sim.simulator import simulate  # noqa: E402
from tollway.text.tokenizer import Tokenizer  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402
from tollway.traffic.stats import SLO, percentile, summarize  # noqa: E402
from tollway.traffic.workload import Lengths, Requests, Workload  # noqa: E402

FULL = dict(loads=(0.3, 0.6, 0.9, 1.1), requests=300, warmup=5.0, prompt=100, output=96,
            mix={"fast": 0.1, "standard": 0.9}, saturation=dict(concurrency=32, requests=96),
            ramp=((2, 16), (8, 40)), profile_flags=[])
QUICK = dict(loads=(0.5, 1.0), requests=40, warmup=2.0, prompt=32, output=32,
             mix={"fast": 0.2, "standard": 0.8}, saturation=dict(concurrency=16, requests=128), ramp=((2, 8),),
             profile_flags=["--quick"])
SERVER_CONFIG = "[scheduler]\nspeculative_tokens = 0\n"
SIM_SEEDS = 8
TARGETS = {"latency": 0.10, "output_tok_s": 0.05, "profiles_apart": 0.05}
FIGURES = [("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99")]


def run(s: dict, quick: bool) -> dict:
    machine, source = machine_info(), _tollway_source()
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "sim_fidelity_served.toml"
    config_path.write_text(SERVER_CONFIG)
    def grid_profile(path: Path) -> MachineProfile:
        subprocess.run([sys.executable, "-m", "tollway", "profile", *s["profile_flags"], "--config", str(config_path),
                        "--output", str(path)], cwd=ROOT, check=True)
        return MachineProfile.load(path)

    grid = grid_profile(out / "sim_fidelity_served-grid-profile.json")
    workload = Workload(Lengths(s["prompt"], 0, s["prompt"], s["prompt"]),
                        Lengths(s["output"], 0, s["output"], s["output"]), True, s["mix"], None, seed=17)
    with tempfile.TemporaryDirectory(prefix="tollway-sim-fidelity-") as tmp:
        tmp, port = Path(tmp), free_port()
        command = [sys.executable, "-m", "tollway", "serve", "--port", str(port), "--threads", str(os.cpu_count()),
                   "--config", str(config_path), "--data-dir", str(tmp), "--keys-db", str(tmp / "keys.sqlite")]
        with serving("tollway", command, port, tmp / "tollway.log"):
            url = f"http://127.0.0.1:{port}"
            served = asyncio.run(_serve_loads(url, workload, s))
            steps = httpx.get(url + "/dashboard/steps", timeout=60).json()
    # Step counts are the server's totals; the steps it kept are the last of them.
    offset = steps["total"] - len(steps["steps"])
    ends = [load["first_step"] for load in served["loads"][1:]] + [steps["total"]]
    # The served profile: the capacity run's steps only, what the machine did before the loads.
    profiles = {"grid": grid, "served": live_profile(served.pop("calibration"), "the ramp and the capacity run")}
    for load, end in zip(served["loads"], ends):
        kept = steps["steps"][max(0, load.pop("first_step") - offset):end - offset]
        load["served_steps"] = _served_step_figures(kept)
        load["steps_over_profile"] = {name: _over_profile(kept, p) for name, p in profiles.items()}
    profiles["served"].save(out / "sim_fidelity_served-served-profile.json")  # for a look at it afterwards
    # Goal 2: a second grid profile, minutes after the first (the loads ran between them), must
    # predict every figure within 5% of what the first predicts.
    profiles["grid, again"] = grid_profile(out / "sim_fidelity_served-grid-profile-again.json")
    scheduler = load_config(config_path).scheduler
    loads = []
    for load in tqdm(served["loads"], desc="simulating the loads", unit="load"):
        pattern, limits = LoadPattern(load["name"], rate=load["rate"]), Limits(max_requests=s["requests"],
                                                                               warmup=s["warmup"])
        simulated, sim_steps, load_workload = {}, {}, _stage_workload(workload, load["share"])
        for name, profile in profiles.items():
            draws = [simulate(scheduler, profile, load_workload, [pattern], limits, progress=False, seed=workload.seed + k)
                     ["stages"][0] for k in range(SIM_SEEDS)]
            simulated[name] = _figures_mean([_figures(d["summary"]) for d in draws])
            sim_steps[name] = step_figures(draws[0])
        loads.append({**load, "simulated": simulated, "simulated_steps": sim_steps,
                      "errors": {name: _errors(load["served"], sim) for name, sim in simulated.items()},
                      "grid_again_vs_grid": _errors(simulated["grid"], simulated["grid, again"])})
    targets = {f"{load['name']}_{name}_{what}": ok for load in loads for name in ("grid", "served")
               for what, ok in _met(load["errors"][name]).items()}
    apart = [abs(e) for load in loads for e in _all_errors(load["grid_again_vs_grid"])]
    targets[f"two_grid_profiles_within_{TARGETS['profiles_apart']:.0%}"] = bool(apart) and max(apart) <= TARGETS["profiles_apart"]
    return {"command": "python benchmarks/sim_fidelity_served.py" + (" --quick" if quick else ""),
            "date": datetime.date.today().isoformat(), "machine": machine, "tollway_source": source,
            "settings": {k: v for k, v in s.items()}, "server_config": SERVER_CONFIG, "sim_seeds": SIM_SEEDS,
            "capacity": served["capacity"],
            "profiles": {name: {"hardware": p.hardware, "steps": len(p.samples), "overhead": p.overhead,
                                "jitter_mean": statistics.fmean(p.jitter), "drift": p.drift(),
                                "per_call": _per_call({}, p.calls)}
                         for name, p in profiles.items()},
            "loads": loads, "targets": targets}


async def _serve_loads(url: str, workload: Workload, s: dict) -> dict:
    """The capacity run, then each load in turn; each stage's per-tier figures."""
    tokenizer = Tokenizer.load(tokenizer_path(DEFAULT_MODEL))
    client, clock = OpenAIClient(url, DEFAULT_MODEL), now_clock()
    try:
        # Closed loops of a few users first: the served profile then sees small steps as well
        # as the capacity run's large ones (fitted to those alone, it put small steps 20% over).
        for k, (concurrency, requests) in enumerate(s["ramp"], start=1):
            await run_stage(client, Requests(_stage_workload(workload, -k), tokenizer),
                            LoadPattern(f"ramp {concurrency}", concurrency=concurrency),
                            Limits(max_requests=requests, warmup=0.0), clock)
        sat = s["saturation"]
        stage = await run_stage(client, Requests(workload, tokenizer),
                                LoadPattern("capacity", concurrency=sat["concurrency"]),
                                Limits(max_requests=sat["requests"], warmup=s["warmup"]), clock)
        summary = summarize(stage.records, SLO({}), None)
        async with httpx.AsyncClient() as http:  # the capacity run's steps, before the loads push them out
            calibration = (await http.get(url + "/dashboard/steps", timeout=60)).json()
        capacity = {"requests_per_s": summary["all"]["requests_per_s"],
                    "output_tok_s": summary["all"]["output_tok_s"], "steps": calibration["total"]}
        loads = []
        for share in tqdm(s["loads"], desc="serving the loads", unit="load"):
            rate, load_workload = share * capacity["requests_per_s"], _stage_workload(workload, share)
            async with httpx.AsyncClient() as http:
                before = (await http.get(url + "/dashboard/steps", timeout=60)).json()
                stage = await run_stage(client, Requests(load_workload, tokenizer),
                                        LoadPattern(f"{share:.0%}", rate=rate),
                                        Limits(max_requests=s["requests"], warmup=s["warmup"]), clock)
                after = (await http.get(url + "/dashboard/steps", timeout=60)).json()
            loads.append({"name": f"{share:.0%}", "share": share, "rate": rate, "first_step": before["total"],
                          "served": _figures(summarize(stage.records, SLO({}), None)),
                          "server_per_call": _per_call(before["calls"], after["calls"])})
    finally:
        await client.close()
    return {"capacity": capacity, "loads": loads, "calibration": calibration}


def _stage_workload(workload: Workload, key: float) -> Workload:
    """A stage's own seed (a load's key is its share): its prompts are none of another stage's (a
    prompt served before would be a prefix-cache hit, which the simulator does not model), and a
    load's simulation draws the same lanes in the same order as its served run."""
    return dataclasses.replace(workload, seed=workload.seed + round(key * 1000))


def _per_call(before: dict, after: dict) -> dict:
    """Per lane, the p50 and p99 of the server's time beside the engine (ms) over the calls a
    load streamed: intake (reaching the server to the engine's queue), delivery (a token to the
    wire), and both. The server keeps the latest calls; a load's are those past the count before it."""
    out = {}
    for tier, calls in after.items():
        new = calls[len(before.get(tier, [])):]
        if new:
            out[tier] = {name: {"p50": percentile(values, 0.5) * 1e3, "p99": percentile(values, 0.99) * 1e3}
                         for name, values in (("intake", [c[0] for c in new]), ("delivery", [c[1] for c in new]),
                                              ("both", [c[0] + c[1] for c in new]))}
            out[tier]["held_p50"] = percentile([c[2] for c in new], 0.5)
    return out


def _served_step_figures(steps: list[list]) -> dict | None:
    """A load's steps as the server kept them (LiveStats.steps), in step_figures' terms."""
    if len(steps) < 2:
        return None
    span = steps[-1][0] - steps[0][0]
    return {"steps_per_s": (len(steps) - 1) / span if span > 0 else None,
            "seqs_per_step": statistics.fmean(s[6] for s in steps),
            "tokens_per_step": statistics.fmean(s[2] for s in steps),
            "seconds_per_step": statistics.fmean(s[7] for s in steps)}


def _over_profile(steps: list[list], profile: MachineProfile) -> float | None:
    """The median of a load's served steps' runner time over what the profile's fit says for their
    shapes: how far the machine and the server's work on it sat from the profile during that load."""
    model = profile.step_model(adaptive=False)
    ratios = [s[7] / model.predict(StepShape(*s[1:6])) for s in steps]
    return statistics.median(ratios) if ratios else None


def _figures(summary: dict) -> dict:
    """Per tier: TTFT and TPOT at p50 and p99 (seconds), and the output tok/s; and the whole run's."""
    tiers = {tier: {f"{kind}_{q}": t[kind][q] for kind, q in FIGURES} | {"output_tok_s": t["output_tok_s"],
                                                                        "requests": t["completed"]}
             for tier, t in summary["tiers"].items()}
    return {"tiers": tiers, "output_tok_s": summary["all"]["output_tok_s"]}


def _figures_mean(draws: list[dict]) -> dict:
    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None
    tiers = {tier: {k: mean([d["tiers"].get(tier, {}).get(k) for d in draws]) for k in draws[0]["tiers"][tier]}
             for tier in draws[0]["tiers"]}
    return {"tiers": tiers, "output_tok_s": mean([d["output_tok_s"] for d in draws])}


def _errors(served: dict, sim: dict) -> dict:
    def err(real, predicted):
        return None if real in (None, 0) or predicted is None else predicted / real - 1
    tiers = {tier: {k: err(t[k], sim["tiers"].get(tier, {}).get(k)) for k in t if k != "requests"}
             for tier, t in served["tiers"].items()}
    return {"tiers": tiers, "output_tok_s": err(served["output_tok_s"], sim["output_tok_s"])}


def _all_errors(errors: dict) -> list[float]:
    """Every figure's error that could be taken (a lane's and the run's output tok/s included)."""
    return [e for t in errors["tiers"].values() for e in t.values() if e is not None] + (
        [errors["output_tok_s"]] if errors["output_tok_s"] is not None else [])


def _met(errors: dict) -> dict[str, bool]:
    latency = [e for t in errors["tiers"].values() for k, e in t.items() if k != "output_tok_s"]
    return {f"latency_within_{TARGETS['latency']:.0%}": all(e is not None and abs(e) <= TARGETS["latency"]
                                                            for e in latency),
            f"output_tok_s_within_{TARGETS['output_tok_s']:.0%}":
                errors["output_tok_s"] is not None and abs(errors["output_tok_s"]) <= TARGETS["output_tok_s"]}


def markdown(r: dict, raw: str) -> str:
    m, s, cap = r["machine"], r["settings"], r["capacity"]
    lines = [f"Measured {r['date']} with `{r['command']}` on {m['cpu']} ({m['cores']} cores; "
             f"{', '.join(m['isa_flags'])}), tollway at {r['tollway_source']['commit'][:7]}. Raw: `{raw}`.", "",
             f"Workload: Poisson arrivals, tiers {', '.join(f'{t} {p:.0%}' for t, p in s['mix'].items())}, "
             f"{s['prompt']}-token prompts, {s['output']} output tokens (`ignore_eos`), {s['requests']} requests a "
             f"load after {s['warmup']:.0f} s, streamed over HTTP; speculation off. Capacity (a closed loop of "
             f"{s['saturation']['concurrency']}): {cap['requests_per_s']:.2f} req/s, {cap['output_tok_s']:.0f} "
             f"output tok/s. Simulated {r['sim_seeds']} times a load and profile (the mean).", ""]
    for name, p in r["profiles"].items():
        drift = p.get("drift")
        lines.append(f"- profile `{name}`: {p['hardware']}, {p['steps']} steps, engine time per step "
                     f"{p['overhead'][0] * 1e3:.2f} ms + {p['overhead'][1] * 1e3:.3f} ms a sequence, jitter mean "
                     f"{p['jitter_mean']:.2f}" + ("" if drift is None else f", drifted {drift:+.1%} while taken")
                     + "".join(f"; {tier} calls' server time p50 {c['both']['p50']:.1f} ms"
                               for tier, c in p.get("per_call", {}).items()))
    lines += ["", "Each cell: served / simulated on the grid profile / on the served profile (ms, or tok/s), then "
              "the two errors.", "",
              "| load | lane | " + " | ".join(f"{k.upper()} {q}" for k, q in FIGURES) + " | output tok/s |",
              "|---|---|" + "---|" * (len(FIGURES) + 1)]
    for load in r["loads"]:
        for tier, t in load["served"]["tiers"].items():
            cells = []
            for key in [f"{k}_{q}" for k, q in FIGURES] + ["output_tok_s"]:
                scale = 1 if key == "output_tok_s" else 1e3
                values = [t[key], load["simulated"]["grid"]["tiers"].get(tier, {}).get(key),
                          load["simulated"]["served"]["tiers"].get(tier, {}).get(key)]
                errs = [load["errors"][n]["tiers"][tier].get(key) for n in ("grid", "served")]
                cells.append(" / ".join("–" if v is None else f"{v * scale:.0f}" for v in values) + " ("
                             + ", ".join("–" if e is None else f"{e:+.0%}" for e in errs) + ")")
            lines.append(f"| {load['name']} ({load['rate']:.2f}/s) | {tier} ({t['requests']}) | " + " | ".join(cells) + " |")
    lines += ["", "The server's time per call beside the engine, as it kept it (intake + the first token's way "
              "out, p50 / p99 ms); the served profile draws its calls', and the client's own time is in no profile:", ""]
    for load in r["loads"]:
        per_call = load.get("server_per_call") or {}
        lines.append(f"- {load['name']}: " + "; ".join(
            f"{tier} {c['intake']['p50']:.1f} + {c['delivery']['p50']:.1f} (p99 {c['both']['p99']:.1f}) "
            f"with {c['held_p50']:.0f} held"
            for tier, c in per_call.items()))
    lines += ["", "Steps, served / grid / served profile (steps/s, sequences and tokens per step, ms per step):", ""]
    for load in r["loads"]:
        sides = [load["served_steps"], load["simulated_steps"]["grid"], load["simulated_steps"]["served"]]
        lines.append(f"- {load['name']}: " + "; ".join(
            " / ".join("–" if side is None or side[k] is None else f"{side[k] * scale:.{digits}f}" for side in sides)
            for k, scale, digits in (("steps_per_s", 1, 1), ("seqs_per_step", 1, 1), ("tokens_per_step", 1, 1),
                                     ("seconds_per_step", 1e3, 1)))
            + "".join(f"; served steps over the {name} profile's fit, median {ratio:.2f}"
                      for name, ratio in (load.get("steps_over_profile") or {}).items() if ratio is not None))
    if all("grid_again_vs_grid" in load for load in r["loads"]):
        lines += ["", "Two grid profiles minutes apart (`grid`, before the loads, and `grid, again`, after them): "
                  "what the second predicts against the first, over every lane's eight latency figures and "
                  "output tok/s:", ""]
        for load in r["loads"]:
            apart = sorted(abs(e) for e in _all_errors(load["grid_again_vs_grid"]))
            if apart:
                lines.append(f"- {load['name']}: median {statistics.median(apart):.1%}, largest {apart[-1]:.1%}")
    lines += ["", targets_line(r["targets"])]
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("sim_fidelity_served", __doc__, run, markdown, FULL, QUICK)
