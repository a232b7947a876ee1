"""H200 profile check: tollway's analytic H200 estimate (tollway/sim/hardware.py) against the
real runner timed on an H200, over the same steps.

    python benchmarks/h200_profile.py --out DIR      # on a CUDA machine: Llama 3 8B shapes, ~3 min
    python benchmarks/h200_profile.py --quick        # anywhere: a tiny random Llama, to check the script
    python benchmarks/h200_profile.py --report benchmarks/results/h200_profile.json   # re-analyse, no GPU

Steps: (1) writes a random-weight Hugging Face folder (config.json + bf16 safetensors shards,
no tokenizer) for the shapes in benchmarks/models/llama-3-8b/config.json, generated on the GPU;
(2) runs `tollway profile`'s measurement (tollway/model/machine_profiler.py) on it with the
bf16 kernel, over a grid sized for a GPU (decodes x context x prefill); (3) estimates every
measured step with the analytic H200 model; (4) compares them (relative error per step, median
and p90, decode-heavy and prefill-heavy steps apart) and fits the analytic model's fixed time
and efficiency factors to the measurement. Beside it: the copy bandwidth and bf16 GEMM rate
measured in the same run, and a check that `python -m tollway profile` itself runs on the
device (a tiny model, --quick). Writes h200_profile.json (comparison) and
h200_profile_measured.json (the measured profile, usable with `tollway simulate --profile`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import machine_info, write_record  # noqa: E402
from tollway.config import EngineConfig, SchedulerConfig  # noqa: E402
from tollway.engine import Engine  # noqa: E402
from tollway.model.machine_profiler import Grid, measure  # noqa: E402
from tollway.model_config import ModelConfig  # noqa: E402
from tollway.model.weights import expected_tensor_shapes  # noqa: E402
from tollway.sim import hardware as hw  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parent
LLAMA_8B = BENCHMARKS / "models" / "llama-3-8b" / "config.json"
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "vocab_size": 1024, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False}
FULL = dict(decodes=(1, 4, 16, 64, 256), contexts=(128, 512, 2048), prefills=(0, 128, 512, 2048), repeats=3,
            jitter_repeats=12)
QUICK = dict(decodes=(1, 4, 16), contexts=(32, 96), prefills=(0, 16, 64), repeats=1, jitter_repeats=4)


# --- the model folder --------------------------------------------------------------------------

def write_random_folder(hf_config: dict, folder: Path, device: torch.device, shard_bytes: int = 2 << 30,
                        seed: int = 0) -> dict:
    """A Hugging Face folder of random bf16 weights (std 0.02, norms 1) for `hf_config`, in
    shards with an index, generated on `device`. No tokenizer: profiling feeds token ids."""
    hf_config = {**hf_config, "torch_dtype": "bfloat16"}
    shapes = expected_tensor_shapes(ModelConfig.from_hf_config(hf_config))
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 2 * int(np.prod(shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map, total = {}, 0
    for i, names in enumerate(tqdm(shards, desc="writing random weights", unit="shard")):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            shape = shapes[name]
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16, device=device)
            else:
                t = (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16)
            tensors[name] = t.cpu()
            total += t.numel() * 2
            weight_map[name] = file
        save_file(tensors, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"shards": len(shards), "bytes": total}


# --- the device's own ceilings -----------------------------------------------------------------

def roofline(device: torch.device) -> dict | None:
    """Copy bandwidth (bytes read + written) and bf16 GEMM rate on random data, measured here:
    the ceilings the analytic factors are fractions of."""
    if device.type != "cuda":
        return None

    def timed(fn, repeats=10):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats

    x = torch.empty(1 << 31, dtype=torch.uint8, device=device)  # 2 GiB
    y = torch.empty_like(x)
    copy = timed(lambda: y.copy_(x))
    del x, y
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm = timed(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_gb_s": 2 * (1 << 31) / copy / 1e9, "gemm_bf16_tflops": 2 * n**3 / gemm / 1e12}


# --- measured vs analytic ----------------------------------------------------------------------

def step_rows(samples: list[list], m: ModelConfig, h: hw.Hardware) -> list[dict]:
    """Every measured step with its analytic estimate and the bytes and FLOPs behind it."""
    rows = []
    for kernel, tokens, sampled, attention, chunks, seconds in samples:
        pairs = attention * 1000
        decodes = sampled - chunks  # each prefill chunk samples one row
        prefill = tokens - decodes
        prefill_pairs = prefill * (prefill + 1) / 2
        moved, flops = hw.step_work(m, h, tokens, sampled, pairs - prefill_pairs, prefill_pairs)
        predicted = hw.step_seconds(m, h, tokens, sampled, pairs - prefill_pairs, prefill_pairs)
        rows.append({
            "kernel": kernel, "decodes": decodes, "prefill_tokens": prefill,
            # a decode at context c reads c + 1 keys; a lone prefill chunk may start past 0
            "context": round((pairs - prefill_pairs) / decodes) - 1 if decodes else 0,
            "prefill_start": round((pairs - prefill_pairs) / prefill) if prefill and not decodes else 0,
            "tokens": tokens, "sampled": sampled, "pairs": pairs, "bytes": moved, "flops": flops,
            "measured_s": seconds, "analytic_s": predicted, "rel_err": (predicted - seconds) / seconds,
            "heavy": "prefill" if prefill > decodes else "decode",
            "analytic_bound": "bandwidth" if moved / (h.bandwidth_gb_s * 1e9 * hw.BANDWIDTH_EFFICIENCY)
            >= flops / (h.bf16_tflops * 1e12 * hw.COMPUTE_EFFICIENCY) else "compute",
        })
    return rows


def analysis(samples: list[list], m: ModelConfig, h: hw.Hardware) -> dict:
    """The measured steps against the analytic model as it stands in tollway/sim/hardware.py."""
    rows = step_rows(samples, m, h)
    return {"errors": grouped_stats(rows), "fit": fit_factors(rows, h),
            "analytic": {"bandwidth_gb_s": h.bandwidth_gb_s, "bf16_tflops": h.bf16_tflops,
                         "bandwidth_efficiency": hw.BANDWIDTH_EFFICIENCY, "compute_efficiency": hw.COMPUTE_EFFICIENCY,
                         "fixed_seconds": h.fixed_seconds, "query_tile": hw.QUERY_TILE},
            "steps": rows}


def error_stats(errors: list[float]) -> dict:
    if not errors:
        return {"steps": 0}
    a = np.abs(np.array(errors))
    return {"steps": len(errors), "abs_median": float(np.median(a)), "abs_p90": float(np.percentile(a, 90)),
            "signed_median": float(np.median(errors)), "max": float(a.max())}


def grouped_stats(rows: list[dict], key: str = "rel_err") -> dict:
    return {group: error_stats([r[key] for r in rows if group == "all" or r["heavy"] == group])
            for group in ("all", "decode", "prefill")}


def fit_factors(rows: list[dict], h: hw.Hardware) -> dict:
    """The fixed seconds and bandwidth and compute efficiencies that bring hardware.py's formula,
    fixed + max(bytes / (bandwidth x e_bw), flops / (peak x e_c)), closest to the measured steps
    (least squares on log(predicted / measured), by grid search)."""
    b = np.array([r["bytes"] for r in rows]) / (h.bandwidth_gb_s * 1e9)
    f = np.array([r["flops"] for r in rows]) / (h.bf16_tflops * 1e12)
    t = np.array([r["measured_s"] for r in rows])
    fixed = np.concatenate([[0.0], np.geomspace(1e-4, 0.2, 120)])
    e_bw = np.geomspace(0.003, 1.5, 140)
    e_c = np.geomspace(0.003, 1.5, 140)
    best = (np.inf, None)
    for fx in fixed:
        pred = fx + np.maximum(b[None, None, :] / e_bw[:, None, None], f[None, None, :] / e_c[None, :, None])
        loss = (np.log(pred / t) ** 2).sum(axis=-1)
        i, j = np.unravel_index(np.argmin(loss), loss.shape)
        if loss[i, j] < best[0]:
            best = (loss[i, j], (fx, e_bw[i], e_c[j]))
    fx, eb, ec = best[1]
    refit = [(fx + max(bi / eb, fi / ec) - ti) / ti for bi, fi, ti in zip(b, f, t)]
    refit_rows = [{**r, "refit_err": e} for r, e in zip(rows, refit)]
    return {"fixed_seconds": float(fx), "bandwidth_efficiency": float(eb), "compute_efficiency": float(ec),
            "errors_after_refit": grouped_stats(refit_rows, "refit_err")}


def breakdown(engine, m: ModelConfig, h: hw.Hardware) -> dict:
    """Where a step's time goes: the linear layers alone (kernel_profile's matmul floor) as
    fractions of the datasheet's bandwidth and bf16 peak, and a few steps under the torch
    profiler (device time of all kernels against the step's wall time, kernel count, top ops)."""
    from torch.profiler import ProfilerActivity, profile

    from tollway.model.kernel_profile import matmul_floor_seconds
    from tollway.model.machine_profiler import grid_plans

    body, head = hw.linear_parameters(m)
    floors = []
    for n in (1, 16, 64, 256, 512, 2048):
        t = matmul_floor_seconds(engine.runner.model, "bf16", n, repeats=5)
        floors.append({"tokens": n, "seconds": t,
                       "bandwidth_fraction": (body + head) * 2 / t / (h.bandwidth_gb_s * 1e9),
                       "compute_fraction": 2 * (body + head) * n / t / (h.bf16_tflops * 1e12)})
    runner, sched = engine.runner, engine.scheduler.config
    grid = Grid(decodes=(1, 256), contexts=(128, 2048), prefills=(0, 2048))
    plans = {(p.num_decode, max(s.start_pos for s in p.seqs if s.is_decode), p.num_prefill_tokens): p
             for p in grid_plans(sched, ["bf16"], grid)}
    ds, cs, ps = (sorted({k[i] for k in plans}) for i in range(3))
    b0, b1, c0, c1, p1 = ds[0], ds[-1], cs[0], cs[-1], ps[-1]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    steps = []
    for key in dict.fromkeys(((b0, c0, 0), (b1, c0, 0), (b1, c1, 0), (b0, c0, p1))):
        plan = plans[key]
        runner.execute(plan)
        with profile(activities=activities) as prof:
            seconds = runner.execute(plan).seconds
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        ops = sorted(prof.key_averages(), key=lambda a: -a.self_device_time_total)[:8]
        steps.append({"decodes": key[0], "context": key[1], "prefill_tokens": key[2], "wall_s": seconds,
                      "kernels": len(kernels), "kernel_s": sum(e.time_range.elapsed_us() for e in kernels) / 1e6,
                      "top_ops": [{"op": a.key, "calls": a.count, "device_s": a.self_device_time_total / 1e6,
                                   "cpu_s": a.self_cpu_time_total / 1e6} for a in ops]})
        print(f"breakdown {key}: wall {seconds * 1e3:.1f} ms, {len(kernels)} kernels, "
              f"{steps[-1]['kernel_s'] * 1e3:.1f} ms of kernel time", flush=True)
    return {"matmul_floor": floors, "profiled_steps": steps}


# --- the check that `python -m tollway profile` runs as shipped --------------------------------

def cli_check(device: torch.device, work: Path, out: Path) -> dict:
    folder = work / "tiny-llama"
    write_random_folder(TINY, folder, device)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "TOLLWAY_CACHE": str(work / "cache")}
    runs = {}
    for name, extra in (("measured", ["--quick", "--device", device.type, "--kernel", "bf16"]),
                        ("analytic", ["--hardware", "H200"])):
        target = out / f"cli_profile_{name}.json"
        args = [sys.executable, "-m", "tollway", "profile", "--model", str(folder), "--output", str(target), *extra]
        start = time.perf_counter()
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        runs[name] = {"command": " ".join(["python -m tollway profile", *args[5:]]), "returncode": done.returncode,
                      "seconds": time.perf_counter() - start, "stderr_tail": done.stderr[-1500:]}
        if done.returncode == 0:
            profile = json.loads(target.read_text())
            runs[name] |= {"hardware": profile["hardware"], "steps": len(profile["samples"]),
                           "estimate": profile["estimate"]}
            target.unlink()
        print(f"cli check {name}: rc {done.returncode}, {runs[name]['seconds']:.1f} s", flush=True)
    return runs


# --- the run -----------------------------------------------------------------------------------

def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    timings, result = {}, {}
    started = time.perf_counter()
    result["cli_check"] = cli_check(device, work, out)
    result["roofline"] = roofline(device)
    print(f"roofline: {result['roofline']}", flush=True)
    hf_config = TINY if args.quick else json.loads(Path(args.model_config).read_text())
    grid = Grid(**(QUICK if args.quick else FULL))
    folder = work / ("tiny-llama-profiled" if args.quick else Path(args.model_config).parent.name)
    t = time.perf_counter()
    result["folder"] = write_random_folder(hf_config, folder, device)
    timings["write_folder"] = time.perf_counter() - t
    print(f"wrote {result['folder']['bytes'] / 1e9:.1f} GB of random weights in {timings['write_folder']:.1f} s",
          flush=True)
    # Every decode of the grid reads its own blocks at the longest context (block_tables).
    block = 16
    per_seq = -(-(max(grid.contexts) + 1) // block)
    sched = SchedulerConfig(block_size=block, num_blocks=(max(grid.decodes) + 1) * per_seq + 64,
                            max_num_seqs=max(grid.decodes), max_num_batched_tokens=8192 if not args.quick else 512,
                            max_model_len=min(8192, hf_config["max_position_embeddings"]), kernel=args.kernel,
                            speculative_tokens=0)
    config = EngineConfig(model=str(folder), scheduler=sched, device=device.type, cache_dir=str(work / "cache"),
                          profile_steps=False)
    t = time.perf_counter()
    engine = Engine(config)
    timings["engine_start"] = time.perf_counter() - t
    print(f"engine started in {timings['engine_start']:.1f} s ({sched.num_blocks} KV blocks)", flush=True)
    t = time.perf_counter()
    profile = measure(engine, grid)
    timings["measure"] = time.perf_counter() - t
    print(f"profiled {len(profile.samples)} steps in {timings['measure']:.1f} s", flush=True)
    shapes = "a tiny Llama" if args.quick else Path(args.model_config).parent.name
    profile.model = f"{shapes} (random bf16 weights)"
    profile.save(out / "h200_profile_measured.json")
    m = engine.model_config
    h = hw.hardware("H200")
    if args.breakdown:
        try:
            result["breakdown"] = breakdown(engine, m, h)
        except Exception:  # the comparison above is the point; keep it whatever happens here
            result["breakdown"] = {"error": traceback.format_exc()[-2000:]}
            traceback.print_exc()
    result |= analysis(profile.samples, m, h)
    result["measured_profile"] = {"hardware": profile.hardware, "steps": len(profile.samples),
                                  "overhead": profile.overhead, "jitter": profile.jitter, "kv_blocks": sched.num_blocks}
    timings["total"] = time.perf_counter() - started
    model_name = "tiny random Llama" if args.quick else f"{Path(args.model_config).parent.name} (random bf16 weights)"
    return {"command": "python benchmarks/h200_profile.py" + (" --quick" if args.quick else ""),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {**machine_info(), "device": device.type,
                        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                        "cuda": torch.version.cuda},
            "model": model_name, "model_config": hf_config, "kernel": args.kernel,
            "grid": {k: list(v) if isinstance(v, tuple) else v for k, v in (QUICK if args.quick else FULL).items()},
            "seconds": timings, **result}


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def markdown(r: dict, raw: str) -> str:
    a, fit, roof = r["analytic"], r["fit"], r["roofline"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {r['machine'].get('gpu') or r['machine']['cpu']} "
        f"(torch {r['machine']['torch']}, CUDA {r['machine']['cuda']}): {r['model']}, kernel {r['kernel']}, "
        f"{r['measured_profile']['steps']} steps (the engine's start-up profile plus the grid decodes "
        f"{r['grid']['decodes']} × context {r['grid']['contexts']} × prefill {r['grid']['prefills']}), "
        f"each the median of {r['grid']['repeats']}. Raw: `{raw}`.",
        "",
    ]
    if roof:
        lines += [f"Measured ceilings in the same run: copy {roof['copy_gb_s']:.0f} GB/s (read + write; "
                  f"{roof['copy_gb_s'] / a['bandwidth_gb_s']:.2f} of the {a['bandwidth_gb_s']:g} GB/s datasheet), "
                  f"bf16 GEMM 8192³ {roof['gemm_bf16_tflops']:.0f} TFLOP/s "
                  f"({roof['gemm_bf16_tflops'] / a['bf16_tflops']:.2f} of {a['bf16_tflops']:g}).", ""]
    lines += ["Analytic H200 estimate (hardware.py: "
              f"{_pct(a['bandwidth_efficiency'])} of bandwidth, {_pct(a['compute_efficiency'])} of bf16 peak, "
              f"{_ms(a['fixed_seconds'])} ms fixed) against the measured step, relative error (analytic − measured) / measured:",
              "", "| steps | n | median abs | p90 abs | signed median | after refit: median abs | p90 abs |",
              "|---|---|---|---|---|---|---|"]
    for group, label in (("all", "all"), ("decode", "decode-heavy"), ("prefill", "prefill-heavy")):
        e, f = r["errors"][group], fit["errors_after_refit"][group]
        if e["steps"]:
            lines.append(f"| {label} | {e['steps']} | {_pct(e['abs_median'])} | {_pct(e['abs_p90'])} | "
                         f"{e['signed_median'] * 100:+.0f}% | {_pct(f['abs_median'])} | {_pct(f['abs_p90'])} |")
    lines += ["", f"Refit of the same formula to the measurement: fixed {_ms(fit['fixed_seconds'])} ms per step, "
              f"bandwidth efficiency {fit['bandwidth_efficiency']:.2f}, compute efficiency "
              f"{fit['compute_efficiency']:.2f} (hardware.py: {_ms(a['fixed_seconds'])} ms, "
              f"{a['bandwidth_efficiency']}, {a['compute_efficiency']}).", "",
              "| decodes | context | prefill | measured ms | analytic ms (bound) | error |", "|---|---|---|---|---|---|"]
    decodes, contexts, prefills = r["grid"]["decodes"], r["grid"]["contexts"], r["grid"]["prefills"]
    shown = {}
    for s in r["steps"]:  # a few grid corners: fewest, middle and most decodes, shortest and longest context
        key = (s["decodes"], s["context"], s["prefill_tokens"])
        if (s["decodes"] in (decodes[0], decodes[len(decodes) // 2], decodes[-1]) and s["context"] in
                (contexts[0], contexts[-1]) and s["prefill_tokens"] in (0, prefills[-1]) and key not in shown):
            shown[key] = s
    for key in sorted(shown):
        s = shown[key]
        lines.append(f"| {s['decodes']} | {s['context']} | {s['prefill_tokens']} | {_ms(s['measured_s'])} | "
                     f"{_ms(s['analytic_s'])} ({s['analytic_bound']}) | {s['rel_err'] * 100:+.0f}% |")
    bd = r.get("breakdown") or {}
    if bd.get("matmul_floor"):
        lines += ["", "The linear layers alone (every layer's matmuls plus the LM head at n rows, bf16, eager; "
                  "kernel_profile's matmul floor) as fractions of the datasheet:", "",
                  "| rows | ms | of 4800 GB/s (weights once) | of 989 TFLOP/s |", "|---|---|---|---|"]
        lines += [f"| {f['tokens']} | {_ms(f['seconds'])} | {f['bandwidth_fraction']:.2f} | "
                  f"{f['compute_fraction']:.2f} |" for f in bd["matmul_floor"]]
    if bd.get("profiled_steps"):
        lines += ["", "Single steps under the torch profiler (kernel time = the sum of every GPU kernel's time):", "",
                  "| decodes | context | prefill | wall ms | kernels | kernel ms | top kernels by device time |",
                  "|---|---|---|---|---|---|---|"]
        for st in bd["profiled_steps"]:
            top = ", ".join(f"{o['op'][:40]} {_ms(o['device_s'])}" for o in st["top_ops"][:3])
            lines.append(f"| {st['decodes']} | {st['context']} | {st['prefill_tokens']} | {_ms(st['wall_s'])} | "
                         f"{st['kernels']} | {_ms(st['kernel_s'])} | {top} |")
    if r.get("repeat"):
        rep = r["repeat"]
        lines += ["", f"Repeatability: an earlier run of the same script on a fresh machine gave step times within "
                  f"{_pct(rep['abs_median'])} of these at the median and {_pct(rep['abs_p90'])} at p90 "
                  f"({rep['steps']} steps); the {rep['over_100ms_steps']} steps over 100 ms agree within "
                  f"{rep['over_100ms_max'] * 100:.1f}%, while the host-bound small steps wander between 30 and 80 ms."]
    ov = r["measured_profile"]["overhead"]
    lines += ["", f"Engine time per step beside the runner: {_ms(ov[0])} ms + {ov[1] * 1e6:.0f} µs per sequence. "
              f"Start: random weights written in {r['seconds']['write_folder']:.0f} s, engine loaded in "
              f"{r['seconds']['engine_start']:.0f} s, grid timed in {r['seconds']['measure']:.0f} s. "
              "`python -m tollway profile` on the device: " + ", ".join(
                  f"{k} rc {v['returncode']}" for k, v in r["cli_check"].items()) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama and a small grid (any machine)")
    parser.add_argument("--model-config", default=str(LLAMA_8B), help="the HF config.json whose shapes to profile")
    parser.add_argument("--device", help="cuda or cpu (default: cuda where there is one)")
    parser.add_argument("--kernel", default="bf16")
    parser.add_argument("--out", help="folder for the JSON results (default: benchmarks/results, or out/ with --quick)")
    parser.add_argument("--work", default="/tmp/tollway-h200-profile", help="where the model folders are written")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time the linear layers alone and profile a few steps (torch profiler)")
    parser.add_argument("--report", metavar="JSON",
                        help="redo the comparison from a results file's measured profile; rewrite "
                             "results/h200_profile.json and its README section")
    args = parser.parse_args()
    if args.report:
        # The device's timings are kept (the measured profile beside the results): the
        # comparison is redone against the analytic model as it is now.
        path = Path(args.report)
        result = json.loads(path.read_text())
        samples = json.loads((path.parent / "h200_profile_measured.json").read_text())["samples"]
        result |= analysis(samples, ModelConfig.from_hf_config(result["model_config"]), hw.hardware("H200"))
        print(write_record("h200_profile", result, False, markdown))
        return
    args.out = args.out or str(BENCHMARKS / ("out" if args.quick else "results"))
    name = "h200_profile-quick.json" if args.quick else "h200_profile.json"
    try:
        result = run(args)
    except Exception:
        traceback.print_exc()
        raise
    (Path(args.out) / name).write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result, name))
    print(f"\nwrote {Path(args.out) / name}")


if __name__ == "__main__":
    main()
