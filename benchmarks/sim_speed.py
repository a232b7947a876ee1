"""Simulator speed: how long `tollway simulate` takes per request and per sequence-step, on the
README's planning workload (Llama 3 8B shapes on an H200 estimate, chat lengths, 10% fast).

    python benchmarks/sim_speed.py          # a million requests, about 20 min on this 2-core machine
    python benchmarks/sim_speed.py --quick  # 2,000 requests; writes benchmarks/out/ only

The simulator runs the real Scheduler. Planning every sequence in every step cost 30-50 us per
sequence-step in CPython; plain decodes now coast (tollway/sim/coasting.py), so most
sequence-steps cost a share of one group check, and the cost is mostly per step and per
request. Microseconds per sequence-step is still the figure compared across versions; the
time for a million requests follows from it. Process CPU time is reported beside wall time:
the machine is shared and noisy.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from common import machine_info, run_benchmark  # noqa: E402
from tollway.checkpoint import model_config  # noqa: E402
from tollway.config import load_config  # noqa: E402
from tollway.sim.hardware import analytic_profile, hardware  # noqa: E402
from tollway.sim.simulator import Simulator  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402
from tollway.traffic.workload import Lengths, Workload  # noqa: E402

MODEL = ROOT / "benchmarks" / "models" / "llama-3-8b"
FULL = dict(requests=1_000_000, replicas=3, rate=60.0)
QUICK = dict(requests=2_000, replicas=3, rate=60.0)


def run(s: dict, quick: bool) -> dict:
    profile = analytic_profile(model_config(str(MODEL)), str(MODEL), hardware("H200"))
    config = load_config(ROOT / "benchmarks" / "models" / "h200-chat.toml").scheduler
    workload = Workload(Lengths(1024, 512, 64, 4096), Lengths(256, 128, 16, 1024), True,
                        {"fast": 0.1, "standard": 0.9}, None, seed=3)
    sim = Simulator(config, profile, s["replicas"], "tier_aware", seed=3, token_times=0)
    wall, cpu = time.perf_counter(), time.process_time()
    stage = sim.run_stage(workload, LoadPattern(f"rate {s['rate']:g}/s", rate=s["rate"]), Limits(s["requests"]))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    seq_steps = sum(seqs for _, seqs, _, _ in sim.steps)
    done = sum(r.end is not None and r.error is None for r in stage.records)
    per_seq_step = cpu / seq_steps
    tokens_per_request = seq_steps / done
    return {"command": "python benchmarks/sim_speed.py" + (" --quick" if quick else ""), "machine": machine_info(),
            "settings": s, "hardware": profile.hardware, "requests": done, "steps": len(sim.steps),
            "sequence_steps": seq_steps, "coasted_share": sim.coasted / seq_steps, "simulated_seconds": sim.now, "wall_seconds": wall, "cpu_seconds": cpu,
            "us_per_sequence_step": per_seq_step * 1e6, "requests_per_cpu_second": done / cpu,
            "minutes_per_million_requests": per_seq_step * tokens_per_request * 1e6 / 60,
            "sequence_steps_per_request": tokens_per_request}


def markdown(r: dict, raw: str) -> str:
    s, m = r["settings"], r["machine"]
    return "\n".join([
        "### Simulator speed (`python benchmarks/sim_speed.py`)",
        "",
        "The simulator plans with the real Scheduler; plain decodes coast (planned as a group per lane, checked "
        "exactly as one by one; `tests/test_coasting.py` shows the results are the same), so the cost is per step "
        "and per request more than per sequence-step. Before coasting: 48.7 µs per sequence-step, about 209 "
        "minutes per million of these requests.",
        "",
        f"Measured with `{r['command']}` on {m['cpu']} ({m['cores']} cores). Raw: `{raw}`.",
        "",
        f"{r['requests']:,} requests (prompts 1024 ± 512, replies 256 ± 128 tokens, 10% fast) at {s['rate']:g}/s on "
        f"{s['replicas']} replicas of {r['hardware']} (estimate): {r['steps']:,} steps, "
        f"{r['sequence_steps']:,} sequence-steps ({r['coasted_share']:.1%} of them coasting), "
        f"{r['simulated_seconds']:.0f} s simulated in "
        f"{r['cpu_seconds']:.0f} s of CPU ({r['wall_seconds']:.0f} s wall).",
        "",
        "| µs per sequence-step | requests per CPU second | minutes per 1M such requests |",
        "|---|---|---|",
        f"| {r['us_per_sequence_step']:.1f} | {r['requests_per_cpu_second']:.0f} | "
        f"{r['minutes_per_million_requests']:.0f} |",
    ])


if __name__ == "__main__":
    run_benchmark("sim_speed", __doc__, run, markdown, FULL, QUICK)
