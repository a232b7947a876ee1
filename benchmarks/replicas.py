"""Replicas: the same closed-loop load on `tollway serve --replicas 1` and `--replicas 2`
(each replica one engine, the replicas a Ray Serve deployment on a local Ray instance),
throughput and the 2:1 ratio; and `tollway simulate` of the same two fleets on this machine's
profile, for comparison.

    python benchmarks/replicas.py          # about 15 min on a quiet 2-core machine
    python benchmarks/replicas.py --quick  # a smaller run, for development; writes benchmarks/out/ only

The replicas share the machine's cores (each gets cores // N threads), so on a 2-core machine
two replicas are two 1-thread engines: the ratio says what splitting the same cores buys (it
is not a scale-out figure), and the core count is stated beside it. The simulator runs each
fleet on a profile measured at that fleet's threads per replica, measured alone: it does not
see two replicas contend for memory bandwidth. Speculation is off on both sides (the
simulator's synthetic tokens give n-gram drafts nothing). Writes
benchmarks/results/replicas.json and a section of benchmarks/README.md.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from common import machine_info, run_benchmark  # noqa: E402
from tollway.bench.run import BenchConfig, run_bench  # noqa: E402
from tollway.checkpoint import tokenizer_path  # noqa: E402
from tollway.config import EngineConfig, SchedulerConfig  # noqa: E402
from tollway.model.machine_profiler import Grid, measure  # noqa: E402
from tollway.sim.simulator import simulate  # noqa: E402
from tollway.text.tokenizer import Tokenizer  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402
from tollway.traffic.workload import Lengths, Workload  # noqa: E402

MODEL = "gemma3-270m"
FULL = dict(users=16, requests=120, warmup=10.0, prompt=(64, 16, 32, 128), output=(48, 16, 16, 96),
            mix={"fast": 0.1, "standard": 0.9}, kernel=None, grid=None)
QUICK = dict(users=6, requests=18, warmup=2.0, prompt=(32, 8, 16, 48), output=(16, 4, 8, 24),
             mix={"fast": 0.2, "standard": 0.8}, kernel="int8", grid=dict(decodes=(1, 8), prefills=(0, 64), repeats=1))
FLEETS = (1, 2)


def _workload(s: dict) -> tuple[Workload, LoadPattern, Limits]:
    return (Workload(Lengths(*s["prompt"]), Lengths(*s["output"]), True, s["mix"], None, seed=5),
            LoadPattern(f"concurrency {s['users']}", concurrency=s["users"]),
            Limits(max_requests=s["requests"], warmup=s["warmup"]))


def _serve(replicas: int, s: dict, folder: Path, port: int) -> subprocess.Popen:
    config = folder / "tollway.toml"
    config.write_text("[scheduler]\nspeculative_tokens = 0\n")
    command = [sys.executable, "-m", "tollway", "serve", "--replicas", str(replicas), "--port", str(port),
               "--config", str(config), "--data-dir", str(folder / f"data-{replicas}")]
    command += ["--kernel", s["kernel"]] if s["kernel"] else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900  # a first start measures kernels and steps at the new thread count
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"tollway serve --replicas {replicas} did not start")
        time.sleep(1.0)


def _measured(replicas: int, s: dict, folder: Path) -> dict:
    port = 8700 + replicas
    server = _serve(replicas, s, folder, port)
    try:
        workload, load, limits = _workload(s)
        print(f"{replicas} replica(s): {load.name}, {limits.max_requests} requests", file=sys.stderr)
        result = run_bench(BenchConfig(f"http://127.0.0.1:{port}", MODEL, workload, limits, [load]),
                           Tokenizer.load(tokenizer_path(MODEL)), show=True)
    finally:
        server.send_signal(signal.SIGINT)  # the fleet stops its replicas and its Ray instance
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return _figures(result) | {k: result["stages"][0]["summary"]["all"][k] for k in ("completed", "errors")}


def _simulated(replicas: int, s: dict) -> dict:
    """The same fleet in the simulator, on a profile of one replica at its threads, measured now."""
    from tollway.engine import Engine

    scheduler = SchedulerConfig(speculative_tokens=0, **({"kernel": s["kernel"]} if s["kernel"] else {}))
    engine = Engine(EngineConfig(scheduler=scheduler, num_threads=max(1, os.cpu_count() // replicas)), progress=True)
    profile = measure(engine, Grid(**s["grid"]) if s["grid"] else Grid())
    workload, load, limits = _workload(s)
    sim = simulate(SchedulerConfig(speculative_tokens=0, max_model_len=engine.scheduler.config.max_model_len,
                                   **({"kernel": s["kernel"]} if s["kernel"] else {})),
                   profile, workload, [load], limits, replicas=replicas, routing="tier_aware", progress=True)
    return _figures(sim)


def _figures(result: dict) -> dict:
    """A bench result's (measured or simulated) throughput and per-lane p50 TPOT."""
    summary = result["stages"][0]["summary"]
    return {"output_tok_s": summary["all"]["output_tok_s"], "requests_per_s": summary["all"]["requests_per_s"],
            "tpot_p50": {t: v["tpot"]["p50"] for t, v in summary["tiers"].items()}}


def run(s: dict, quick: bool) -> dict:
    machine = machine_info()
    with tempfile.TemporaryDirectory() as tmp:
        measured = {n: _measured(n, s, Path(tmp)) for n in FLEETS}
    simulated = {n: _simulated(n, s) for n in FLEETS}
    workload, load, limits = _workload(s)
    return {"command": "python benchmarks/replicas.py" + (" --quick" if quick else ""), "machine": machine,
            "cores": os.cpu_count(), "settings": {**s, "workload": workload.to_dict(), "limits": asdict(limits)},
            "measured": measured, "simulated": simulated,
            "ratio": {"measured": measured[2]["output_tok_s"] / measured[1]["output_tok_s"],
                      "simulated": simulated[2]["output_tok_s"] / simulated[1]["output_tok_s"]}}


def markdown(r: dict, path: str) -> str:
    s, m, sim = r["settings"], r["measured"], r["simulated"]
    rows = "\n".join(
        f"| {n} | {max(1, r['cores'] // n)} | {m[n]['output_tok_s']:.1f} | {m[n]['requests_per_s']:.2f} | "
        f"{m[n]['tpot_p50'].get('fast', float('nan')) * 1e3:.0f} | {m[n]['tpot_p50']['standard'] * 1e3:.0f} | "
        f"{sim[n]['output_tok_s']:.1f} |" for n in FLEETS)
    return (f"### Replicas (`{r['command']}`)\n\n"
            f"{r['cores']} cores ({r['machine']['cpu']}), shared by the replicas; load average "
            f"{r['machine']['load_average_at_start']:.1f} at the start. A closed loop of {s['users']} users, "
            f"{s['requests']} measured requests after {s['warmup']:.0f} s, mix {s['mix']}, speculation off; "
            f"the same load on each fleet.\n\n"
            "| replicas | threads each | output tok/s | requests/s | fast TPOT p50 (ms) | standard TPOT p50 (ms) "
            "| simulated output tok/s |\n|---|---|---|---|---|---|---|\n"
            f"{rows}\n\n"
            f"2 replicas / 1 replica on {r['cores']} cores: **{r['ratio']['measured']:.2f}x** measured, "
            f"{r['ratio']['simulated']:.2f}x simulated (`tollway simulate --replicas 2 --routing tier_aware` on a "
            f"profile measured at one replica's threads, alone). Results: `benchmarks/{path}`.")


if __name__ == "__main__":
    run_benchmark("replicas", __doc__, run, markdown, FULL, QUICK)
