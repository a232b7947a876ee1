"""A run's JSON: each stage's pattern, summary, step sizes and every request's record, as bench
and the simulator both write it (and `tollway report` reads it back)."""
from __future__ import annotations

import json
from pathlib import Path

from tollway.traffic.patterns import Stage
from tollway.traffic.stats import SLO, summarize

FORMAT = "tollway-bench/1"


def stage_dict(s: Stage, slo: SLO, usd_per_hour: float | None) -> dict:
    return {"profile": s.pattern.to_dict(), "start": s.start, "end": s.end,
            "summary": summarize(s.records, slo, usd_per_hour), "steps": s.steps,
            "requests": [r.to_dict() for r in s.records]}


def write_result(result: dict, output: Path) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    path = output / "bench.json"
    path.write_text(json.dumps(result))  # no indent: the C encoder, and a million requests fit
    return path
