"""Where a many-stream load's time goes in the engine, without HTTP: waves of b requests (the
bench's prompts, 128 + 128 tokens, greedy, ignore_eos) added at once and stepped to the end, each
wave's time split into steps that prefill and steps that only decode; in the b-wide decode steps,
the LM head's argmax (the pruned one where the CPU takes it) against the rest; and every other
linear layer's matmuls at b rows, timed alone. vs_llamacpp.py's 64-stream load is the same load
through HTTP.

    python benchmarks/wave_split.py          # about 2 min on a 2-core machine
    python benchmarks/wave_split.py --quick  # 16 requests, 32 new tokens; writes benchmarks/out/ only

Writes results/wave_split[-avx2].json and its section of benchmarks/README.md.
"""
from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from tqdm import tqdm  # noqa: E402

from common import command_line, machine_info, run_benchmark, text_prompts  # noqa: E402
from tollway.config import EngineConfig  # noqa: E402
from tollway.engine import Engine  # noqa: E402
from tollway.model.kernel_profile import matmul_floor_seconds  # noqa: E402
from tollway.model.weights import load_weights  # noqa: E402
from tollway.request import SamplingParams  # noqa: E402

FULL = dict(requests=64, prompt_len=128, new_tokens=128, waves=2)
QUICK = dict(requests=16, prompt_len=128, new_tokens=32, waves=1)


def timed_head(engine: Engine) -> list[float]:
    """Seconds of each LM head argmax from now on: the head is the only weight the step asks an
    argmax of, so timing the native library's argmax times the head."""
    library = engine.runner.model.lm_head.native.library
    calls, argmax = [], library.argmax

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = argmax(*args, **kwargs)
        calls.append(time.perf_counter() - start)
        return out

    library.argmax = timed
    return calls


def run(settings: dict, quick: bool) -> dict:
    engine = Engine(EngineConfig(), progress=False, loaded=load_weights(None))
    if (populating := engine.runner.fault_in_kv()) is not None:
        populating.join()
    head_calls = timed_head(engine)
    b, new = settings["requests"], settings["new_tokens"]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    waves = []
    for wave in range(settings["waves"]):
        for ids in text_prompts(b, settings["prompt_len"], 500 + wave):
            engine.add_request(ids, params)
        prefilling = decoding = 0.0
        decode_steps, started = [], time.perf_counter()
        with tqdm(total=b * new, desc=f"wave {wave + 1} of {settings['waves']}", unit="tok") as bar:
            while engine.has_unfinished():
                calls = len(head_calls)
                start = time.perf_counter()
                plan = engine.step().plan
                seconds = time.perf_counter() - start
                if plan.num_prefill_tokens:
                    prefilling += seconds
                else:
                    decoding += seconds
                    if plan.num_decode == b:
                        decode_steps.append({"seconds": seconds, "head": sum(head_calls[calls:])})
                bar.update(plan.num_decode)
        total = time.perf_counter() - started
        waves.append({"seconds": total, "tok_s": b * new / total, "prefill_step_seconds": prefilling,
                      "decode_only_seconds": decoding, "full_width_decode_steps": decode_steps})
    median_wave = sorted(waves, key=lambda w: w["seconds"])[len(waves) // 2]
    steps = median_wave["full_width_decode_steps"]
    return {
        "command": command_line("wave_split.py", " --quick" if quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "settings": settings, "waves": waves,
        "median_wave": {
            "seconds": median_wave["seconds"], "tok_s": median_wave["tok_s"],
            "prefill_step_seconds": median_wave["prefill_step_seconds"],
            "decode_only_seconds": median_wave["decode_only_seconds"],
            "decode_step_seconds": statistics.median(s["seconds"] for s in steps),
            "head_seconds": statistics.median(s["head"] for s in steps),
            "layers_matmul_seconds": matmul_floor_seconds(engine.runner.model, "q8", b, repeats=5, head=False),
        },
    }


def markdown(r: dict, raw: str) -> str:
    m, s, machine = r["median_wave"], r["settings"], r["machine"]
    rest = m["decode_step_seconds"] - m["head_seconds"] - m["layers_matmul_seconds"]
    return (
        f"Measured {r['date'][:10]} with `{r['command']}` on {machine['cpu']} ({machine['cores']} cores, "
        f"{', '.join(machine['isa_flags'])}{'; forced to ' + machine['forced_isa'] if machine['forced_isa'] else ''}). "
        f"Raw: `{raw}`.\n\n"
        f"{s['waves']} wave{'s' if s['waves'] > 1 else ''} of {s['requests']} requests ({s['prompt_len']}-token prompts, {s['new_tokens']} new), "
        f"the median wave: {m['seconds']:.2f} s, **{m['tok_s']:.0f} tok/s**; steps that prefill "
        f"{m['prefill_step_seconds']:.2f} s ({m['prefill_step_seconds'] / m['seconds']:.0%}), steps that only decode "
        f"{m['decode_only_seconds']:.2f} s. A {s['requests']}-wide decode step: {m['decode_step_seconds'] * 1e3:.1f} ms, "
        f"of which the LM head's argmax {m['head_seconds'] * 1e3:.1f} ms "
        f"({m['head_seconds'] / m['decode_step_seconds']:.0%}), the other linear layers' matmuls at "
        f"{s['requests']} rows {m['layers_matmul_seconds'] * 1e3:.1f} ms (timed alone, weights warm), "
        f"attention, norms and the rest {rest * 1e3:.1f} ms."
    )


if __name__ == "__main__":
    run_benchmark("wave_split", __doc__, run, markdown, FULL, QUICK, per_cpu_kind=True)
