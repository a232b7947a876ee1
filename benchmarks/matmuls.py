"""Matmul benchmark: every linear layer plus the LM head of the default model, one decode step's
worth, per kernel and rows per step, against this machine's read bandwidth and integer
dot-product peak, all measured in one run.

    python benchmarks/matmuls.py           # about 3 minutes on a quiet 2-core machine
    python benchmarks/matmuls.py --quick   # rows 1 and 64 only; writes benchmarks/out/ only

The kernels take turns inside each repeat, so machine noise hits them alike; figures are medians.
"""
from __future__ import annotations

import datetime
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

import torch  # noqa: E402

from common import command_line, machine_info, run_benchmark  # noqa: E402
from engine import best_seconds, read_buffer, read_gb_s  # noqa: E402
from tollway.config import SchedulerConfig  # noqa: E402
from tollway.model.kernel_profile import matmul_floor_seconds, model_linears  # noqa: E402
from tollway.model.native.qmatmul import q8_library  # noqa: E402
from tollway.model.runner import ModelRunner  # noqa: E402
from tollway.model.weights import load_weights  # noqa: E402

KERNELS = ("q8", "int8", "bf16", "fp32")
FULL = dict(rows=(1, 4, 16, 64), repeats=7)
QUICK = dict(rows=(1, 64), repeats=3)


def weight_bytes(linears, kernel: str, rows: int) -> int:
    """What a call of `rows` rows through every linear layer reads of the weights."""
    if kernel == "q8":  # packed, with their scales, at each GGUF type's own width (int8 for an HF folder)
        return sum(lin.packed(kernel).streamed_bytes() for lin in linears)
    per = {"int8": 1, "bf16": 2, "fp32": 4}[kernel]
    return sum(lin.out_features * lin.in_features * per for lin in linears)


@torch.inference_mode()
def run(settings: dict, quick: bool) -> dict:
    loaded = load_weights(None)
    library = q8_library()
    if library is None:
        sys.exit("the native q8 matmul did not compile here: nothing to measure")
    runner = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(num_blocks=16), torch.device("cpu"),
                         set(KERNELS))
    model, linears = runner.model, model_linears(runner.model)
    macs_per_row = sum(lin.out_features * lin.in_features for lin in linears)
    read = read_gb_s(read_buffer(), 5)
    peak = max(library.dot_peak() for _ in range(3))
    result = {
        "command": command_line("matmuls.py", " --quick" if quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "settings": settings, "threads": torch.get_num_threads(), "isa": library.isa,
        "read_gb_s": read, "dot_peak_gmac_s": peak / 1e9,
        "weight_bytes": {rows: {k: weight_bytes(linears, k, rows) for k in KERNELS} for rows in settings["rows"]},
        "rows": {},
    }
    for rows in settings["rows"]:
        for kernel in KERNELS:
            matmul_floor_seconds(model, kernel, rows, repeats=1)  # warm up
        samples = {k: [] for k in KERNELS}
        head = {"logits": [], "argmax": []}  # the LM head alone, writing its logits or only their argmax
        x = torch.randn(rows, model.lm_head.in_features)
        for _ in range(settings["repeats"]):
            for kernel in KERNELS:
                samples[kernel].append(matmul_floor_seconds(model, kernel, rows, repeats=1))
            head["logits"].append(best_seconds(lambda: model.lm_head(x, "q8"), 1))
            head["argmax"].append(best_seconds(lambda: model.lm_head.native.argmax(x), 1))
        ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
        q8_s = ms["q8"] / 1e3
        result["rows"][rows] = {
            "ms": ms,
            "q8_speedup": {k: ms[k] / ms["q8"] for k in KERNELS if k != "q8"},
            "q8_over_bandwidth_floor": q8_s / (result["weight_bytes"][rows]["q8"] / (read * 1e9)),
            "q8_of_dot_peak": rows * macs_per_row / q8_s / peak,
            "q8_lm_head_ms": {k: statistics.median(v) * 1e3 for k, v in head.items()},
        }
    return result


def markdown(r: dict, raw: str) -> str:
    m = r["machine"]
    lines = [
        f"On {m.get('cpu', 'this CPU')}, {r['threads']} threads, q8 on {r['isa']} ({r['date']}, `{r['command']}`, raw: "
        f"`{raw}`). Every linear layer plus the LM head, one step; read bandwidth {r['read_gb_s']:.1f} GB/s, "
        f"integer dot-product peak {r['dot_peak_gmac_s']:.0f} GMAC/s (a register-only loop).",
        "",
        "| rows | q8 ms | int8 ms | bf16 ms | fp32 ms | q8 speedup vs int8 / bf16 / fp32 "
        "| q8 / bandwidth floor | q8 share of dot peak | q8 LM head ms: logits / argmax only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rows, row in r["rows"].items():
        ms, up = row["ms"], row["q8_speedup"]
        lines.append(f"| {rows} | {ms['q8']:.1f} | {ms['int8']:.1f} | {ms['bf16']:.1f} | {ms['fp32']:.1f} | "
                     f"{up['int8']:.1f}x / {up['bf16']:.1f}x / {up['fp32']:.1f}x | "
                     f"{row['q8_over_bandwidth_floor']:.2f} | "
                     f"{row['q8_of_dot_peak']:.0%} | "
                     f"{row['q8_lm_head_ms']['logits']:.1f} / {row['q8_lm_head_ms']['argmax']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("matmuls", __doc__, run, markdown, FULL, QUICK, per_cpu_kind=True)
