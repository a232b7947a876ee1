"""The canary's worked example under load: `tollway serve --canary-share 0.3` takes a closed
loop of concurrent streams whose requests leave the lane to the server (service_tier "auto"),
so the seeded hash promotes about 30% of them to the fast lane while the rest, the control,
share the standard lane's batched steps. Then `tollway report --canary` compares the arms from
the server's SQLite ledger, and /v1/usage/canary must say the same.

    python benchmarks/canary_example.py          # about 1.5 min on a 2-core machine
    python benchmarks/canary_example.py --quick  # under a minute; writes benchmarks/out/ only

Every request of the run is in the ledger and the comparison, the first wave's too: the canary
compares what the server served, not a measured window. Targets: the promoted share is 0.3
within 3 binomial standard deviations; the report's summary line and /v1/usage/canary's agree;
promoted requests' TPOT p50 is significantly lower than control's (its 95% interval excludes
no change). Writes benchmarks/results/canary_example.json and a section of benchmarks/README.md.
"""
from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from bench_example import free_port  # noqa: E402
from common import machine_info, run_benchmark, targets_line  # noqa: E402
from vs_llamacpp import _tollway_command, _tollway_source, serving  # noqa: E402
from tollway.bench.run import BenchConfig, run_bench  # noqa: E402
from tollway.checkpoint import DEFAULT_MODEL, tokenizer_path  # noqa: E402
from tollway.text.tokenizer import Tokenizer  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402
from tollway.traffic.workload import Lengths, Workload  # noqa: E402

FULL = dict(share=0.3, concurrency=16, requests=192, prompt=128, output=64)
QUICK = dict(share=0.3, concurrency=8, requests=48, prompt=64, output=32)


def run(settings: dict, quick: bool) -> dict:
    machine, source = machine_info(), _tollway_source()  # before anything runs: others may commit meanwhile
    prompt, output = settings["prompt"], settings["output"]
    workload = Workload(Lengths(prompt, 0, prompt, prompt), Lengths(output, 0, output, output), ignore_eos=True,
                        mix={"auto": 1.0}, seed=11)
    with tempfile.TemporaryDirectory(prefix="tollway-canary-example-") as tmp:
        tmp, port = Path(tmp), free_port()
        url = f"http://127.0.0.1:{port}"
        command = [*_tollway_command(port, tmp, os.cpu_count()), "--canary-share", str(settings["share"])]
        with serving("tollway", command, port, tmp / "tollway.log"):
            config = BenchConfig(url, DEFAULT_MODEL, workload, Limits(max_requests=settings["requests"], warmup=0.5),
                                 [LoadPattern(f"concurrency {settings['concurrency']}",
                                              concurrency=settings["concurrency"])], label="canary")
            bench = run_bench(config, Tokenizer.load(tokenizer_path(DEFAULT_MODEL)), show=True)
            comparison = httpx.get(url + "/v1/usage/canary", timeout=60).json()
        # The report reads the ledger file the server wrote, after the server has stopped.
        report = subprocess.run([sys.executable, "-m", "tollway", "report", "--canary", "--ledger",
                                 str(tmp / "ledger.sqlite")], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    requests = comparison["requests"]
    n = requests["promoted"] + requests["control"]
    share = requests["promoted"] / n
    sigma = math.sqrt(settings["share"] * (1 - settings["share"]) / n)
    tpot = comparison["metrics"]["tpot_p50"]
    targets = {"share_within_3_sigma": abs(share - settings["share"]) <= 3 * sigma,
               "report_and_usage_agree": comparison["summary"] in report,
               "promoted_tpot_p50_significantly_lower": tpot["significant"] and tpot["ratio"] < 1}
    stage = bench["stages"][0]["summary"]["all"]
    return {"command": "python benchmarks/canary_example.py" + (" --quick" if quick else ""),
            "date": datetime.date.today().isoformat(), "machine": machine, "tollway_source": source,
            "settings": settings, "bench": {"completed": stage["completed"], "errors": stage["errors"],
                                            "output_tok_s": stage["output_tok_s"]},
            "promoted_share": share, "share_sigma": sigma, "comparison": comparison, "report": report,
            "targets": targets}


def markdown(r: dict, raw: str) -> str:
    s, m = r["settings"], r["machine"]
    return "\n".join([
        f"On {m['cpu']} ({m['cores']} cores), {r['date']} (`{r['command']}`, raw: `{raw}`): `tollway serve "
        f"--canary-share {s['share']}` under {s['concurrency']} concurrent streams of {s['prompt']}-token prompts "
        f"and {s['output']} new tokens, every request with `service_tier` auto, {r['bench']['completed']} measured "
        f"after the first wave ({r['bench']['output_tok_s']:.0f} output tok/s). {r['comparison']['requests']['promoted']} "
        f"of {sum(r['comparison']['requests'].values())} eligible requests were promoted "
        f"({r['promoted_share']:.3f}; the setting ± 3σ is {s['share'] - 3 * r['share_sigma']:.3f}–"
        f"{s['share'] + 3 * r['share_sigma']:.3f}).",
        "",
        "```", "$ tollway report --canary", r["report"].rstrip(), "```", "",
        targets_line(r["targets"]),
    ])


if __name__ == "__main__":
    run_benchmark("canary_example", __doc__, run, markdown, FULL, QUICK)
