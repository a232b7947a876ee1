"""Start time: how long `tollway serve` takes from its command to answering /health, on a model's
first start and on the starts after it, each in one run on this machine.

    python benchmarks/start_time.py          # the default model and two test models, 3 rounds: a few minutes
    python benchmarks/start_time.py --quick  # the default model, 1 round; writes benchmarks/out/ only

Each model is started from three caches (a TOLLWAY_CACHE folder each, the rest of the machine as it is):
- an empty one: a machine's first start (the native kernels compiled too);
- one holding only this machine's native builds: this model's first start (its steps profiled,
  its tokenizer converted unless it is Gemma's), what a user who has served another model meets;
- the same again: the starts after it, the median of the rounds.
The test models are benchmarks/models.py's (made there, once; a missing one is skipped with a note).
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_example import free_port  # noqa: E402
from common import command_line, machine_info, run_benchmark, targets_line  # noqa: E402
from models import SHAPES, made, model_path  # noqa: E402
from tollway.checkpoint import DEFAULT_MODEL, cache_root  # noqa: E402
from vs_llamacpp import serving  # noqa: E402

FULL = dict(models=[DEFAULT_MODEL, "gemma3-1b", "llama3.2-1b"], rounds=3)
QUICK = dict(models=[DEFAULT_MODEL], rounds=1)


def start_seconds(model: str, cache: Path, threads: int) -> float:
    """One `tollway serve` from its command to a 200 from /health, then stopped."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tollway-start-") as data:
        command = [sys.executable, "-m", "tollway", "serve", *([] if model == DEFAULT_MODEL else ["--model", model]),
                   "--port", str(port), "--threads", str(threads), "--data-dir", data,
                   "--keys-db", str(Path(data) / "keys.sqlite")]
        started = time.perf_counter()
        with serving("tollway", command, port, Path(data) / "log", poll_seconds=0.05,
                     environment={"TOLLWAY_CACHE": str(cache)}):
            return time.perf_counter() - started


def run(s: dict, quick: bool) -> dict:
    machine, threads = machine_info(), os.cpu_count()  # before the starts: the load average at the start
    native = cache_root() / "native"
    models, skipped = [], []
    for name in s["models"]:
        if name == DEFAULT_MODEL:
            models.append((name, name))
        elif made(name):
            models.append((name, str(model_path(name))))
        else:
            skipped.append(name)
    results = {}
    with tqdm(total=len(models) * (2 + s["rounds"]), desc="starts", unit="start") as bar:
        for name, model in models:
            with tempfile.TemporaryDirectory(prefix="tollway-start-cache-") as root:
                fresh, warm = Path(root) / "fresh", Path(root) / "warm"
                machine_first = start_seconds(model, fresh, threads)
                bar.update()
                # This machine's native builds (the fresh start just made them), nothing of the model.
                shutil.copytree(fresh / "native" if (fresh / "native").is_dir() else native, warm / "native")
                first = start_seconds(model, warm, threads)
                bar.update()
                later = []
                for _ in range(s["rounds"]):
                    later.append(start_seconds(model, warm, threads))
                    bar.update()
            second = statistics.median(later)
            results[name] = {"machine_first_s": machine_first, "first_s": first, "later_s": later, "second_s": second,
                             "first_over_second": first / second, "machine_first_over_second": machine_first / second}
    return {"command": command_line("start_time.py", " --quick" if quick else ""), "machine": machine,
            "settings": s, "threads": threads, "models": results, "skipped": skipped,
            "files": {name: SHAPES[name].file_name for name in results if name in SHAPES}}


def targets(r: dict) -> dict[str, bool]:
    """Issue 54's: the first start at most 2x the second; the default model's second at most 3 s."""
    found = {f"{name}_first_at_most_2x_second": m["first_over_second"] <= 2 for name, m in r["models"].items()}
    if DEFAULT_MODEL in r["models"]:
        found["default_second_start_at_most_3_s"] = r["models"][DEFAULT_MODEL]["second_s"] <= 3
    return found


def markdown(r: dict, raw: str) -> str:
    m = r["machine"]
    rows = [f"| {name} | {x['machine_first_s']:.1f} s | {x['first_s']:.1f} s | {x['second_s']:.1f} s "
            f"({', '.join(f'{t:.1f}' for t in x['later_s'])}) | **{x['first_over_second']:.2f}×** |"
            for name, x in r["models"].items()]
    return "\n".join([
        "### Start time (`python benchmarks/start_time.py`)",
        "",
        f"Measured with `{r['command']}` on {m['cpu']} ({m['cores']} cores; {', '.join(m['isa_flags'])}), "
        f"load average {m['load_average_at_start']:.1f} at the start. Raw: `{raw}`. `tollway serve` from its "
        "command to a 200 from /health: a machine's first start (an empty cache: the native kernels compile), "
        "the model's first start (only the native builds cached: its steps profiled, its tokenizer converted "
        "where it is not Gemma's, which is read from the file at every start), "
        "and the starts after it (the median of the rounds).",
        "",
        "| model | machine's first start | model's first start | later starts (rounds) | first / later |",
        "|---|---|---|---|---|",
        *rows,
        "",
        *([f"Skipped (not made: `python benchmarks/models.py --make {' '.join(r['skipped'])}`): "
           f"{', '.join(r['skipped'])}.", ""] if r["skipped"] else []),
        targets_line(targets(r)),
    ])


if __name__ == "__main__":
    run_benchmark("start_time", __doc__, run, markdown, FULL, QUICK)
