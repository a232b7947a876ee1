"""Engine benchmark: tollway's decode and prefill against this machine's own floors and
against Hugging Face transformers on the same weights, all measured in one run.

    python benchmarks/engine.py           # full run: 9 min on a quiet 2-core machine, 20 on a busy one
    python benchmarks/engine.py --quick   # a few minutes, for development; writes benchmarks/out/ only

Every figure that matters is a ratio between two timings taken in this same run, because
the machines it runs on are shared and noisy (see DESIGN.md, "Measuring").
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common import command_line, machine_info, run_benchmark, targets_line, text_prompts  # noqa: E402
from tollway.config import EngineConfig, SchedulerConfig  # noqa: E402
from tollway.engine import Engine  # noqa: E402
from tollway.model.kernel_profile import matmul_floor_seconds, model_linears  # noqa: E402
from tollway.model.native.qmatmul import q8_library  # noqa: E402
from tollway.model.reference import transformers_gemma3  # noqa: E402
from tollway.model.weights import load_weights  # noqa: E402
from tollway.request import SamplingParams  # noqa: E402


FULL = dict(
    batches=(1, 4, 16, 64), prompt_len=128, new_tokens=128, prefill_len=2048, prefill_runs=2,
    # transformers' bf16 GEMMs run at a few GFLOP/s on AVX2, so its bf16 runs get shorter
    # prompts and fewer tokens; a shorter context only makes its decode steps cheaper.
    hf={"fp32": dict(prompt_len=128, new_tokens=32), "bf16": dict(prompt_len=32, new_tokens=8)},
    gemm_n=2048,
)
QUICK = dict(
    batches=(1, 4), prompt_len=128, new_tokens=16, prefill_len=256, prefill_runs=1,
    hf={"fp32": dict(prompt_len=128, new_tokens=8), "bf16": dict(prompt_len=32, new_tokens=4)},
    gemm_n=1024,
)
HF_ATTENTION = "sdpa"  # what transformers picks by default
FLOOR_REPEATS = {"q8": 5, "int8": 5, "fp32": 5, "bf16": 2}  # medians; bf16 is slow here and never the best


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_buffer() -> torch.Tensor:
    return torch.randn(64 * 2**20)  # 256 MiB of float32, far beyond any cache


def read_gb_s(src: torch.Tensor, repeats: int) -> float:
    """Reading alone, the best of `repeats`: what streaming the weights through a decode step needs.
    The native read loop where the kernels build: torch's sum reads well below it, and below what
    the kernels themselves stream at (benchmarks/README.md, gguf_kernels.py)."""
    lib = q8_library()
    if lib is not None:
        return lib.read_peak(src, repeats) / 1e9
    return src.numel() * src.element_size() / best_seconds(src.sum, repeats) / 1e9


@torch.inference_mode()
def roofline(gemm_n: int) -> dict:
    src = read_buffer()
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), 5)
    moved = 2 * src.numel() * src.element_size()  # read + write
    out = {"memcpy_bytes_moved": moved, "memcpy_seconds": copy_s, "memcpy_gb_s": moved / copy_s / 1e9,
           "read_gb_s": read_gb_s(src, 5), "gemm_n": gemm_n}
    a = torch.randn(gemm_n, gemm_n)
    flops = 2 * gemm_n**3
    for dtype, repeats in (("fp32", 5), ("bf16", 2)):
        x = a if dtype == "fp32" else a.to(torch.bfloat16)
        # x @ x.T through F.linear: the layout every linear layer uses
        seconds = best_seconds(lambda: F.linear(x, x), repeats)
        out[f"{dtype}_gemm_seconds"] = seconds
        out[f"{dtype}_gemm_gflop_s"] = flops / seconds / 1e9
    return out


def weight_bytes(model, kernel: str, rows: int) -> int:
    """What a matmul of `rows` rows through every linear layer reads of the weights."""
    per = {"q8": 4, "int8": 1, "bf16": 2, "fp32": 4}[kernel]  # q8 where it runs on torch fp32
    total = 0
    for lin in model_linears(model):
        if kernel == "q8" and lin.native is not None:
            total += lin.native.streamed_bytes()  # each GGUF type at its own width, with its scales, packed
            continue
        total += lin.out_features * lin.in_features * per
        if kernel == "int8":
            total += lin.int8_scales.numel() * lin.int8_scales.element_size()
    return total


def step_bytes(engine: Engine, b: int, context: int) -> dict:
    """What a decode step of b sequences at `context` tokens must read: every packed weight once,
    and each sequence's cached keys and values (full layers all of them, sliding ones the window)."""
    cfg, cache = engine.model_config, engine.runner.caches[0]
    per_position = 2 * cfg.num_kv_heads * cfg.head_dim * cache.k.element_size()
    window = cfg.sliding_window or context
    kv = b * per_position * sum(min(context, window) if kind == "sliding" else context for kind in cfg.layer_types)
    weights = weight_bytes(engine.runner.model, "q8", b)
    return {"weights": weights, "kv": kv, "total": weights + kv, "context": context}


def matmul_flops(model, rows: int) -> int:
    return sum(2 * rows * lin.out_features * lin.in_features for lin in model_linears(model))


def floors_at(b: int, models: dict) -> dict:
    """Matmul-only floor of a b-row step per kernel, with the effective rates it implies."""
    out = {}
    for kernel, model in tqdm(models.items(), desc=f"matmul floors b={b}", leave=False):
        seconds = matmul_floor_seconds(model, kernel, b, repeats=FLOOR_REPEATS[kernel])
        out[kernel] = {"seconds": seconds, "weight_gb_s": weight_bytes(model, kernel, b) / seconds / 1e9,
                       "gflop_s": matmul_flops(model, b) / seconds / 1e9}
    best = min(out, key=lambda k: out[k]["seconds"])
    return {"kernels": out, "best": best, "best_seconds": out[best]["seconds"]}


def profile_step(engine: Engine) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        plan = engine.step().plan
        wall = time.perf_counter() - start
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return plan, {
        "wall_seconds": wall,  # inflated by the profiler itself
        "op_self_seconds": sum(e.self_cpu_time_total for e in ops) / 1e6,
        "top_ops": [{"op": e.key, "calls": e.count, "self_seconds": e.self_cpu_time_total / 1e6} for e in ops[:10]],
    }


def tollway_decode(engine: Engine, b: int, prompt_len: int, new_tokens: int, seed: int, floor_sample=None,
                   temperature: float = 0.0) -> dict:
    """`floor_sample()` runs (untimed) after every few full-width steps: floors measured between
    the steps see the same machine as the steps, which a noisy machine otherwise denies."""
    every = max(2, new_tokens // 8)
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True)
    for ids in text_prompts(b, prompt_len, seed):
        engine.add_request(ids, params)
    steps, full_width_seen, profiled = [], 0, None
    # Inference mode once for the loop, as the server's engine thread runs (ModelRunner.execute).
    with tqdm(total=b * (prompt_len + new_tokens - 1), desc=f"tollway decode b={b}", unit="tok",
              leave=False) as bar, torch.inference_mode():
        while engine.has_unfinished():
            # Profile one full-width decode step, once the run has settled; it is not timed.
            if profiled is None and full_width_seen == 3:
                plan, profiled = profile_step(engine)
                profiled.update(num_decode=plan.num_decode, kernel=plan.kernel)
                bar.update(plan.num_tokens)
                continue
            start = time.perf_counter()
            plan = engine.step().plan
            seconds = time.perf_counter() - start
            steps.append({"seconds": seconds, "num_decode": plan.num_decode,
                          "prefill_tokens": plan.num_prefill_tokens, "kernel": plan.kernel})
            if plan.num_decode == b and not plan.num_prefill_tokens:
                full_width_seen += 1
                if floor_sample is not None and full_width_seen % every == 0:
                    floor_sample()
            bar.update(plan.num_tokens)
    # Only steps where all b sequences decode and nothing prefills: the tail where early
    # finishers have left would otherwise count as b-wide steps.
    decode = [s for s in steps if s["num_decode"] == b and not s["prefill_tokens"]]
    step_s = statistics.median(s["seconds"] for s in decode)
    return {
        "prompt_len": prompt_len, "new_tokens": new_tokens, "num_steps": len(steps),
        "num_decode_steps_timed": len(decode), "median_step_seconds": step_s, "tok_s": b / step_s,
        "kernels": dict(Counter(s["kernel"] for s in decode)), "profile": profiled, "steps": steps,
    }


def tollway_prefill(engine: Engine, length: int, runs: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    attempts = []
    for run in tqdm(range(runs), desc=f"tollway prefill {length}", leave=False):
        [ids] = text_prompts(1, length, 10_000 + run)
        engine.add_request(ids, params)
        steps = []
        with torch.inference_mode():
            while engine.has_unfinished():
                start = time.perf_counter()
                plan = engine.step().plan
                steps.append({"seconds": time.perf_counter() - start, "tokens": plan.num_tokens, "kernel": plan.kernel})
        attempts.append({"seconds": sum(s["seconds"] for s in steps), "steps": steps})
    best = min(a["seconds"] for a in attempts)
    return {"prompt_len": length, "chunk_tokens": engine.config.scheduler.max_num_batched_tokens,
            "seconds": best, "tok_s": length / best, "runs": attempts}


@torch.inference_mode()
def prefill_floor(model, rows: int) -> dict:
    """The 2048-row fp32 floor as kernel_profile defines it (LM head on every row), and without
    the LM head, which a prefill applies only to the last row it samples from."""
    all_linears = matmul_floor_seconds(model, "fp32", rows, repeats=1)
    x = torch.randn(rows, model.lm_head.in_features)
    lm_head = best_seconds(lambda: model.lm_head(x, "fp32"), 1)
    return {"rows": rows, "all_linears_seconds": all_linears, "lm_head_seconds": lm_head,
            "layers_only_seconds": all_linears - lm_head}


@torch.inference_mode()
def hf_decode(model, prompts: list[list[int]], new_tokens: int) -> dict:
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Called once per generated token, so consecutive calls bracket one decode step."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts)

    def generate(n: int) -> tuple[float, list[float]]:
        clock = StepClock()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
        seconds = time.perf_counter() - start
        assert out.shape == (ids.shape[0], ids.shape[1] + n)
        return seconds, [b - a for a, b in zip(clock.times, clock.times[1:])]

    (one, _), (full, steps) = generate(1), generate(new_tokens)
    b = ids.shape[0]
    return {
        "b": b, "prompt_len": ids.shape[1], "new_tokens": new_tokens,
        "generate_1_seconds": one, "generate_n_seconds": full, "step_seconds": steps,
        # generate(1) is the prefill alone (its token comes from the prefill's logits), so the
        # difference holds new_tokens - 1 decode steps.
        "tok_s": b * (new_tokens - 1) / (full - one),
        # tollway's estimator (median step), robust to another process stealing the cores for a while.
        "median_step_seconds": statistics.median(steps), "median_tok_s": b / statistics.median(steps),
    }


def run(settings: dict, quick: bool) -> dict:
    started = time.perf_counter()
    loaded = load_weights(None)
    engine = Engine(EngineConfig(), progress=False, loaded=loaded)  # kernel "auto": q8 where it compiles
    # As `tollway serve` does at start: else the b64 steps, the first to reach most of the pool,
    # each wait for the kernel to clear the pages they first write (4% of such a step in a profile).
    if (populating := engine.runner.fault_in_kv()) is not None:
        populating.join()
    torch_kernels = Engine(EngineConfig(scheduler=SchedulerConfig(dense_kernel="fp32", num_blocks=16)), progress=False,
                           loaded=loaded)  # int8 up to the measured crossover, fp32 above
    bf16 = Engine(EngineConfig(scheduler=SchedulerConfig(kernel="bf16", num_blocks=16)), progress=False,
                  loaded=loaded)
    sched = engine.config.scheduler
    result = {
        "command": command_line("engine.py", " --quick" if quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "settings": {**settings, "kernel": sched.kernel, "int8_max_tokens": sched.int8_max_tokens,
                     "dense_kernel": sched.dense_kernel, "max_num_batched_tokens": sched.max_num_batched_tokens,
                     "floor_repeats": FLOOR_REPEATS},
    }
    print("roofline ...", file=sys.stderr)
    result["roofline"] = roofline(settings["gemm_n"])
    q8 = q8_library()
    result["roofline"]["dot_peak_mac_s"] = q8.dot_peak() if q8 else None  # u8 x s8 multiply-adds, all threads

    models = {"q8": engine.runner.model, "int8": torch_kernels.runner.model, "fp32": torch_kernels.runner.model,
              "bf16": bf16.runner.model}
    result["floors"], result["decode"] = {}, {}
    reading = read_buffer()
    for i, b in enumerate(settings["batches"]):
        result["floors"][b] = floors_at(b, models)
        samples = {k: [] for k in models}
        read_samples, peak_samples = [], []

        def sample(b=b, samples=samples, read_samples=read_samples, peak_samples=peak_samples):
            for kernel, model in models.items():
                samples[kernel].append(matmul_floor_seconds(model, kernel, b, repeats=1))
            read_samples.append(read_gb_s(reading, 1))
            if q8:
                peak_samples.append(q8.dot_peak())

        result["decode"][b] = tollway_decode(engine, b, settings["prompt_len"], settings["new_tokens"], seed=i,
                                             floor_sample=sample)
        result["decode"][b]["bytes_read"] = step_bytes(engine, b, settings["prompt_len"] + settings["new_tokens"] // 2)
        result["decode"][b]["macs"] = matmul_flops(engine.runner.model, b) // 2
        # The floors the ratios use: sampled between the decode steps (back to back as a fallback).
        result["floors"][b]["interleaved"] = {
            k: {"seconds": statistics.median(v) if v else result["floors"][b]["kernels"][k]["seconds"], "samples": v}
            for k, v in samples.items()}
        # This VM's read bandwidth and clock drift (30 to 50 GB/s, 408 to 470 GMAC/s between runs
        # minutes apart), so the read floor and the dot peak too are taken between the decode steps.
        result["floors"][b]["interleaved_read_gb_s"] = {
            "gb_s": statistics.median(read_samples) if read_samples else result["roofline"]["read_gb_s"],
            "samples": read_samples}
        result["floors"][b]["interleaved_dot_peak_mac_s"] = {
            "mac_s": statistics.median(peak_samples) if peak_samples else result["roofline"]["dot_peak_mac_s"],
            "samples": peak_samples}

    # The OpenAI API's default, temperature 1: every row drawn from the full vocabulary.
    result["sampled"] = {}
    for i, b in enumerate(settings["batches"]):
        run = tollway_decode(engine, b, settings["prompt_len"], settings["new_tokens"], seed=i, temperature=1.0)
        result["sampled"][b] = {k: v for k, v in run.items() if k != "steps"}

    print("prefill ...", file=sys.stderr)
    result["prefill_floor"] = prefill_floor(torch_kernels.runner.model, settings["prefill_len"])
    result["prefill"] = tollway_prefill(engine, settings["prefill_len"], settings["prefill_runs"])

    result["transformers"] = {"attn_implementation": HF_ATTENTION}
    for dtype, torch_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = transformers_gemma3(loaded, attn_implementation=HF_ATTENTION, dtype=torch_dtype)
        opts = settings["hf"][dtype]
        # Untimed: a model's first generate also sets up its kernels, which inflated b1's generate(1)
        # (2026-12-06, bf16: 125 tok/s by the difference of the two runs, 20 by the median step).
        hf_decode(hf, [text_prompts(1, settings["prompt_len"], 0)[0][:8]], 2)
        runs = {}
        for i, b in enumerate(tqdm(settings["batches"], desc=f"transformers {dtype}", leave=False)):
            prompts = [p[: opts["prompt_len"]] for p in text_prompts(b, settings["prompt_len"], i)]
            runs[b] = hf_decode(hf, prompts, opts["new_tokens"])
        result["transformers"][dtype] = {**opts, "runs": runs}

    result["summary"] = summarize(result)
    result["machine"]["load_average_at_end"] = os.getloadavg()[0]
    result["total_seconds"] = time.perf_counter() - started
    return result


def summarize(r: dict) -> dict:
    rows = {}
    for b, dec in r["decode"].items():
        floor = {k: v["seconds"] for k, v in r["floors"][b]["interleaved"].items()}
        peak = r["floors"][b]["interleaved_dot_peak_mac_s"]["mac_s"]
        best = min(floor, key=floor.get)
        used = max(dec["kernels"], key=dec["kernels"].get)
        hf = {d: r["transformers"][d]["runs"][b] for d in ("fp32", "bf16")}
        rows[b] = {
            "step_seconds": dec["median_step_seconds"], "tok_s": dec["tok_s"], "kernel_used": used,
            "best_kernel": best, "best_floor_seconds": floor[best],
            "step_over_best_floor": dec["median_step_seconds"] / floor[best],
            "step_over_used_kernel_floor": dec["median_step_seconds"] / floor[used],
            "step_over_int8_floor": dec["median_step_seconds"] / floor["int8"],
            # the bytes the step reads at the read bandwidth measured between its steps, and the integer peak
            "step_over_read_floor": dec["median_step_seconds"]
            / (dec["bytes_read"]["total"] / (r["floors"][b]["interleaved_read_gb_s"]["gb_s"] * 1e9)),
            "of_dot_peak": (dec["macs"] / dec["median_step_seconds"] / peak if peak else None),
            "sampled_step_over_greedy": r["sampled"][b]["median_step_seconds"] / dec["median_step_seconds"],
        }
        for d, run in hf.items():
            rows[b][f"vs_transformers_{d}"] = dec["tok_s"] / run["tok_s"]
            rows[b][f"vs_transformers_{d}_median"] = dec["tok_s"] / run["median_tok_s"]
    pf, pre = r["prefill_floor"], r["prefill"]
    summary = {
        "decode": rows,
        "prefill_over_all_linears_floor": pre["seconds"] / pf["all_linears_seconds"],
        "prefill_over_layers_only_floor": pre["seconds"] / pf["layers_only_seconds"],
    }
    targets = {}
    if 1 in rows:
        targets["b1_step_within_1.25x_read_floor"] = rows[1]["step_over_read_floor"] <= 1.25
    if 64 in rows:
        targets["b64_at_least_half_the_dot_peak"] = (rows[64]["of_dot_peak"] or 0) >= 0.5
        targets["b64_at_least_2x_transformers_bf16"] = rows[64]["vs_transformers_bf16"] >= 2
        targets["b64_at_least_2x_transformers_bf16_by_median_step"] = rows[64]["vs_transformers_bf16_median"] >= 2
    summary["targets"] = targets
    return summary


def markdown(r: dict, raw: str) -> str:
    m, roof, s = r["machine"], r["roofline"], r["summary"]
    ms = lambda sec: f"{sec * 1e3:.1f}"  # noqa: E731
    hf = r["transformers"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {m['cpu']} ({m['cores']} cores, "
        f"{m['cpu_capability']}, avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}), torch {m['torch']} "
        f"with {m['torch_threads']} threads, transformers {m['transformers']}; load average "
        f"{m['load_average_at_start']:.1f} at start, {m['load_average_at_end']:.1f} at end. "
        f"Kernel `auto`: {r['settings']['dense_kernel']}, with int8 for steps of up to "
        f"{r['settings']['int8_max_tokens']} tokens (measured at first start and cached). Raw timings: `{raw}`.",
        "",
        f"Roofline: memcpy {roof['memcpy_gb_s']:.1f} GB/s (read + write), read {roof['read_gb_s']:.1f} GB/s, GEMM {roof['gemm_n']}³ "
        f"fp32 {roof['fp32_gemm_gflop_s']:.1f} GFLOP/s, bf16 {roof['bf16_gemm_gflop_s']:.2f} GFLOP/s"
        + (f", integer dot-product peak {roof['dot_peak_mac_s'] / 1e9:.0f} GMAC/s." if roof.get("dot_peak_mac_s") else "."),
        "",
        f"Decode (b sequences with {r['settings']['prompt_len']}-token prompts and "
        f"{r['settings']['new_tokens']} new tokens; step = median of the steps where all b decode "
        "and nothing prefills; floor = every linear layer plus the LM head at b rows, the median of "
        "samples taken between the decode steps, ms; read floor = the bytes the step reads at the read "
        "bandwidth sampled there too, and the dot peak too is sampled there):",
        "",
        "| b | kernel used | step ms | tok/s | q8 floor | int8 floor | fp32 floor | bf16 floor | best "
        "| step / best floor | bytes read MB | read GB/s | step / read floor | of dot peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for b, row in s["decode"].items():
        k = r["floors"][b]["interleaved"]
        lines.append(
            f"| {b} | {row['kernel_used']} | {ms(row['step_seconds'])} | {row['tok_s']:.1f} | "
            f"{ms(k['q8']['seconds'])} | {ms(k['int8']['seconds'])} | {ms(k['fp32']['seconds'])} | "
            f"{ms(k['bf16']['seconds'])} | "
            f"{row['best_kernel']} | {row['step_over_best_floor']:.2f} | "
            f"{r['decode'][b]['bytes_read']['total'] / 1e6:.0f} | "
            f"{r['floors'][b]['interleaved_read_gb_s']['gb_s']:.1f} | {row['step_over_read_floor']:.2f} | "
            f"{row['of_dot_peak'] or 0:.0%} |")
    lines += [
        "",
        f"Against transformers `generate` (greedy, {hf['attn_implementation']} attention; fp32 with "
        f"{hf['fp32']['prompt_len']}-token prompts and N = {hf['fp32']['new_tokens']} new tokens, bf16 with "
        f"{hf['bf16']['prompt_len']}-token prompts and N = {hf['bf16']['new_tokens']}). Each transformers figure is "
        "given two ways: b × (N − 1) / (t(N tokens) − t(1 token)), then b / its median decode step, "
        "the estimator used for tollway:",
        "",
        "| b | tollway tok/s | HF fp32 tok/s | HF bf16 tok/s | × HF fp32 | × HF bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for b, row in s["decode"].items():
        runs = {d: hf[d]["runs"][b] for d in ("fp32", "bf16")}
        lines.append(
            f"| {b} | {row['tok_s']:.1f} | "
            + " | ".join(f"{runs[d]['tok_s']:.1f} / {runs[d]['median_tok_s']:.1f}" for d in runs) + " | "
            + " | ".join(f"{row[f'vs_transformers_{d}']:.2f} / {row[f'vs_transformers_{d}_median']:.2f}" for d in runs)
            + " |")
    lines += ["", "Sampling at temperature 1 (the OpenAI default), each step's time over a greedy step's: "
              + ", ".join(f"b{b} {row['sampled_step_over_greedy']:.2f}x ({ms(r['sampled'][b]['median_step_seconds'])} ms)"
                          for b, row in s["decode"].items()) + "."]
    pre, pf = r["prefill"], r["prefill_floor"]
    lines += [
        "",
        f"Prefill of one {pre['prompt_len']}-token prompt in chunks of {pre['chunk_tokens']}: "
        f"{pre['tok_s']:.0f} tok/s ({pre['seconds']:.2f} s). fp32 floor at {pf['rows']} rows: "
        f"{pf['all_linears_seconds']:.2f} s with the LM head on every row "
        f"(prefill / floor {s['prefill_over_all_linears_floor']:.2f}), {pf['layers_only_seconds']:.2f} s without it "
        f"(prefill / floor {s['prefill_over_layers_only_floor']:.2f}).",
    ]
    if s["targets"]:
        lines += ["", targets_line(s["targets"])]
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("engine", __doc__, run, markdown, FULL, QUICK, per_cpu_kind=True)
