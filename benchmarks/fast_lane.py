"""Fast lane benchmark: does the fast lane keep its promise at every moment, cold bursts included,
and what does it cost the other lanes?

    python benchmarks/fast_lane.py          # the full suite: about 35 min on a quiet 2-core machine
    python benchmarks/fast_lane.py --quick  # the cold burst and long prompts, fresh only; writes benchmarks/out/

Each load shape runs over HTTP against `tollway serve` on the embedded Gemma 3 270M, a server of
its own per run: fresh (started for the run, its fast lane cold: only two standard requests have
run) and warm (after 30 s of mixed traffic, fast included, just before). The shapes:
- cold burst: 160 streamed requests, 64 at a time, all sent at once, every 10th fast; prompts of
  130 tokens, 96 new tokens each (`ignore_eos`), the load issue 55 was filed with;
- Poisson arrivals at 50%, 100% and 150% of capacity (capacity: the cold burst's requests per
  second under fcfs, measured first), 10% fast;
- long prompts: standard requests with 2,048-token prompts, 16 at a time, beside fast ones;
- 256 concurrent standard streams, beside fast ones.
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
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

import openai  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench_example import free_port  # noqa: E402
from common import command_line, machine_info, run_benchmark, text_prompts  # noqa: E402
from vs_llamacpp import serving  # noqa: E402
from tollway.bench.stats import percentile  # noqa: E402

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


FULL = dict(shapes=[Shape("cold burst", 160, 64, 130, 96),
                    Shape("Poisson 50%", 120, None, 130, 96, rate=0.5),
                    Shape("Poisson 100%", 160, None, 130, 96, rate=1.0),
                    Shape("Poisson 150%", 160, None, 130, 96, rate=1.5),
                    Shape("long prompts", 40, 16, 2048, 32, fast_every=4),
                    Shape("256 streams", 512, 256, 130, 32)],
            states=("fresh", "warm"), policies=tuple(POLICIES), idle_runs=5, warm_seconds=30.0)
QUICK = dict(shapes=[Shape("cold burst", 160, 64, 130, 96), Shape("long prompts", 24, 8, 2048, 16, fast_every=4)],
             states=("fresh",), policies=("lanes", "lanes, no pausing", "fcfs"), idle_runs=3, warm_seconds=20.0)


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


async def _request(client: openai.AsyncOpenAI, prompt: list[int], tier: str, tokens: int) -> Record:
    sent = time.monotonic()
    first, used = None, 0
    try:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "service_tier": tier})
        async for chunk in stream:
            if chunk.choices and first is None:
                first = time.monotonic() - sent
            if chunk.usage:
                used = chunk.usage.completion_tokens
    except openai.APIError as e:
        return Record(tier, sent, first, time.monotonic(), used, f"{type(e).__name__}: {e}")
    return Record(tier, sent, first, time.monotonic(), used)


async def _drive(url: str, shape: Shape, rate_rps: float | None, seed: int, bar=None) -> tuple[list[Record], float]:
    """The shape's requests (closed loop, or open-loop Poisson arrivals at rate_rps); the
    records and the wall time from the first send to the last token."""
    rng = random.Random(seed)
    fast_count = -(-shape.requests // shape.fast_every)
    fast_prompts = iter(text_prompts(fast_count, shape.fast_prompt_tokens, seed))
    standard_prompts = iter(text_prompts(shape.requests - fast_count, shape.prompt_tokens, seed + 1))
    gate = asyncio.Semaphore(shape.concurrency) if shape.concurrency else None
    records: list[Record] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800) as client:
        async def one(i: int, delay: float) -> None:
            fast = i % shape.fast_every == 0
            prompt = next(fast_prompts) if fast else next(standard_prompts)
            await asyncio.sleep(delay)
            if gate is not None:
                async with gate:
                    records.append(await _request(client, prompt, "priority" if fast else "default", shape.output_tokens))
            else:
                records.append(await _request(client, prompt, "priority" if fast else "default", shape.output_tokens))
            if bar is not None:
                bar.update()

        delays, at = [], 0.0
        for _ in range(shape.requests):
            delays.append(at)
            at += rng.expovariate(rate_rps) if rate_rps else 0.0
        start = time.monotonic()
        await asyncio.gather(*(one(i, d) for i, d in enumerate(delays)))
    return records, time.monotonic() - start


def figures(records: list[Record], wall: float) -> dict:
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
        "total_tok_s": sum(r.tokens for r in records) / wall, "wall_s": wall,
    }


def _command(port: int, data: Path, policy: str) -> list[str]:
    config = data / "fast_lane.toml"
    config.write_text("[scheduler]\n" + POLICIES[policy])
    return [sys.executable, "-m", "tollway", "serve", "--port", str(port), "--config", str(config),
            "--data-dir", str(data), "--keys-db", str(data / "keys.sqlite"), "--log-level", "warning"]


async def _warm_up(url: str, seconds: float) -> None:
    """Mixed traffic, fast included, for `seconds`: the warm state's past."""
    deadline = time.monotonic() + seconds
    prompts = text_prompts(64, 130, 99)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        async def loop(k: int) -> None:
            i = k
            while time.monotonic() < deadline:
                await _request(client, prompts[i % len(prompts)], "priority" if i % 4 == 0 else "default", 32)
                i += 8
        await asyncio.gather(*(loop(k) for k in range(8)))


async def _first_steps(url: str) -> None:
    """Two standard requests: a fresh server's first steps, its fast lane left cold."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600) as client:
        for prompt in text_prompts(2, 130, 98):
            await _request(client, prompt, "default", 8)


def one_run(shape: Shape, state: str, policy: str, rate_rps: float | None, settings: dict, seed: int) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"http://127.0.0.1:{port}"
        with serving(f"tollway ({policy})", _command(port, Path(tmp), policy), port, Path(tmp) / "server.log"):
            asyncio.run(_first_steps(url))
            if state == "warm":
                asyncio.run(_warm_up(url, settings["warm_seconds"]))
            with tqdm(total=shape.requests, desc=f"{shape.name}, {state}, {policy}", unit="req", leave=False) as bar:
                records, wall = asyncio.run(_drive(url, shape, rate_rps, seed, bar))
    return {"shape": shape.name, "state": state, "policy": policy, "rate_rps": rate_rps, **figures(records, wall)}


def idle_fast(settings: dict) -> dict:
    """A lone fast request on a fresh lanes server, several times: its TTFT and tok/s."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        url = f"http://127.0.0.1:{port}"
        with serving("tollway (idle)", _command(port, Path(tmp), "lanes"), port, Path(tmp) / "server.log"):
            asyncio.run(_first_steps(url))

            async def lone() -> list[Record]:
                out = []
                async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
                    for prompt in text_prompts(settings["idle_runs"], 130, 97):
                        out.append(await _request(client, prompt, "priority", 96))
                        await asyncio.sleep(0.5)
                return out

            records = asyncio.run(lone())
    return {"ttft_s": statistics.median(r.ttft for r in records), "per_user": statistics.median(r.per_user() for r in records),
            "ttfts_s": [r.ttft for r in records]}


def run(settings: dict, quick: bool) -> dict:
    result = {"command": command_line("fast_lane.py", " --quick" if quick else ""),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "settings": {**settings, "shapes": [asdict(s) for s in settings["shapes"]]},
              "idle": idle_fast(settings), "runs": []}
    capacity = None
    for k, shape in enumerate(settings["shapes"]):
        for state in settings["states"]:
            # fcfs first: the cold burst under it sets the capacity the Poisson shapes are sized by
            for policy in sorted(settings["policies"], key=lambda p: p != "fcfs"):
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
        out[key] = {
            "fast_ttft_p99_at_most_2x_idle": x["fast_ttft_p99_s"] is not None and x["fast_ttft_p99_s"] <= 2 * idle["ttft_s"],
            "fast_per_user_at_least_0.9x_idle": x["fast_per_user_p50"] is not None and x["fast_per_user_p50"] >= 0.9 * idle["per_user"],
            "total_at_least_0.95x_fcfs": fcfs is not None and x["total_tok_s"] >= 0.95 * fcfs["total_tok_s"],
            "standard_ttft_p99_no_worse": before is not None and x["standard_ttft_p99_s"] <= 1.1 * before["standard_ttft_p99_s"],
            "standard_per_user_no_worse": before is not None and x["standard_per_user_p50"] >= 0.9 * before["standard_per_user_p50"],
        }
    return out


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.0f}"


def markdown(r: dict, raw: str) -> str:
    m, idle = r["machine"], r["idle"]
    lines = [
        f"Measured {r['date'][:10]} with `{r['command']}` on {m.get('cpu', 'this CPU')} ({m.get('cores')} cores; "
        f"{', '.join(m.get('isa_flags', []))}). Raw: `{raw}`. Idle fast lane (a lone fast request on a fresh server, "
        f"median of {len(idle['ttfts_s'])}): TTFT {_ms(idle['ttft_s'])} ms, {idle['per_user']:.1f} tok/s."
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
        lines.append(
            f"| {x['shape']} | {x['state']} | {x['policy']} | {_ms(x['fast_ttft_p50_s'])} / {_ms(p99)}"
            f"{ratio} | "
            f"{x['fast_per_user_p50'] or 0:.1f} ({(x['fast_per_user_p50'] or 0) / idle['per_user']:.2f}x) | "
            f"{_ms(x['standard_ttft_p99_s'])} | {x['standard_per_user_p50'] or 0:.1f} | "
            f"{x['total_tok_s']:.1f} ({x['total_tok_s'] / fcfs['total_tok_s']:.2f}x) | {len(x['errors'])} |")
    lines += ["", "Goals under lanes: " + "; ".join(
        f"{key}: " + ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in checks.items())
        for key, checks in r["goals"].items()) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    run_benchmark("fast_lane", __doc__, run, markdown, FULL, QUICK)
