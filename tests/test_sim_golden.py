"""The simulator's results for fixed seeds, as recorded before the scheduler was reshaped
(issue 21): a refactor of the scheduler or the simulator must leave every request's times,
tokens and engine seconds, and every stage's steps, exactly as they were, on any CPU (the step
model's fit rounds the same on AVX2 and AVX-512). A change that is meant to move them re-records
the file: `python tests/test_sim_golden.py`."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_sim import config, linear_profile, workload  # noqa: E402

from tollway.sim.simulator import simulate  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "sim_golden.json"
CASES = {f"{policy} x{replicas} {rate}/s": (policy, replicas, rate)
         for policy in ("lanes", "priority", "fcfs") for replicas in (1, 2) for rate in (20.0, 90.0)}
_KEPT = ("index", "tier", "prompt_tokens", "max_tokens", "sent", "first_token", "chunk_times", "end",
         "output_tokens", "engine_seconds", "error")


def digest(policy: str, replicas: int, rate: float) -> str:
    """Every request's record and every stage's step series, hashed: floats as repr writes them."""
    result = simulate(config(policy=policy, num_blocks=256), linear_profile(), workload(), [LoadPattern(f"rate {rate}/s", rate=rate)],
                      Limits(max_requests=240), replicas, "tier_aware", progress=False)
    stage = result["stages"][0]
    kept = {"requests": [{k: r[k] for k in _KEPT} for r in stage["requests"]], "steps": stage["steps"],
            "simulated_steps": result["simulation"]["steps"], "busy": result["simulation"]["busy_seconds"]}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("case", list(CASES))
def test_the_simulator_gives_the_recorded_results(case):
    assert digest(*CASES[case]) == json.loads(GOLDEN.read_text())[case]


if __name__ == "__main__":
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({case: digest(*args) for case, args in CASES.items()}, indent=1) + "\n")
    print(f"wrote {GOLDEN}")
