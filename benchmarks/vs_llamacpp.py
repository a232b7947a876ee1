"""Side by side with the peer: `tollway serve` and llama.cpp's `llama-server` on the same GGUF (the
default Gemma 3 270M Q4_K_M, or --model), one after the other in one run, under the same
`tollway bench` loads, with their speed and their memory.

    python benchmarks/vs_llamacpp.py          # about 14 min on a 2-core machine (+ a first build)
    python benchmarks/vs_llamacpp.py --quick  # a few minutes, for development; writes benchmarks/out/ only
    python benchmarks/vs_llamacpp.py --threads 1  # both servers on one thread: for a busy machine (see below)
    python benchmarks/vs_llamacpp.py --model PATH.gguf  # on another GGUF (benchmarks/models.py makes test ones)
    python benchmarks/vs_llamacpp.py --model PATH.gguf --large  # a 4B or 8B: each load once, 32 new tokens

A run with --model writes benchmarks/results/vs_llamacpp-<the file's stem>.json (and the CPU kind's
suffix, as the default's record has) and a README section of its own, which names the file, its
size and its tensor bytes by GGML type.

Both servers get the same KV, CONTEXT_TOKENS (32768) tokens in all, and 64 sequences at a time:
tollway's pool of 2048 blocks of 16 tokens (set in a config file), `llama-server -c 32768 -np 64`
(its KV split in 64 slots of 512 tokens), and for the loads whose requests outgrow a slot (the
2048-token prompt) a second llama-server with the same flags and -kvu, one KV the slots share
(see _llama_server_command for why not -kvu throughout). Memory, from /proc/<pid>/status: the
resident set once the server answers /health and has been idle IDLE_SECONDS (with its anonymous
and file-backed parts: llama-server maps the GGUF), and the peak (VmHWM) after each load.

The peer is built on the first run: `llama-server`, `llama-batched-bench` and `llama-quantize` from the
`vendor/llama.cpp` of the pinned `llama-cpp-python` sdist on PyPI, with CMake and
`-DGGML_NATIVE=ON`, into the user cache (`<cache>/tollway/llama.cpp/<version>/`); later runs
reuse it. A build that crashes on the default GGUF on a CPU with AMX is rebuilt without AMX (see
peer_binaries). Needs cmake and a C++ compiler for that first build.

    TOLLWAY_ISA=avx2 python benchmarks/vs_llamacpp.py  # AVX2 against AVX2 on a CPU with more

With TOLLWAY_ISA naming a path below the CPU's best, tollway runs that path's kernels and the peer
is built (into `<version>-<path>/`) with only the instruction sets that path has, so an AVX-512
machine measures the AVX2-only kind; the record is vs_llamacpp-forced-avx2, not this CPU's.

Loads, each with its own prompts (the same prompts for both servers; `ignore_eos`, so both
generate exactly the requested tokens; greedy): 1 stream, 16 and 64 concurrent streams (128-token
prompts, 128 new tokens), and the TTFT of a 2048-token prompt. The first wave of each load
warms the server up and is not measured; the 1- and 64-stream loads run in 3 alternating
rounds (fresh prompts each), and the median round stands for each. Every figure is a ratio
tollway / llama-server from this one run, beside both servers' idle and peak resident memory.
`llama-batched-bench` adds the peer's engine alone, without HTTP. Writes
benchmarks/results/vs_llamacpp.json and a section of benchmarks/README.md.

Run it on a quiet machine. llama.cpp's threads meet at a barrier after every op, so when other
work oversubscribes the cores, a pool with a thread per core collapses (measured here at load
average 7 on 2 cores: 3.5 tok/s for one stream with 2 threads, 30 with 1) while tollway loses
far less, and the ratios flatter tollway. The record keeps the load average while each server
ran and the section says when the machine was busy; `--threads 1` keeps both servers usable there.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from bench_example import free_port  # noqa: E402
from common import (command_line, forced_isa, gguf_summary, gguf_summary_line, machine_info,  # noqa: E402
                    run_benchmark, targets_line)
from tollway.bench.run import BenchConfig, run_bench  # noqa: E402
from tollway.checkpoint import DEFAULT_MODEL, cache_root, resolve_model, tokenizer_path  # noqa: E402
from tollway.text.tokenizer import Tokenizer  # noqa: E402
from tollway.traffic.patterns import Limits, LoadPattern  # noqa: E402
from tollway.traffic.workload import Lengths, Workload  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is the peer; bump to move the peer on
# llama-quantize: benchmarks/models.py quantizes its test models with llama.cpp's own (peer_tool)
PEER_TARGETS = ("llama-server", "llama-batched-bench", "llama-quantize")
WARMUP_SECONDS = 0.5  # every request sent this early in a load (its first wave) only warms up
# Both servers get the same KV and slots: this many tokens of KV in all, and 64 sequences at a time
# (-np 64; tollway admits up to 128 less fast's reserved seats, so neither caps the 64-stream load).
# See _llama_server_command for how llama-server lays its KV out for each load.
CONTEXT_TOKENS = 32768
SLOTS = 64
TOLLWAY_BLOCK = 16  # tokens a tollway KV block holds (its default)
IDLE_SECONDS = 5.0  # after /health first answers, before the idle resident memory is read
START_LIMIT_SECONDS = 1800  # a first tollway start on a big GGUF converts it and measures its kernels


@dataclass
class Load:
    name: str
    concurrency: int
    prompt_tokens: int
    output_tokens: int
    requests: int  # measured, after the first wave
    seed: int  # a seed per load: no load's prompts repeat another's, so no prefix cache helps
    rounds: int = 1  # measured this many times, alternating with the other loads that repeat


# The machine drifts by 10-20% within minutes (its other tenants), as much as the figures under
# test: the loads whose ratio is a target (1 and 64 streams) run in alternating rounds, and the
# median round stands for each.
ROUNDS = 3
# Measured requests per stream of a concurrent load. Equal prompts and outputs keep a closed loop
# in waves (every prompt of a wave arrives at once, then all decode), and one wave's window is
# mostly its ramp and drain: against tollway serve at 64 streams, one measured wave read 554-585
# tok/s and two 600-614 (fresh prompts each time, alternating, in one hour).
WAVES = 2


FULL = dict(loads=[Load("1 stream", 1, 128, 128, 6, 1, ROUNDS), Load("16 streams", 16, 128, 128, 16 * WAVES, 2),
                   Load("64 streams", 64, 128, 128, 64 * WAVES, 3, ROUNDS), Load("2048-token prompt", 1, 2048, 1, 2, 4)],
            batched_bench=dict(npp=128, ntg=128, npl=(1, 16, 64)))
# --large, for a model of several GB (4B, 8B) on a small machine, where FULL's loads take hours:
# each load once, 32 new tokens a request; 64 streams' one measured wave still gives that load's
# peak memory and its speed. A record, as FULL's is.
LARGE = dict(loads=[Load("1 stream", 1, 128, 32, 3, 1), Load("64 streams", 64, 128, 32, 64, 3),
                    Load("2048-token prompt", 1, 2048, 1, 1, 4)],
             batched_bench=dict(npp=128, ntg=32, npl=(1, 64)))
QUICK = dict(loads=[Load("1 stream", 1, 128, 32, 2, 1), Load("16 streams", 16, 128, 32, 16, 2),
                    Load("2048-token prompt", 1, 2048, 1, 1, 4)],
             batched_bench=dict(npp=128, ntg=32, npl=(1, 16)))


# --- The peer's binaries --------------------------------------------------------------------

NATIVE = "GGML_NATIVE"
NATIVE_WITHOUT_AMX = "this CPU's instruction sets without AMX"
# GGML_NATIVE's own options for the instruction sets it would enable, by /proc/cpuinfo flag
GGML_ISA_OPTIONS = (("sse4_2", "GGML_SSE42"), ("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("bmi2", "GGML_BMI2"),
                    ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"), ("avx_vnni", "GGML_AVX_VNNI"),
                    ("avx512f", "GGML_AVX512"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                    ("avx512_vnni", "GGML_AVX512_VNNI"), ("avx512_bf16", "GGML_AVX512_BF16"))
# Of those, the flags a peer may use beside tollway forced to a lower path (TOLLWAY_ISA): the same
# instruction sets as that path's kernels.
FORCED_PEER_FLAGS = {"portable": (), "avx2": ("sse4_2", "avx", "avx2", "bmi2", "fma", "f16c")}
FORCED_PEER_FLAGS["avxvnni"] = FORCED_PEER_FLAGS["avx2"] + ("avx_vnni",)


def peer_binaries() -> dict:
    """{'folder', 'build', 'build_seconds', ...}: llama.cpp built for this CPU, from the cache or built
    now, and checked once on the default GGUF. Where the GGML_NATIVE build crashes there and the
    CPU has AMX (its AMX matmul died of SIGSEGV on Gemma 3 270M on a Xeon with AMX), the peer is
    rebuilt with every instruction set GGML_NATIVE would use but AMX: what a user does next."""
    forced = forced_isa()
    folder = cache_root() / "llama.cpp" / (LLAMA_CPP_PYTHON + (f"-{forced}" if forced else ""))
    stamp = folder / "build.json"
    cpu = _cpu_flags()
    built, built_now = json.loads(stamp.read_text()) if stamp.is_file() else None, False
    if built and built["cpu_flags"] != cpu:
        print("vs_llamacpp: the cached llama.cpp was built for another CPU; rebuilding", file=sys.stderr)
        built = None
    elif built and (missing := [t for t in PEER_TARGETS if not (folder / t).is_file()]):
        # a cache from before a target joined PEER_TARGETS: the same build again, with every target
        print(f"vs_llamacpp: the cached llama.cpp lacks {', '.join(missing)}; rebuilding it", file=sys.stderr)
        options = built.get("build_options") or ["-DGGML_NATIVE=ON"]
        built, built_now = built | _build_peer(folder, options), True
    if built is None and forced:
        options = ["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if flag in cpu and flag in FORCED_PEER_FLAGS[forced] else 'OFF'}"
                                           for flag, option in GGML_ISA_OPTIONS]
        built, built_now = _build_peer(folder, options) | {
            "build": f"the instruction sets of tollway's {forced} kernels", "build_options": options}, True
    elif built is None:
        built, built_now = _build_peer(folder, ["-DGGML_NATIVE=ON"]) | {"build": NATIVE}, True
    built.setdefault("build", NATIVE)  # a stamp from before the check
    if "checked" not in built:
        crash = _crash_of(folder)
        if crash and built["build"] == NATIVE and "amx_int8" in cpu:
            print(f"vs_llamacpp: the GGML_NATIVE llama.cpp {crash} on the default GGUF; rebuilding it without AMX",
                  file=sys.stderr)
            options = ["-DGGML_NATIVE=OFF"] + [f"-D{option}={'ON' if flag in cpu else 'OFF'}"
                                               for flag, option in GGML_ISA_OPTIONS]
            built, built_now = _build_peer(folder, options) | {
                "build": NATIVE_WITHOUT_AMX, "build_options": options,
                "why": f"the GGML_NATIVE build (AMX on) {crash} on the default GGUF"}, True
            crash = _crash_of(folder)
        if crash:
            raise SystemExit(f"vs_llamacpp: llama.cpp's llama-batched-bench {crash} on the default GGUF")
        built["checked"] = True
    built |= {"cpu_flags": cpu, "llama_cpp_python": LLAMA_CPP_PYTHON}
    stamp.write_text(json.dumps(built, indent=1) + "\n")
    return built | {"folder": str(folder), "built_now": built_now}


def peer_tool(name: str) -> Path:
    """The path of one of the peer's binaries (PEER_TARGETS: `llama-quantize` for
    benchmarks/models.py), built first where the cache has none."""
    if name not in PEER_TARGETS:
        raise ValueError(f"{name} is not one of the peer's binaries: {', '.join(PEER_TARGETS)}")
    return Path(peer_binaries()["folder"]) / name


def _crash_of(folder: Path) -> str | None:
    """None when llama-batched-bench runs a short prefill and decode at 1 and 8 sequences, else how it died."""
    command = [str(folder / "llama-batched-bench"), "-m", str(resolve_model(DEFAULT_MODEL)), "-c", "1024",
               "-npp", "32", "-ntg", "4", "-npl", "1,8"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return f"died of {signal.Signals(-done.returncode).name}" if done.returncode < 0 else f"exited {done.returncode}"


def _cpu_flags() -> list[str]:
    # GGML_NATIVE compiles for this CPU's instruction set: a cache shared with another CPU must rebuild.
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return sorted(line.partition(":")[2].split())
    return []


def _build_peer(folder: Path, isa_options: list[str]) -> dict:
    missing = [tool for tool in ("cmake", os.environ.get("CXX", "c++"), os.environ.get("CC", "cc"))
               if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"vs_llamacpp: building llama.cpp needs cmake and a C/C++ compiler; not found: "
                         f"{', '.join(missing)}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tollway-llama.cpp-") as tmp:
        tmp = Path(tmp)
        print(f"vs_llamacpp: downloading the llama-cpp-python {LLAMA_CPP_PYTHON} sdist for its llama.cpp",
              file=sys.stderr)
        _run_or_exit([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                      f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(tmp)], "pip download llama-cpp-python")
        with tarfile.open(next(tmp.glob("llama_cpp_python-*.tar.gz"))) as sdist:
            # llama.cpp, and the changelog that names its commit
            wanted = [m for m in sdist.getmembers() if "/vendor/llama.cpp/" in m.name
                      or (m.name.endswith("/CHANGELOG.md") and m.name.count("/") == 1)]
            sdist.extractall(tmp, members=wanted, filter="data")
        source = next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"))
        commit = _vendored_commit(source.parent.parent / "CHANGELOG.md")
        build = tmp / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run_or_exit(["cmake", "-S", str(source), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
                      *isa_options, "-DLLAMA_CURL=OFF",
                      # static, so the two binaries are all the cache keeps; and nothing the run
                      # does not need (no tests, examples, web UI download or TLS)
                      "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                      "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"],
                     "cmake configure")
        _build_with_progress(["cmake", "--build", str(build), "--parallel", str(os.cpu_count()),
                              "--target", *PEER_TARGETS], tmp / "build.log")
        folder.mkdir(parents=True, exist_ok=True)
        for target in PEER_TARGETS:
            shutil.copy2(build / "bin" / target, folder / target)
    return {"llama_cpp_commit": commit, "build_seconds": round(time.perf_counter() - start, 1),
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _vendored_commit(changelog: Path) -> str | None:
    """The llama.cpp commit the sdist vendors, as its changelog names it (the vendored copy has no .git)."""
    if not changelog.is_file():
        return None
    section = changelog.read_text().partition(f"## [{LLAMA_CPP_PYTHON}]")[2].partition("\n## [")[0]
    found = re.search(r"llama\.cpp@([0-9a-f]{7,40})", section)
    return found[1] if found else None


def _run_or_exit(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vs_llamacpp: {what} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def _build_with_progress(command: list[str], log: Path) -> None:
    """The build under a bar fed by its own counter: ninja's [n/N] or make's [ n%]."""
    counter = re.compile(r"^\[\s*(\d+)(?:/(\d+)|%)\]")
    with open(log, "w") as out, tqdm(desc="building llama.cpp", unit="step") as bar:
        build = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in build.stdout:
            out.write(line)
            if match := counter.match(line):
                bar.total = int(match[2] or 100)
                bar.update(int(match[1]) - bar.n)
    if build.wait() != 0:
        raise SystemExit(f"vs_llamacpp: building llama.cpp failed:\n{log.read_text()[-3000:]}")


# --- The two servers ------------------------------------------------------------------------

def _llama_server_command(folder: Path, gguf: Path, served: str, port: int, threads: int,
                          unified: bool = False) -> list[str]:
    """-c CONTEXT_TOKENS -np SLOTS: the KV split into SLOTS equal slots (what an explicit -np does),
    512 tokens each, where every request of the stream loads fits; or, with `unified`, one buffer
    the slots share (-kvu, llama-server's default layout with -np auto), where one request may fill
    it all, as in tollway's paged pool: for the loads whose requests outgrow a slot (the 2048-token
    prompt). Not unified for every load: with 64 sequences in one buffer, the CPU flash attention's
    tiled path (64 query rows a tile, all 64 decode rows in one) computes each row against every
    cell in use, the other sequences' too: llama-batched-bench on the default GGUF, 64 sequences
    of 128 + 32 tokens, 1 thread, decoded 40-42 tok/s with -kvu and 97-111 without it."""
    return [str(folder / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--alias", served, "-np", str(SLOTS), "-c", str(CONTEXT_TOKENS), *(["-kvu"] if unified else []),
            "-t", str(threads), "-tb", str(threads), "--cont-batching"]


def _tollway_command(model: str, served: str, port: int, data: Path, threads: int) -> list[str]:
    """tollway serve with its defaults, but a KV pool of exactly CONTEXT_TOKENS tokens (its
    [scheduler] num_blocks, written to a config file: the same count of tokens as llama-server's
    -c, whatever bytes a token's KV takes in each)."""
    config = data / "vs_llamacpp.toml"
    config.write_text(f"[scheduler]\nblock_size = {TOLLWAY_BLOCK}\nnum_blocks = {CONTEXT_TOKENS // TOLLWAY_BLOCK}\n")
    return [sys.executable, "-m", "tollway", "serve", *([] if model == DEFAULT_MODEL else ["--model", model]),
            "--served-model-name", served, "--port", str(port), "--threads", str(threads),
            "--config", str(config), "--data-dir", str(data), "--keys-db", str(data / "keys.sqlite")]


@contextmanager
def serving(name: str, command: list[str], port: int, log: Path, poll_seconds: float = 1.0,
            environment: dict[str, str] | None = None):
    """A server started, healthy (/health asked every `poll_seconds`), and stopped (SIGINT, then
    kill) when the block ends; `environment`: variables for it beside this process's."""
    # PYTHONPATH: tollway serve runs this checkout's tollway, as the bench process does.
    env = {**os.environ, **(environment or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_LIMIT_SECONDS
        with tqdm(desc=f"starting {name}", unit="s", bar_format="{desc}: {elapsed}") as bar:
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"vs_llamacpp: {name} exited with {server.returncode} before it was "
                                     f"healthy:\n{log.read_text()[-3000:]}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"vs_llamacpp: {name} was not healthy after {START_LIMIT_SECONDS} s; "
                                     f"its log: {log}")
                time.sleep(poll_seconds)
                bar.update(poll_seconds)
        yield server
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def resident_memory(pid: int) -> dict:
    """Peak and current resident set of a process, in MiB (/proc/<pid>/status), and the current
    one's parts: anonymous (heap: converted weights, KV, buffers) and file-backed (mapped files,
    such as a GGUF read in place) pages."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)

    def mib(name: str) -> float:
        return int(fields[name].split()[0]) / 1024 if name in fields else float("nan")

    return {"peak_mib": mib("VmHWM"), "now_mib": mib("VmRSS"), "anon_mib": mib("RssAnon"), "file_mib": mib("RssFile")}


def run_loads(name: str, command: list[str], port: int, served: str, loads: list[Load], tokenizer,
              log: Path) -> dict:
    """Each load's figures: its median round by output tok/s (by TTFT for a prompt alone), and
    every round's. Round r of every load that repeats runs before round r + 1 of any. Memory: the
    resident set once the server is up and idle (IDLE_SECONDS after /health first answers), the
    peak (VmHWM) after each load's last round, and both at the end."""
    with serving(name, command, port, log) as server:
        time.sleep(IDLE_SECONDS)
        idle, peak_after = resident_memory(server.pid), {}
        print(f"{name}: idle resident memory {idle['now_mib']:.0f} MiB ({idle['anon_mib']:.0f} anonymous, "
              f"{idle['file_mib']:.0f} file-backed)", file=sys.stderr)
        rounds, load_average = {load.name: [] for load in loads}, {"start": os.getloadavg()[0]}
        for r in range(max(load.rounds for load in loads)):
            for load in (load for load in loads if load.rounds > r):
                print(f"{name}: {load.name}" + (f", round {r + 1} of {load.rounds}" if load.rounds > 1 else ""),
                      file=sys.stderr)
                # Fresh prompts every round, the same ones for both servers.
                workload = Workload(Lengths(load.prompt_tokens, 0, load.prompt_tokens, load.prompt_tokens),
                                    Lengths(load.output_tokens, 0, load.output_tokens, load.output_tokens),
                                    ignore_eos=True, seed=load.seed + 1000 * r)
                config = BenchConfig(f"http://127.0.0.1:{port}", served, workload,
                                     Limits(max_requests=load.requests, warmup=WARMUP_SECONDS),
                                     [LoadPattern(load.name, concurrency=load.concurrency)], label=name)
                rounds[load.name].append(_load_figures(run_bench(config, tokenizer, show=True)))
                peak_after[load.name] = resident_memory(server.pid)["peak_mib"]
        load_average["end"] = os.getloadavg()[0]
        figures = {}
        for load in loads:
            by = (lambda f: f["ttft_p50_s"]) if load.output_tokens == 1 else (lambda f: f["output_tok_s"])
            figures[load.name] = {**sorted(rounds[load.name], key=by)[len(rounds[load.name]) // 2],
                                  "rounds": rounds[load.name]}
        memory = resident_memory(server.pid) | {"idle": idle, "peak_after_mib": peak_after}
        return {"loads": figures, "memory": memory, "load_average": load_average}


def _load_figures(result: dict) -> dict:
    """What a load's bench result says about the server, in seconds and tokens."""
    stage = result["stages"][0]
    s = stage["summary"]["all"]
    measured = [r for r in stage["requests"] if not r["warmup"] and r["error"] is None]
    return {"completed": s["completed"], "errors": s["errors"], "window_s": stage["summary"]["window"],
            "output_tok_s": s["output_tok_s"], "ttft_p50_s": s["ttft"]["p50"], "ttft_p90_s": s["ttft"]["p90"],
            "tpot_p50_s": s["tpot"]["p50"], "tok_s_per_user_p50": s["tok_s_per_user"]["p50"],
            "prompt_tokens": sorted({r["prompt_tokens"] for r in measured}),
            "output_tokens": sorted({r["output_tokens"] for r in measured})}


def batched_bench(folder: Path, gguf: Path, settings: dict, threads: int) -> list[dict]:
    """llama-batched-bench's rows (JSONL): the peer's engine alone, prompts not shared."""
    npl = settings["npl"]
    context = max(npl) * (settings["npp"] + settings["ntg"]) * 2  # room to spare in each sequence's split
    command = [str(folder / "llama-batched-bench"), "-m", str(gguf), "-c", str(context),
               "-b", "2048", "-ub", "512", "-npp", str(settings["npp"]), "-ntg", str(settings["ntg"]),
               "-npl", ",".join(map(str, npl)), "-t", str(threads), "-tb", str(threads),
               "--output-format", "jsonl"]
    print(f"llama-batched-bench: B = {', '.join(map(str, npl))}", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"vs_llamacpp: llama-batched-bench failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


# --- The run --------------------------------------------------------------------------------

def _tollway_source() -> dict:
    """The commit this checkout is at, and its uncommitted changes under tollway/: what was measured."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"),
            "uncommitted": git("status", "--porcelain", "--", "tollway").splitlines()}


def run(settings: dict, quick: bool) -> dict:
    if settings.get("large") and not quick:
        settings = {**settings, **LARGE}
    machine, source = machine_info(), _tollway_source()  # before the servers start: others may commit meanwhile
    peer = peer_binaries()
    model = settings.get("model") or DEFAULT_MODEL
    folder, gguf = Path(peer["folder"]), resolve_model(model)
    if gguf.is_dir():
        raise SystemExit(f"vs_llamacpp: --model must be a GGUF file (llama-server reads no other), not {gguf}")
    served = DEFAULT_MODEL if model == DEFAULT_MODEL else gguf.stem  # the model name both servers answer to
    loads, threads = settings["loads"], settings["threads"]
    if machine["load_average_at_start"] + threads > machine["cores"] + 1:
        print(f"vs_llamacpp: warning: load average {machine['load_average_at_start']:.1f} on {machine['cores']} cores "
              f"before the servers start: with {threads} threads each, llama-server may crawl and the ratios "
              "flatter tollway; a quiet machine (or --threads 1) gives figures that mean something", file=sys.stderr)
    tokenizer = Tokenizer.load(tokenizer_path(model))  # the prompts are this model's tokens
    servers = {}
    with tempfile.TemporaryDirectory(prefix="tollway-vs-llamacpp-") as tmp:
        tmp = Path(tmp)
        port = free_port()
        ours = _tollway_command(model if model == DEFAULT_MODEL else str(gguf), served, port, tmp, threads)
        servers["tollway"] = run_loads("tollway", ours, port, served, loads, tokenizer, tmp / "tollway.log")
        tollway_command = "tollway " + _shown(ours[3:], gguf).replace(str(tmp), "<tmp>")
        # llama-server's split slots for the loads whose requests fit one, its unified KV for the rest
        split = [load for load in loads if load.prompt_tokens + load.output_tokens <= CONTEXT_TOKENS // SLOTS]
        rest = [load for load in loads if load not in split]
        port = free_port()
        llama = _llama_server_command(folder, gguf, served, port, threads)
        servers["llama-server"] = run_loads("llama-server", llama, port, served, split, tokenizer,
                                            tmp / "llama-server.log")
        llama_unified = None
        if rest:
            port_unified = free_port()
            llama_unified = _llama_server_command(folder, gguf, served, port_unified, threads, unified=True)
            servers["llama-server"] = _merged(servers["llama-server"], run_loads(
                "llama-server -kvu", llama_unified, port_unified, served, rest, tokenizer,
                tmp / "llama-server-kvu.log"))
    engine_alone = batched_bench(folder, gguf, settings["batched_bench"], threads)
    machine["load_average_at_end"] = os.getloadavg()[0]
    flags = ((f" --model {settings['model']}" if settings.get("model") else "") + (" --quick" if quick else "")
             + (" --large" if settings.get("large") and not quick else "")
             + (f" --threads {threads}" if threads != os.cpu_count() else ""))
    return {"command": command_line("vs_llamacpp.py", flags), "threads": threads,
            "date": datetime.date.today().isoformat(), "machine": machine, "tollway_source": source,
            "peer": {"llama_cpp_python": LLAMA_CPP_PYTHON, "llama_cpp_commit": peer["llama_cpp_commit"],
                     "build": peer["build"], "build_options": peer.get("build_options"), "why": peer.get("why"),
                     "build_seconds": peer["build_seconds"], "built_now": peer["built_now"],
                     "llama_server_command": _shown(llama, gguf),
                     "llama_server_unified_command": _shown(llama_unified, gguf) if llama_unified else None,
                     "unified_loads": [load.name for load in rest]},
            "tollway_command": tollway_command, "context_tokens": CONTEXT_TOKENS, "slots": SLOTS,
            "idle_seconds": IDLE_SECONDS, "gguf": gguf.name, "model": gguf_summary(gguf),
            "loads": [asdict(load) for load in loads], "servers": servers,
            "ratios": ratios(servers, loads), "llama_batched_bench": engine_alone}


def _shown(command: list[str], gguf: Path) -> str:
    """A server's command line as the record shows it: no paths or ports of this run."""
    shown = " ".join([Path(command[0]).name, *command[1:]]).replace(str(gguf), "<gguf>")
    return re.sub(r"--port \d+", "--port <port>", shown)


def _merged(first: dict, then: dict) -> dict:
    """One server's figures from two instances run one after the other (llama-server's split and
    unified KV): the loads of both; the first's idle memory; the higher peak."""
    memory = first["memory"] | {"peak_mib": max(first["memory"]["peak_mib"], then["memory"]["peak_mib"]),
                                "peak_after_mib": first["memory"]["peak_after_mib"] | then["memory"]["peak_after_mib"]}
    return {"loads": first["loads"] | then["loads"], "memory": memory,
            "load_average": {"start": first["load_average"]["start"], "end": then["load_average"]["end"]},
            "instances": [{"loads": list(one["loads"]), "memory": one["memory"], "load_average": one["load_average"]}
                          for one in (first, then)]}


def ratios(servers: dict, loads: list[Load]) -> dict:
    """tollway / llama-server per figure: above 1 is better for tok/s, below 1 for TTFT."""
    ours, peer = servers["tollway"]["loads"], servers["llama-server"]["loads"]
    out = {}
    for load in loads:
        keys = ["ttft_p50_s"] if load.output_tokens == 1 else ["output_tok_s", "tok_s_per_user_p50", "ttft_p50_s"]
        out[load.name] = {k: ours[load.name][k] / peer[load.name][k] for k in keys}
    out["peak_memory"] = servers["tollway"]["memory"]["peak_mib"] / servers["llama-server"]["memory"]["peak_mib"]
    out["idle_memory"] = (servers["tollway"]["memory"]["idle"]["now_mib"]
                          / servers["llama-server"]["memory"]["idle"]["now_mib"])
    return out


def targets(r: dict) -> dict[str, bool]:
    """Issue 20's targets, where this run measured their loads."""
    q, ours = r["ratios"], r["servers"]["tollway"]["loads"]
    found = {}
    if "1 stream" in q:
        found["1_stream_tok_s_at_least_1x"] = q["1 stream"]["tok_s_per_user_p50"] >= 1.0
        found["1_stream_ttft_at_most_1x"] = q["1 stream"]["ttft_p50_s"] <= 1.0
    if "64 streams" in q:
        found["64_streams_tok_s_at_least_3x"] = q["64 streams"]["output_tok_s"] >= 3.0
        found["64_streams_at_least_6x_1_stream"] = (ours["64 streams"]["output_tok_s"]
                                                    >= 6 * ours["1 stream"]["output_tok_s"])
    if "2048-token prompt" in q:
        found["2048_prompt_ttft_at_most_1x"] = q["2048-token prompt"]["ttft_p50_s"] <= 1.0
    return found


# --- The README section ---------------------------------------------------------------------

def markdown(r: dict, raw: str) -> str:
    m, peer = r["machine"], r["peer"]
    ours, theirs, q = r["servers"]["tollway"]["loads"], r["servers"]["llama-server"]["loads"], r["ratios"]
    rows = []
    for load in r["loads"]:
        name = load["name"]
        if load["output_tokens"] == 1:
            rows.append(_row(f"{name}: TTFT ms (lower is better)", ours[name]["ttft_p50_s"] * 1e3,
                             theirs[name]["ttft_p50_s"] * 1e3, q[name]["ttft_p50_s"]))
            continue
        rows.append(_row(f"{name}: output tok/s", ours[name]["output_tok_s"], theirs[name]["output_tok_s"],
                         q[name]["output_tok_s"]))
        rows.append(_row(f"{name}: tok/s per stream (p50)", ours[name]["tok_s_per_user_p50"],
                         theirs[name]["tok_s_per_user_p50"], q[name]["tok_s_per_user_p50"]))
        rows.append(_row(f"{name}: TTFT ms (p50, lower is better)", ours[name]["ttft_p50_s"] * 1e3,
                         theirs[name]["ttft_p50_s"] * 1e3, q[name]["ttft_p50_s"]))
    idle = {s: r["servers"][s]["memory"]["idle"] for s in r["servers"]}
    rows.append(_row(f"resident memory MiB, idle {r['idle_seconds']:.0f} s after start (lower is better)",
                     idle["tollway"]["now_mib"], idle["llama-server"]["now_mib"], q["idle_memory"]))
    for part in ("anon", "file"):
        rows.append(f"| of which {'anonymous' if part == 'anon' else 'file-backed (mapped files)'} | "
                    f"{idle['tollway'][part + '_mib']:.1f} | {idle['llama-server'][part + '_mib']:.1f} | |")
    memory = {s: r["servers"][s]["memory"]["peak_mib"] for s in r["servers"]}
    rows.append(_row("peak resident memory MiB, VmHWM after every load (lower is better)", memory["tollway"],
                     memory["llama-server"], q["peak_memory"]))
    loads = "; ".join(f"{x['name']}: {x['requests']} measured requests ({x['prompt_tokens']}-token prompts, "
                      f"{x['output_tokens']} new)" + (f" in each of {x['rounds']} rounds, the median round shown"
                                                       if x.get("rounds", 1) > 1 else "") for x in r["loads"])
    alone = ", ".join(f"B{row['pl']} {row['speed_tg']:.0f}" for row in r["llama_batched_bench"])
    prefill = max(row["speed_pp"] for row in r["llama_batched_bench"])
    source = r["tollway_source"]
    dirty = f" with uncommitted changes to {len(source['uncommitted'])} files" if source["uncommitted"] else ""
    return (f"Measured {r['date']} with `{r['command']}` on {m['cpu']} ({m['cores']} cores; "
            f"{', '.join(m['isa_flags'])}), torch {m['torch']}; tollway at {source['commit'][:10]}{dirty}"
            + (f" on its {m['forced_isa']} kernels" if m.get("forced_isa") else "") + "; "
            f"llama.cpp {peer['llama_cpp_commit']} (from llama-cpp-python {peer['llama_cpp_python']}), built with "
            f"{peer.get('build', NATIVE)} in {peer['build_seconds'] / 60:.0f} min"
            + (f" ({peer['why']}: its options `{' '.join(peer['build_options'])}`)" if peer.get("why")
               else f" (`{' '.join(peer['build_options'])}`)" if peer.get("build_options") else "")
            + f". Load average {m['load_average_at_start']:.1f} at "
            f"start, {m['load_average_at_end']:.1f} at end. Raw: `{raw}`.\n\n"
            f"Both on `{r['gguf']}` ({gguf_summary_line(r['model'])}), one after the other, each under the "
            f"same `tollway bench` loads (greedy, `ignore_eos`; the first wave of each load is warm-up): {loads}. "
            f"Both with a KV of {r['context_tokens']} tokens in all and {r['slots']} sequences at a time: "
            f"`{r['tollway_command']}` (its `[scheduler]` num_blocks = "
            f"{r['context_tokens'] // TOLLWAY_BLOCK} of {TOLLWAY_BLOCK} tokens; otherwise its defaults); "
            f"`{peer['llama_server_command']}` (its KV split in {r['slots']} slots of "
            f"{r['context_tokens'] // r['slots']} tokens)" + (
                f", and for the loads whose requests outgrow a slot ({', '.join(peer['unified_loads'])}) "
                f"`{peer['llama_server_unified_command']}`, one KV the slots share, started after the first "
                "(unified for those only: at 64 streams it makes the peer's flash attention compute every "
                "row against every sequence's cells); its idle memory is the first one's, its peak the higher "
                "of the two" if peer.get("unified_loads") else "")
            + f".{busy_note(r)}\n\n"
            "| figure | tollway | llama-server | tollway / llama-server |\n|---|---|---|---|\n"
            + "\n".join(rows) + f"\n\n{token_counts_line(r)} {failures_line(r)}{batch_economics_line(r)}\n\n"
            f"The peer's engine alone (`llama-batched-bench`, no HTTP, {r['llama_batched_bench'][0]['pp']}-token "
            f"prompts, {r['llama_batched_bench'][0]['tg']} new): decode {alone} tok/s; prefill up to {prefill:.0f} "
            f"tok/s.\n\n{targets_line(targets(r))}")


def busy_note(r: dict) -> str:
    """A warning where other work shared the cores: llama.cpp's threads wait for each other at
    every op's barrier, so a thread pool that fills the machine collapses when it is oversubscribed."""
    during = {s: f["load_average"] for s, f in r["servers"].items()}
    # One runnable thread more than the cores: the bench client's, beside a server on every core.
    if max(max(a.values()) for a in during.values()) <= r["machine"]["cores"] + 1:
        return ""
    said = "; ".join(f"{s} {a['start']:.1f} to {a['end']:.1f}" for s, a in during.items())
    return (f" **The machine was busy** (load average while each ran: {said}, on {r['machine']['cores']} cores): "
            "these ratios hold for this run only. llama.cpp's threads wait for one another at every op, so "
            "oversubscribed cores cost it the most.")


def token_counts_line(r: dict) -> str:
    """Whether every measured request had the tokens asked for, on both servers; what differed if not."""
    odd = []
    for load in r["loads"]:
        for server, figures in r["servers"].items():
            got = figures["loads"][load["name"]]
            if got["output_tokens"] != [load["output_tokens"]] or got["prompt_tokens"] != [load["prompt_tokens"]]:
                odd.append(f"{server} at {load['name']} counted prompts of {got['prompt_tokens']} and outputs of "
                           f"{got['output_tokens']} tokens")
    return ("Token counts (the servers' usage): " + ("; ".join(odd) if odd else "every measured request had "
            "exactly the prompt and output tokens asked for, on both servers") + ".")


def failures_line(r: dict) -> str:
    """Requests that failed in any round, by server and load: the figures count only the others."""
    failed = []
    for load in r["loads"]:
        for server, figures in r["servers"].items():
            kinds = Counter()
            for one in figures["loads"][load["name"]]["rounds"]:
                kinds.update(one["errors"])
            if kinds:
                failed.append(f"{server} at {load['name']}: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    return ("Failed requests, counted in no figure: " + "; ".join(failed) + "." if failed
            else "No request failed on either server.")


def batch_economics_line(r: dict) -> str:
    """tollway's 64-stream output over its 1-stream output: of the median rounds (the target's
    figure), and of each round's pair, run minutes apart."""
    ours = r["servers"]["tollway"]["loads"]
    if "64 streams" not in ours or "1 stream" not in ours:
        return ""
    pairs = zip(ours["64 streams"].get("rounds", []), ours["1 stream"].get("rounds", []))
    each = ", ".join(f"{many['output_tok_s'] / one['output_tok_s']:.2f}" for many, one in pairs)
    median = ours["64 streams"]["output_tok_s"] / ours["1 stream"]["output_tok_s"]
    return (f" tollway's output at 64 streams over 1 stream: **{median:.2f}x** (median rounds)"
            + (f"; round by round {each}." if each else "."))


def _row(figure: str, ours: float, theirs: float, ratio: float) -> str:
    return f"| {figure} | {ours:.1f} | {theirs:.1f} | **{ratio:.2f}** |"


if __name__ == "__main__":
    run_benchmark("vs_llamacpp", __doc__, run, markdown, FULL, QUICK, options={
        "threads": dict(type=int, default=os.cpu_count(),
                        help="threads for each server and llama-batched-bench (default: all cores)"),
        "large": dict(action="store_true", help="for a model of several GB: each load once, 32 new tokens a "
                                                "request (the full loads take hours on a small machine)"),
        "model": dict(default=None, metavar="PATH",
                      help="a GGUF file to compare on (default: the embedded Gemma 3 270M); the record is "
                           "results/vs_llamacpp-<its stem>.json and its own README section")},
        per_cpu_kind=True, name_suffix=lambda settings: f"-{Path(settings['model']).stem}" if settings["model"] else "")
