"""Helpers the benchmark scripts share: what machine this is, prompts, the README sections."""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
from pathlib import Path

import torch

from tollway.checkpoint import DEFAULT_MODEL, tokenizer_path
from tollway.text.tokenizer import Tokenizer
from tollway.traffic.workload import exact_prompt, plain_words

# What torch may run in a run forced down to each of tollway's lower paths (TOLLWAY_ISA): its own
# kernels, MKL's and oneDNN's then take that kind of CPU's instruction sets too, so transformers
# and the torch floors stand against the forced kernels as on such a CPU (on this AVX-512 Xeon,
# bf16 GEMM: 142 GFLOP/s, 24 limited to AVX2). Each is read at torch's first use, not its import.
TORCH_LIMITS = {
    "portable": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avxvnni": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"},
}
# At import, before the scripts run anything on torch. A TOLLWAY_ISA of this CPU's best, or of an
# AVX2-only CPU's own, limits torch to what it runs anyway; forced_isa() refuses an unknown one.
os.environ.update(TORCH_LIMITS.get(os.environ.get("TOLLWAY_ISA", ""), {}))

# The instruction sets that decide which integer dot-product kernels a CPU can run.
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8")


def _cpu_model_and_flags() -> tuple[str, set[str]]:
    cpu, flags = platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return cpu, flags


def forced_isa() -> str | None:
    """TOLLWAY_ISA where it forces tollway's kernels below this CPU's best (AVX2's on an AVX-512
    CPU: the only way to measure them where no AVX2-only machine is at hand), else None. The
    library that runs the kernels says what this CPU runs; a path it does not stops the run."""
    forced = os.environ.get("TOLLWAY_ISA") or None
    if forced is None:
        return None
    from tollway.model.native.qmatmul import q8_library

    try:  # a TOLLWAY_ISA this CPU does not run fails the library's constructor, or below_best
        library = q8_library()
        return library.below_best(forced) if library is not None else None  # None: no compiler, torch runs
    except ValueError as error:
        raise SystemExit(f"TOLLWAY_ISA={forced}: {error}") from None


def command_line(script: str, flags: str = "") -> str:
    """How to run this benchmark again as it ran now: with TOLLWAY_ISA first where it was forced."""
    forced = forced_isa()
    return (f"TOLLWAY_ISA={forced} " if forced else "") + f"python benchmarks/{script}{flags}"


def cpu_kind_suffix() -> str:
    """'-amx' on an AVX-512 CPU with AMX tiles, '' on one without, else '-avx2' or '-portable':
    the native kernels (tollway's and the peer's) differ by kind, so a kernel-bound benchmark
    keeps one record per kind rather than overwriting the other's. A run with tollway forced to
    a lower path (forced_isa) keeps its own, '-forced-avx2' for AVX2's: it stands for no CPU kind."""
    if forced := forced_isa():
        return f"-forced-{forced}"
    flags = _cpu_model_and_flags()[1]
    if {"avx512f", "avx512bw"} <= flags:
        return "-amx" if "amx_int8" in flags else ""
    return "-avx2" if "avx2" in flags else "-portable"


def machine_info() -> dict:
    cpu, flags = _cpu_model_and_flags()
    import transformers

    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": "avx512_bf16" in flags, "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg()[0], "forced_isa": forced_isa(),
    }


def text_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids of the default model, drawn as `tollway bench` draws
    them: common words at random, distinct per request, so the prefix cache never shortcuts a
    prefill. Not random token ids: on those a model's next-token logits come out nearly flat, as on
    no request a user sends, and the LM head's pruned argmax (AVX2) then runs the exact one."""
    tokenizer = _default_tokenizer()
    words, rng = plain_words(tokenizer), random.Random(seed)
    return [tokenizer.encode(exact_prompt(tokenizer, words, length, rng)) for _ in range(count)]


@functools.lru_cache(maxsize=None)
def _default_tokenizer():
    return Tokenizer.load(tokenizer_path(DEFAULT_MODEL))


def gguf_summary(path: Path) -> dict:
    """A GGUF file's size, and its tensors' bytes and counts by GGML type (Q4_K, Q6_K, F32...),
    biggest first, read with gguf-py's reader."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    by_type: dict[str, dict] = {}
    for t in reader.tensors:
        kind = by_type.setdefault(t.tensor_type.name, {"tensors": 0, "bytes": 0})
        kind["tensors"] += 1
        kind["bytes"] += int(t.n_bytes)
    architecture = reader.fields.get("general.architecture")
    return {"file": Path(path).name, "bytes": Path(path).stat().st_size,
            "architecture": architecture.contents() if architecture else None,
            "parameters": sum(int(t.n_elements) for t in reader.tensors),
            "tensor_bytes": sum(k["bytes"] for k in by_type.values()),
            "by_type": dict(sorted(by_type.items(), key=lambda item: -item[1]["bytes"]))}


def gguf_summary_line(summary: dict) -> str:
    """'770.3 MiB, 1.00B parameters (gemma3); tensor bytes by type: Q5_0 400.1 MiB in 156 tensors, ...'"""
    kinds = ", ".join(f"{name} {k['bytes'] / 2**20:.1f} MiB in {k['tensors']} tensors"
                      for name, k in summary["by_type"].items())
    return (f"{summary['bytes'] / 2**20:.1f} MiB, {summary['parameters'] / 1e9:.2f}B parameters "
            f"({summary['architecture']}); tensor bytes by type: {kinds}")


def write_readme(readme: Path, name: str, section: str) -> None:
    """Replace the text between <!-- name:begin --> and <!-- name:end --> (appended if absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = readme.read_text()
    if begin not in text:
        text += f"\n{begin}\n{end}\n"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    readme.write_text(f"{head}{begin}\n{section}\n{end}{tail}")


def targets_line(targets: dict[str, bool]) -> str:
    return "Targets: " + "; ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in targets.items()) + "."


def save_json(benchmarks: Path, name: str, result: dict, quick: bool) -> Path:
    """results/<name>.json, or out/<name>-quick.json: quick figures never replace the full ones.
    Returns the path relative to `benchmarks`."""
    out = Path(f"out/{name}-quick.json" if quick else f"results/{name}.json")
    (benchmarks / out).parent.mkdir(parents=True, exist_ok=True)
    (benchmarks / out).write_text(json.dumps(result, indent=1) + "\n")
    return out


def write_record(name: str, result: dict, quick: bool, markdown, *figures: str) -> str:
    """How every benchmark keeps its figures: results/<name>.json (out/<name>-quick.json for a
    quick run), and markdown(result, the JSON's path, *figures) as its section of
    benchmarks/README.md (a full run's only). Returns the section."""
    benchmarks = Path(__file__).resolve().parent
    section = markdown(result, str(save_json(benchmarks, name, result, quick)), *figures)
    if not quick:
        write_readme(benchmarks / "README.md", name, section)
    return section


def run_benchmark(name: str, doc: str, run, markdown, full: dict, quick: dict, figures=None,
                  options: dict[str, dict] | None = None, per_cpu_kind: bool = False, name_suffix=None) -> None:
    """The command line every benchmark shares. run(settings, quick) -> result; then the JSON,
    figures(result, quick) -> [paths relative to benchmarks/] if any, and markdown(result,
    json path, *figure paths) -> the README section (written only for a full run).
    options: {name: argparse keywords} for a benchmark's own flags (--name); each value joins
    the settings under its name. per_cpu_kind: the JSON and the README section are the CPU
    kind's own (name-avx2 on an AVX2-only machine, name-amx on one with AMX; see cpu_kind_suffix).
    name_suffix(settings) -> str: a part of the record's name the options decide ('-<model>' for
    a run on another model), before the CPU kind's."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run for development; writes benchmarks/out/ only")
    for option, keywords in (options or {}).items():
        parser.add_argument(f"--{option}", dest=option, **keywords)
    args = parser.parse_args()
    settings = {**(quick if args.quick else full), **{option: getattr(args, option) for option in options or {}}}
    name += name_suffix(settings) if name_suffix else ""
    if per_cpu_kind:
        name += cpu_kind_suffix()
    result = run(settings, args.quick)
    # Figures are drawn before the JSON is written, into the same folder.
    (Path(__file__).resolve().parent / ("out" if args.quick else "results")).mkdir(exist_ok=True)
    drawn = figures(result, args.quick) if figures else []
    print(write_record(name, result, args.quick, markdown, *drawn))
    written = [f"{'out' if args.quick else 'results'}/{name}{'-quick' if args.quick else ''}.json", *drawn]
    print("\nwrote " + ", ".join(f"benchmarks/{w}" for w in written) + ("" if args.quick else " and benchmarks/README.md"))
