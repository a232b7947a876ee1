"""GGUF kernels benchmark: the native matmuls on a GGUF's own tensors, each at its type's width,
per type and rows per call, against this machine's integer dot-product peak and read bandwidth,
all measured in one run.

    python benchmarks/gguf_kernels.py                  # the Gemma-3-1.5B-shaped Q4_K_M (models.py --make gemma3-1.5b)
    python benchmarks/gguf_kernels.py --model PATH.gguf
    python benchmarks/gguf_kernels.py --quick          # rows 1 and 64, fewer repeats; writes benchmarks/out/ only

Each type's figure is a pass through every tensor of that type (the parts of a fused q/k/v
each in its own), the LM head apart; the types take turns inside each repeat, so machine noise
hits them alike, and figures are medians. TOLLWAY_ISA=avx2 measures the AVX2 path (against
AVX2's peak) on an AVX-512 machine.
"""
from __future__ import annotations

import datetime
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import command_line, gguf_summary, machine_info, run_benchmark  # noqa: E402
from engine import best_seconds, read_buffer, read_gb_s  # noqa: E402
from models import model_path  # noqa: E402
from tollway.config import SchedulerConfig  # noqa: E402
from tollway.model.kernel_profile import model_linears  # noqa: E402
from tollway.model.native.qmatmul import q8_library  # noqa: E402
from tollway.model.runner import ModelRunner  # noqa: E402
from tollway.model.weights import load_weights  # noqa: E402

DEFAULT = "gemma3-1.5b"  # a models.py shape whose matrices are all K-quants (Q4_K and Q6_K)
FULL = dict(rows=(1, 16, 64), repeats=7)
QUICK = dict(rows=(1, 64), repeats=3)
HEAD = "LM head"


def weight_groups(model) -> dict[str, list]:
    """The model's packed weights by kind ('q4k', 'q6k', ...), a fused linear's parts each in its
    own kind's list, and the LM head as its own group."""
    groups: dict[str, list] = {}
    for lin in model_linears(model)[:-1]:
        packed = lin.packed("q8")
        for unit in packed.parts or [packed]:
            groups.setdefault(unit.kind, []).append(unit)
    groups[HEAD] = [model.lm_head.packed("q8")]
    return groups


def macs(units: list) -> int:
    """Multiply-adds of one row through `units`."""
    return sum(u.out_features * u.in_features for u in units)


@torch.inference_mode()
def run(settings: dict, quick: bool) -> dict:
    path = Path(settings["model"]) if settings["model"] else model_path(DEFAULT)
    if not path.exists():
        sys.exit(f"gguf_kernels: no {path}; make it with `python benchmarks/models.py --make {DEFAULT}`")
    library = q8_library()
    if library is None:
        sys.exit("the native q8 matmul did not compile here: nothing to measure")
    loaded = load_weights(str(path))
    runner = ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(num_blocks=16), torch.device("cpu"), {"q8"})
    groups = weight_groups(runner.model)
    if any(u is None for units in groups.values() for u in units):
        sys.exit(f"gguf_kernels: {path.name} has tensors without a native kernel")
    reading = read_buffer()
    reads, peaks = [read_gb_s(reading, 5)], [library.dot_peak()]
    result = {
        "command": command_line("gguf_kernels.py", (f" --model {settings['model']}" if settings["model"] else "")
                                + (" --quick" if quick else "")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "settings": settings, "threads": torch.get_num_threads(), "isa": library.isa,
        "model": gguf_summary(path), "read_gb_s": None, "dot_peak_gmac_s": None,
        "groups": {name: {"tensors": len(units), "macs_per_row": macs(units),
                          "bytes": sum(u.streamed_bytes() for u in units)} for name, units in groups.items()},
        "rows": {},
    }
    everything = [u for units in groups.values() for u in units]
    for rows in tqdm(settings["rows"], desc="rows per call", unit="size"):
        inputs = {k: torch.randn(rows, k) for k in {u.in_features for u in everything}}

        def through(units: list) -> None:
            for u in units:
                u(inputs[u.in_features])

        through(everything)  # warm up: the pool's threads, the scratch buffers
        samples = {name: [] for name in groups} | {"all": []}
        for _ in range(settings["repeats"]):
            for name, units in groups.items():
                samples[name].append(best_seconds(lambda: through(units), 1))
            samples["all"].append(best_seconds(lambda: through(everything), 1))
            # The VM's cores are shared: the peaks are sampled between the kernels, their medians taken
            reads.append(read_gb_s(reading, 1))
            peaks.append(library.dot_peak())
        result["rows"][rows] = {name: statistics.median(v) for name, v in samples.items()}
    peak = statistics.median(peaks)
    result["read_gb_s"], result["dot_peak_gmac_s"] = statistics.median(reads), peak / 1e9
    result["read_gb_s_samples"], result["dot_peak_gmac_s_samples"] = reads, [p / 1e9 for p in peaks]
    for rows, seconds in result["rows"].items():
        figures = {}
        for name, units in [*groups.items(), ("all", everything)]:
            rate = rows * macs(units) / seconds[name]
            figures[name] = {"ms": seconds[name] * 1e3, "gmac_s": rate / 1e9, "of_dot_peak": rate / peak,
                             "gb_s": sum(u.streamed_bytes() for u in units) / seconds[name] / 1e9}
        result["rows"][rows] = figures
    return result


def markdown(r: dict, raw: str) -> str:
    m, names = r["machine"], list(r["groups"])
    lines = [
        f"On {m.get('cpu', 'this CPU')} ({', '.join(m.get('isa_flags', []))}), {r['threads']} threads, the kernels on "
        f"{r['isa']} ({r['date']}, `{r['command']}`, raw: `{raw}`), {r['model']['file']}. Integer dot-product peak "
        f"{r['dot_peak_gmac_s']:.0f} GMAC/s (a register-only loop), read bandwidth {r['read_gb_s']:.1f} GB/s (a native "
        "read loop), each the median of samples taken between the kernels'. "
        "Each cell: GMAC/s, and its share of the peak (at 1 row: GB/s of the weights, their share of the read "
        "bandwidth, which the whole pass streams from memory and one type's tensors may partly from cache).",
        "",
        "| rows | " + " | ".join(f"{n} ({r['groups'][n]['tensors']} tensors, {r['groups'][n]['bytes'] / 2**20:.0f} MiB)"
                               for n in names) + " | all |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for rows, figures in r["rows"].items():
        cells = []
        for name in [*names, "all"]:
            f = figures[name]
            cells.append(f"{f['gb_s']:.1f} GB/s ({f['gb_s'] / r['read_gb_s']:.0%})" if int(rows) == 1 else
                         f"{f['gmac_s']:.0f} ({f['of_dot_peak']:.0%})")
        lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("gguf_kernels", __doc__, run, markdown, FULL, QUICK, per_cpu_kind=True,
                  options={"model": dict(default=None, help="a GGUF file (default: the Gemma-3-1.5B-shaped test model)")},
                  name_suffix=lambda settings: f"-{Path(settings['model']).stem}" if settings["model"] else "")
