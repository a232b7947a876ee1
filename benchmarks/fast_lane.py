"""Fast lane benchmark: does the fast lane keep its promise at every moment, cold bursts included,
and what does it cost the other lanes?

    python benchmarks/fast_lane.py          # the full suite: about 60 min on a quiet 2-core machine
    python benchmarks/fast_lane.py --quick  # the cold burst and long prompts, fresh only; writes benchmarks/out/

Each load shape runs over HTTP against `tollway serve` on the embedded Gemma 3 270M, a server of
its own per run: fresh (started for the run, its fast lane cold: only two standard requests have
run) and warm (after 30 s of mixed traffic, fast included, just before). The shapes:
- cold burst: 160 streamed requests, 64 at a time, all sent at once, every 10th fast; prompts of
  130 tokens, 96 new tokens each (`ignore_eos`), the load issue 55 was filed with;
- Poisson arrivals at 50%, 100% and 150% of capacity (capacity: the cold burst's requests per
  second under fcfs, measured first), 10% fast;
- long prompts: standard requests with 2,048-token prompts, 16 at a time, beside fast ones;
- 256 concurrent standard streams, beside fast ones;
- a Batch API job of 1,000 lines (130-token prompts, 32 new tokens), submitted just before
  live traffic at 50% of capacity; its tokens count in the total;
- one fast request after 10 idle minutes (real ones: the server has no clock to skip them),
  on a warm server, under lanes only (one request: no throughput to compare).
Each runs under three policies: `lanes` (fast steps beside a paused step), `lanes` with
`pause_for_fast = false` (a fast arrival waits for the step in flight; the warm cap keeps steps
short for a minute after fast traffic) and `fcfs` (one queue: the throughput a load gets with no
lanes at all). Against the idle fast lane measured on a fresh server: the TTFT of a lone fast
request, and its tokens per second.

The goals (issue 55), per shape and state, under `lanes`: fast TTFT p99 at most 2x the idle fast
TTFT; fast tok/s per user (p50) at least 0.9x the idle fast stream's; total output tok/s at least
0.95x fcfs's on the same load; standard's TTFT p99 and tok/s per user no worse than with pausing
off. Tokens are counted from each stream's `usage` (a fast chunk can carry several accepted drafts).
"""
from __future__ import annotations

import asyncio
import datetime
import json
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

import httpx  # noqa: E402
import openai  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench_example import free_port  # noqa: E402
from common import command_line, machine_info, run_benchmark, text_prompts  # noqa: E402
from vs_llamacpp import serving  # noqa: E402
from tollway.traffic.stats import percentile  # noqa: E402

MODEL = "gemma3-270m"
POLICIES = {"lanes": "", "lanes, no pausing": "pause_for_fast = false\n", "fcfs": 'policy = "fcfs"\n'}


@dataclass
class Shape:
    name: str
    requests: int
    concurrency: int | None  # a closed loop of this many; None: open-loop arrivals at `rate`
    prompt_tokens: int  # standard's
    output_tokens: int
    fast_every: int = 10  # every n-th request is fast
    fast_prompt_tokens: int = 130
    rate: float | None = None  # share of capacity (open loop)
    batch_lines: int = 0  # a Batch API job of this many lines, submitted just before, runs beside
    idle_before: float = 0.0  # seconds the server sits idle after its past (warm-up), before the load
    policies: tuple[str, ...] | None = None  # None: every policy of the run
    states: tuple[str, ...] | None = None  # None: every state of the run


FULL = dict(shapes=[Shape("cold burst", 160, 64, 130, 96),
                    Shape("Poisson 50%", 120, None, 130, 96, rate=0.5),
                    Shape("Poisson 100%", 160, None, 130, 96, rate=1.0),
                    Shape("Poisson 150%", 160, None, 130, 96, rate=1.5),
                    Shape("long prompts", 40, 16, 2048, 32, fast_every=4),
                    Shape("256 streams", 512, 256, 130, 32),
                    Shape("Batch job", 120, None, 130, 96, rate=0.5, batch_lines=1000),
                    Shape("after 10 idle minutes", 1, 1, 130, 96, fast_every=1, idle_before=600.0,
                          policies=("lanes",), states=("warm",))],
            states=("fresh", "warm"), policies=tuple(POLICIES), idle_runs=5, warm_seconds=30.0)
QUICK = dict(shapes=[Shape("cold burst", 160, 64, 130, 96), Shape("long prompts", 24, 8, 2048, 16, fast_every=4),
                     Shape("Batch job", 40, 16, 130, 32, batch_lines=200),
                     Shape("after 30 idle seconds", 1, 1, 130, 96, fast_every=1, idle_before=30.0,
                           policies=("lanes",), states=("warm",))],
             states=("fresh",), policies=("lanes", "lanes, no pausing", "fcfs"), idle_runs=3, warm_seconds=20.0)
BATCH_LINE_TOKENS = 32  # new tokens per Batch API line


@dataclass
class Record:
    tier: str  # on the wire: "priority" (fast) or "default" (standard)
    sent: float
    ttft: float | None  # seconds to the first chunk with a choice
    end: float
    tokens: int  # from the stream's usage
    error: str | None = None

    def per_user(self) -> float | None:
        """Tokens per second after the first, as a user sees them stream."""
        decoding = self.end - self.sent - (self.ttft or 0.0)
        return (self.tokens - 1) / decoding if self.ttft is not None and self.tokens > 1 and decoding > 0 else None


@dataclass(frozen=True)
class Target:
    """A server under load: where it is, its model's name, and how a request names its lane.
    tollway: OpenAI's `service_tier`; vs_vllm.py's vLLM: a `priority` number."""

    url: str
    model: str = MODEL
    tokens_metric: str = "tollway:generation_tokens_total"

    def lane(self, tier: str) -> dict:
        """The body fields that put a request in `tier` ("priority", "default" or "flex")."""
        return {"service_tier": tier}

    def generated(self) -> int:
        """Tokens the server has generated so far, all lanes (its /metrics)."""
        exposition = httpx.get(self.url + "/metrics", timeout=30).text
        pattern = rf"^{re.escape(self.tokens_metric)}(?:{{[^}}]*}})? (\S+)$"
        return int(sum(float(v) for v in re.findall(pattern, exposition, re.M)))


async def _request(client: openai.AsyncOpenAI, target: Target, prompt: list[int], tier: str, tokens: int) -> Record:
    sent = time.monotonic()
    first, used = None, 0
    try:
        stream = await client.completions.create(
            model=target.model, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, **target.lane(tier)})
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.monotonic() - sent
            if chunk.usage:
                used = chunk.usage.completion_tokens
    except openai.APIError as e:
        return Record(tier, sent, first, time.monotonic(), used, f"{type(e).__name__}: {e}")
    return Record(tier, sent, first, time.monotonic(), used)


async def drive(target: Target, shape: Shape, rate_rps: float | None, seed: int, bar=None) -> tuple[list[Record], float]:
    """The shape's requests (closed loop, or open-loop Poisson arrivals at rate_rps); the
    records and the wall time from the first send to the last token."""
    rng = random.Random(seed)
    fast_count = -(-shape.requests // shape.fast_every)
    fast_prompts = iter(text_prompts(fast_count, shape.fast_prompt_tokens, seed))
    # Seeds apart from every shape's (100 + its index): one server taking several shapes
    # (vs_vllm.py) never finds a prompt in its prefix cache.
    standard_prompts = iter(text_prompts(shape.requests - fast_count, shape.prompt_tokens, seed + 1000))
    gate = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
    records: list[Record] = []
    async with openai.AsyncOpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0, timeout=1800) as client:
        async def one(i: int, delay: float) -> None:
            fast = i % shape.fast_every == 0
            prompt = next(fast_prompts) if fast else next(standard_prompts)
            tier = "priority" if fast else "default"
            await asyncio.sleep(delay)
            if gate is not None:
                async with gate:
                    records.append(await _request(client, target, prompt, tier, shape.output_tokens))
            else:
                records.append(await _request(client, target, prompt, tier, shape.output_tokens))
            if bar is not None:
                bar.update()

        delays, at = [], 0.0
        for _ in range(shape.requests):
            delays.append(at)
            at += rng.expovariate(rate_rps) if rate_rps else 0.0
        start = time.monotonic()
        await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))
    return records, time.monotonic() - start


def figures(records: list[Record], wall: float, batch_tokens: int = 0) -> dict:
    """The load's figures; `batch_tokens`: generated meanwhile for a Batch API job, counted in
    the total."""
    ok = [r for r in records if r.error is None and r.ttft is not None]
    fast, standard = [r for r in ok if r.tier == "priority"], [r for r in ok if r.tier == "default"]

    def per_user(rs):
        return [v for v in (r.per_user() for r in rs) if v is not None]

    return {
        "requests": len(records), "errors": sorted({r.error for r in records if r.error}),
        "fast_ttft_p50_s": percentile([r.ttft for r in fast], 0.5), "fast_ttft_p99_s": percentile([r.ttft for r in fast], 0.99),
        "fast_ttft_max_s": max((r.ttft for r in fast), default=None),
        "fast_per_user_p50": percentile(per_user(fast), 0.5),
        "standard_ttft_p99_s": percentile([r.ttft for r in standard], 0.99),
        "standard_per_user_p50": percentile(per_user(standard), 0.5),
        "total_tok_s": (sum(r.tokens for r in records) + batch_tokens) / wall, "wall_s": wall,
        "batch_tok_s": batch_tokens / wall,
    }


def tollway_command(port: int, data: Path, policy: str) -> list[str]:
    config = data / "fast_lane.toml"
    config.write_text("[scheduler]\n" + POLICIES[policy])
    return [sys.executable, "-m", "tollway", "serve", "--port", str(port), "--config", str(config),
            "--data-dir", str(data), "--keys-db", str(data / "keys.sqlite"), "--log-level", "warning"]


async def warm_up(target: Target, seconds: float) -> None:
    """Mixed traffic, fast included, for `seconds`: the warm state's past."""
    deadline = time.monotonic() + seconds
    prompts = text_prompts(64, 130, 99)
    async with openai.AsyncOpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        async def loop(k: int) -> None:
            i = k
            while time.monotonic() < deadline:
                await _request(client, target, prompts[i % len(prompts)], "priority" if i % 4 == 0 else "default", 32)
                i += 8
        await asyncio.gather(*(loop(k) for k in range(8)))


async def first_steps(target: Target) -> None:
    """Two standard requests: a fresh server's first steps, its fast lane left cold."""
    async with openai.AsyncOpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        for prompt in text_prompts(2, 130, 98):
            await _request(client, target, prompt, "default", 8)


def batch_lines(lines: int, seed: int) -> list[list[int]]:
    """A Batch job's prompts (seeds apart from the load's, as in drive)."""
    return text_prompts(lines, 130, seed + 2000)


def submit_batch(target: Target, lines: int, seed: int):
    """A Batch API job of `lines` completions, submitted: it runs in the server's batch lane.
    Returns what cancels it."""
    rows = [json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"model": target.model, "prompt": prompt, "max_tokens": BATCH_LINE_TOKENS,
                                 "temperature": 0, "ignore_eos": True}})
            for i, prompt in enumerate(batch_lines(lines, seed))]
    client = openai.OpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    upload = client.files.create(file=("batch.jsonl", "\n".join(rows).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")

    def cancel() -> None:
        with client:
            client.batches.cancel(batch.id)
    return cancel


def run_shape(target: Target, shape: Shape, rate_rps: float | None, seed: int, label: str,
              batch=submit_batch) -> dict:
    """On a server that has had its past: the idle minutes the shape asks for, its Batch job
    (`batch(target, lines, seed)`, generating beside the load, returns what stops it), then its
    load; the figures."""
    if shape.idle_before:
        for _ in tqdm(range(int(shape.idle_before)), desc=f"{label}: idle", unit="s", leave=False):
            time.sleep(1)
    stop = batch(target, shape.batch_lines, seed) if shape.batch_lines else None
    before = target.generated()
    with tqdm(total=shape.requests, desc=label, unit="req", leave=False) as bar:
        records, wall = asyncio.run(drive(target, shape, rate_rps, seed, bar))
    batch_tokens = target.generated() - before - sum(r.tokens for r in records) if stop else 0
    if stop:
        stop()
    return figures(records, wall, batch_tokens)


def one_run(shape: Shape, state: str, policy: str, rate_rps: float | None, settings: dict, seed: int) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        target = Target(f"http://127.0.0.1:{port}")
        with serving(f"tollway ({policy})", tollway_command(port, Path(tmp), policy), port, Path(tmp) / "server.log"):
            asyncio.run(first_steps(target))
            if state == "warm":
                asyncio.run(warm_up(target, settings["warm_seconds"]))
            measured = run_shape(target, shape, rate_rps, seed, f"{shape.name}, {state}, {policy}")
    return {"shape": shape.name, "state": state, "policy": policy, "rate_rps": rate_rps, **measured}


def lone_fast(target: Target, runs: int) -> dict:
    """A lone fast request, `runs` times with pauses between: its median TTFT and tok/s."""
    async def lone() -> list[Record]:
        out = []
        async with openai.AsyncOpenAI(base_url=target.url + "/v1", api_key="unused", max_retries=0) as client:
            for prompt in text_prompts(runs, 130, 97):
                out.append(await _request(client, target, prompt, "priority", 96))
                await asyncio.sleep(0.5)
        return out

    records = asyncio.run(lone())
    return {"ttft_s": statistics.median(r.ttft for r in records), "per_user": statistics.median(r.per_user() for r in records),
            "ttfts_s": [r.ttft for r in records]}


def idle_fast(settings: dict) -> dict:
    """A lone fast request on a fresh lanes server, several times."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        target = Target(f"http://127.0.0.1:{port}")
        with serving("tollway (idle)", tollway_command(port, Path(tmp), "lanes"), port, Path(tmp) / "server.log"):
            asyncio.run(first_steps(target))
            return lone_fast(target, settings["idle_runs"])


def run(settings: dict, quick: bool) -> dict:
    result = {"command": command_line("fast_lane.py", " --quick" if quick else ""),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "settings": {**settings, "shapes": [asdict(s) for s in settings["shapes"]]},
              "idle": idle_fast(settings), "runs": []}
    capacity = None
    for k, shape in enumerate(settings["shapes"]):
        for state in shape.states or settings["states"]:
            # fcfs first: the cold burst under it sets the capacity the Poisson shapes are sized by
            for policy in sorted(shape.policies or settings["policies"], key=lambda p: p != "fcfs"):
                rate = shape.rate * capacity if shape.rate is not None else None
                result["runs"].append(one_run(shape, state, policy, rate, settings, seed=100 + k))
                if shape.name == "cold burst" and policy == "fcfs" and capacity is None:
                    capacity = shape.requests / result["runs"][-1]["wall_s"]
    result["capacity_rps"] = capacity
    result["goals"] = goals(result)
    return result


def goals(r: dict) -> dict:
    """Issue 55's goals per shape and state, under lanes."""
    idle, out = r["idle"], {}
    runs = {(x["shape"], x["state"], x["policy"]): x for x in r["runs"]}
    for (shape, state, policy), x in runs.items():
        if policy != "lanes":
            continue
        fcfs, before = runs.get((shape, state, "fcfs")), runs.get((shape, state, "lanes, no pausing"))
        key = f"{shape}, {state}"
        checks = {
            "fast_ttft_p99_at_most_2x_idle": x["fast_ttft_p99_s"] is not None and x["fast_ttft_p99_s"] <= 2 * idle["ttft_s"],
            "fast_per_user_at_least_0.9x_idle": x["fast_per_user_p50"] is not None and x["fast_per_user_p50"] >= 0.9 * idle["per_user"],
        }
        # A shape run under lanes alone (one request after idle minutes) has nothing to compare.
        if fcfs is not None:
            checks["total_at_least_0.95x_fcfs"] = x["total_tok_s"] >= 0.95 * fcfs["total_tok_s"]
        if before is not None:
            checks["standard_ttft_p99_no_worse"] = x["standard_ttft_p99_s"] <= 1.1 * before["standard_ttft_p99_s"]
            checks["standard_per_user_no_worse"] = x["standard_per_user_p50"] >= 0.9 * before["standard_per_user_p50"]
        out[key] = checks
    return out


def ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.0f}"


def markdown(r: dict, raw: str) -> str:
    m, idle = r["machine"], r["idle"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {m.get('cpu', 'this CPU')} ({m.get('cores')} cores; "
        f"{', '.join(m.get('isa_flags', []))}). Raw: `{raw}`. Idle fast lane (a lone fast request on a fresh server, "
        f"median of {len(idle['ttfts_s'])}): TTFT {ms(idle['ttft_s'])} ms, {idle['per_user']:.1f} tok/s."
        + (f" Capacity (the cold burst under fcfs): {r['capacity_rps']:.2f} requests/s." if r.get("capacity_rps") else ""),
        "",
        "| shape | state | policy | fast TTFT p50 / p99 ms (p99 / idle) | fast tok/s per user p50 (/ idle) | "
        "standard TTFT p99 ms | standard tok/s per user p50 | total tok/s (/ fcfs) | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    runs = {(x["shape"], x["state"], x["policy"]): x for x in r["runs"]}
    for x in r["runs"]:
        fcfs = runs.get((x["shape"], x["state"], "fcfs"))
        p99 = x["fast_ttft_p99_s"]
        ratio = f" ({p99 / idle['ttft_s']:.2f}x)" if p99 else ""
        vs_fcfs = f" ({x['total_tok_s'] / fcfs['total_tok_s']:.2f}x)" if fcfs else ""
        lines.append(
            f"| {x['shape']} | {x['state']} | {x['policy']} | {ms(x['fast_ttft_p50_s'])} / {ms(p99)}"
            f"{ratio} | "
            f"{x['fast_per_user_p50'] or 0:.1f} ({(x['fast_per_user_p50'] or 0) / idle['per_user']:.2f}x) | "
            f"{ms(x['standard_ttft_p99_s'])} | {x['standard_per_user_p50'] or 0:.1f} | "
            f"{x['total_tok_s']:.1f}{vs_fcfs} | {len(x['errors'])} |")
    lines += ["", goals_line("Goals under lanes", r["goals"])]
    return "\n".join(lines)


def goals_line(title: str, goals: dict[str, dict[str, bool]]) -> str:
    """Goals checked per case, as one sentence."""
    return f"{title}: " + "; ".join(
        f"{case}: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in checks.items())
        for case, checks in goals.items()) + "."


if __name__ == "__main__":
    run_benchmark("fast_lane", __doc__, run, markdown, FULL, QUICK)
