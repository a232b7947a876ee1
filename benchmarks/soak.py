"""Soak: thousands of requests against a real `tollway serve`, a third of whose clients hang up
at a random moment (queued, mid-prefill, mid-stream, or waiting on a plain response). At the
end the server must be idle: nothing running or waiting, KV use back at its idle value, /health
ok, every call that reached the engine in the ledger exactly once, and the ledger's engine
seconds equal to what the meter charged. Writes results/soak.json and the README's soak section.

    python benchmarks/soak.py                      # 2,000 requests
    python benchmarks/soak.py --requests 300       # a shorter run
    python benchmarks/soak.py --serve-flag=--kernel --serve-flag=int8

It fails (exit 1) if any of those checks fails, after writing what it saw.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from tqdm import tqdm

from bench_example import free_port, wait_ready
from common import machine_info, write_record

BENCHMARKS = Path(__file__).resolve().parent


def scrape(url: str) -> dict:
    """Requests running and waiting, KV use, and the meter's charged engine seconds."""
    out = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "charged_seconds": 0.0}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        for prefix, key in (("tollway:num_requests_running{", "running"), ("tollway:num_requests_waiting{", "waiting"),
                            ("tollway:engine_seconds_total{", "charged_seconds")):
            if name.startswith(prefix):
                out[key] += float(value)
        if name.startswith("tollway:kv_cache_usage_perc{"):
            out["kv_usage"] = float(value)
    return out


def idle(url: str, timeout: float) -> tuple[dict, float]:
    """The metrics once nothing runs or waits (or at the timeout), and the seconds it took."""
    started = time.monotonic()
    while True:
        now = scrape(url)
        if (now["running"], now["waiting"]) == (0, 0) or time.monotonic() - started > timeout:
            return now, time.monotonic() - started
        time.sleep(0.25)


async def call(client: httpx.AsyncClient, url: str, i: int, args, rng: random.Random) -> str:
    """One client; returns how it ended: completed, or hung up (and when)."""
    stream = rng.random() < 0.5
    body = {"prompt": [rng.randrange(1000, 100_000) for _ in range(args.prompt_tokens)], "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, "metadata": {"soak": str(i)}}
    hang_up = rng.random() < args.hang_up
    after_chunks = rng.randint(0, args.max_tokens // 2) if stream and hang_up and rng.random() < 0.5 else None

    async def run() -> str:
        if not stream:
            resp = await client.post(url + "/v1/completions", json=body)
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == args.max_tokens, resp.text
            return "completed"
        chunks = 0
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            if after_chunks == 0:
                return "hung up after the headers"
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == after_chunks:
                        return "hung up after some chunks"
        return "completed"

    if not hang_up or after_chunks is not None:
        return await run()
    task = asyncio.ensure_future(run())
    done, _ = await asyncio.wait([task], timeout=rng.uniform(0.0, args.hang_up_within))
    if done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return f"hung up at a random moment ({'stream' if stream else 'plain'})"


async def storm(url: str, args) -> Counter:
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    ended: Counter = Counter()
    with tqdm(total=args.requests, desc="soak", unit="req") as bar:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
            async def one(i: int, own: random.Random) -> None:
                async with gate:
                    ended[await call(client, url, i, args, own)] += 1
                bar.update()

            await asyncio.gather(*(one(i, random.Random(rng.random())) for i in range(args.requests)))
    return ended


def ledger_counts(path: Path, requests: int) -> dict:
    db = sqlite3.connect(path)
    rows = db.execute("SELECT t.tag, r.engine_seconds, r.finish_reason FROM requests r "
                      "JOIN request_tags t ON t.request_id = r.id WHERE t.tag LIKE 'soak=%'").fetchall()
    per_call = Counter(tag for tag, _, _ in rows)
    return {"rows": len(rows), "calls_with_a_row": len(per_call), "calls_with_two_rows_or_more": sum(n > 1 for n in per_call.values()),
            "calls_without_a_row": requests - len(per_call), "billed_seconds": sum(s for _, s, _ in rows),
            "finish_reasons": dict(Counter(f for _, _, f in rows))}


def run(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    info = machine_info()
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen([sys.executable, "-m", "tollway", "serve", "--port", str(port), "--data-dir", data,
                                   "--keys-db", os.path.join(data, "keys.sqlite"), *args.serve_flag])
        try:
            wait_ready(url, server)
            before, _ = idle(url, 60)
            started = time.monotonic()
            ended = asyncio.run(storm(url, args))
            elapsed = time.monotonic() - started
            after, settled_in = idle(url, 120)
            time.sleep(2)  # the last withdrawn calls' rows are written as the engine ends each abort
            after = scrape(url)
            health = httpx.get(url + "/health", timeout=30)
            ledger = ledger_counts(Path(data) / "ledger.sqlite", args.requests)
        finally:
            server.terminate()
            server.wait(60)
    checks = {
        "nothing running or waiting": (after["running"], after["waiting"]) == (0, 0),
        "KV back at its idle value": after["kv_usage"] == before["kv_usage"],
        "/health ok": health.status_code == 200,
        "no call with two ledger rows": ledger["calls_with_two_rows_or_more"] == 0,
        "every completed call has a row": ledger["calls_with_a_row"] >= ended["completed"],
        "ledger seconds = charged seconds": abs(ledger["billed_seconds"] - after["charged_seconds"])
        <= 1e-6 * max(1.0, after["charged_seconds"]),
    }
    return {"machine": info, "settings": {k: v for k, v in vars(args).items()}, "elapsed_seconds": elapsed,
            "requests_per_second": args.requests / elapsed, "ended": dict(ended), "before": before, "after": after,
            "idle_after_seconds": settled_in, "health": health.json(), "ledger": ledger, "checks": checks,
            "load_average_at_end": os.getloadavg()[0]}


def markdown(result: dict, raw: str) -> str:
    s, m, ledger = result["settings"], result["machine"], result["ledger"]
    ended = ", ".join(f"{n} {how}" for how, n in sorted(result["ended"].items(), key=lambda x: -x[1]))
    flags = " ".join(s["serve_flag"]) or "no flags (defaults)"
    lines = [
        f"Measured {time.strftime('%Y-%m-%d')} with `python benchmarks/soak.py --requests {s['requests']}` against "
        f"`tollway serve` ({flags}) on {m['cpu']} ({m['cores']} cores, shared with other work: load average "
        f"{m['load_average_at_start']:.1f} at start, {result['load_average_at_end']:.1f} at end). "
        f"{s['requests']} requests of {s['prompt_tokens']} prompt tokens and {s['max_tokens']} new tokens, "
        f"{s['concurrency']} clients at a time, half streaming; {s['hang_up']:.0%} of clients hang up, at a random "
        f"moment within {s['hang_up_within']:.0f} s or after a random number of chunks. Raw: `{raw}`.",
        "",
        f"Ran {result['elapsed_seconds']:.0f} s ({result['requests_per_second']:.2f} requests/s): {ended}.",
        "",
        "| after the soak | value |",
        "|---|---|",
        f"| requests running / waiting | {result['after']['running']:.0f} / {result['after']['waiting']:.0f} "
        f"(idle {result['idle_after_seconds']:.1f} s after the last client) |",
        f"| KV use, before / after | {result['before']['kv_usage']:.4f} / {result['after']['kv_usage']:.4f} |",
        f"| /health | {result['health'].get('status', result['health'])} |",
        f"| ledger rows / calls with a row / calls with two or more | {ledger['rows']} / {ledger['calls_with_a_row']} / "
        f"{ledger['calls_with_two_rows_or_more']} |",
        f"| ledger engine seconds / meter's charged seconds | {ledger['billed_seconds']:.3f} / "
        f"{result['after']['charged_seconds']:.3f} |",
        "",
        "Calls without a row are those whose client left before the server had read them, or while the add was "
        "queued and before the engine took it (nothing ran). Checks: " +
        "; ".join(f"{name} {'passed' if ok else 'FAILED'}" for name, ok in result["checks"].items()) + ".",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=48, help="clients at a time")
    parser.add_argument("--hang-up", type=float, default=1 / 3, help="share of clients that hang up early")
    parser.add_argument("--hang-up-within", type=float, default=3.0, help="seconds: the latest a client hangs up")
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--serve-flag", action="append", default=[], help="passed to `tollway serve`; repeat")
    parser.add_argument("--quick", action="store_true", help="writes benchmarks/out/ only (any settings)")
    args = parser.parse_args()
    result = run(args)
    print(write_record("soak", result, args.quick, markdown))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
