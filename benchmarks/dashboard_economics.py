"""The dashboard's batch-economics curve on the real engine, under mixed lanes: does a generated
token get cheaper as more sequences decode together? `tollway serve` on the embedded default
model under closed-loop loads of 1, 4, 16, 32 and 64 streams, one after the other, about 15% of
the streams fast and 10% batch; then the live /dashboard/data (each step's time split by the
step model: the decodes' part per generated token, median per decode batch size bin; prefill's
part per prompt token apart) and a screenshot of the chart in headless Chromium.

    python benchmarks/dashboard_economics.py          # about 4 min on a 2-core machine
    python benchmarks/dashboard_economics.py --quick  # 1 and 4 streams; writes benchmarks/out/ only

Writes results/dashboard_economics.json, results/dashboard_economics.png and a section of
benchmarks/README.md. The screenshot needs Debian's chromium (`.ci/run` installs it).
"""
from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`

from bench_example import free_port, wait_ready  # noqa: E402
from common import machine_info, run_benchmark, targets_line  # noqa: E402

# A load per judged bin: without 32 streams, the 17-32 bin held only the 64-stream load's ramp and
# drain, 20 steps of it one run and 19 the one before, and its median (0.99 against 0.82 and 0.76
# beside it) judged those transitions rather than steps of that size.
FULL = dict(streams=(1, 4, 16, 32, 64), requests_per_stream=3, prompt_words=60, max_tokens=64)
QUICK = dict(streams=(1, 4), requests_per_stream=2, prompt_words=60, max_tokens=32)
MIN_STEPS = 20  # a bin with fewer steps is too thin to judge


def lane_of(stream: int) -> str:
    """The service tier a stream asks for: about 15% fast (priority), 10% batch (flex)."""
    return "priority" if stream % 7 == 3 else "flex" if stream % 10 == 5 else "default"


def closed_loop(url: str, streams: int, requests: int, words: int, max_tokens: int, bar: tqdm) -> None:
    """`streams` clients, each sending `requests` completions one after another in its lane."""
    errors: list[str] = []

    def client(i: int) -> None:
        with httpx.Client(timeout=600) as http:
            for r in range(requests):
                prompt = " ".join(f"word{(i * 7919 + r * 104729 + w) % 5000}" for w in range(words))
                reply = http.post(url + "/v1/completions", json={
                    "model": "gemma3-270m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "service_tier": lane_of(i)})
                if reply.status_code != 200:
                    errors.append(f"{reply.status_code} {reply.text[:200]}")
                bar.update()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, first: {errors[0]}")


def screenshot(url: str, path: Path) -> bool:
    chromium = shutil.which("chromium")
    if chromium is None:
        print("no chromium: skipping the screenshot", file=sys.stderr)
        return False
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(url + "/dashboard")
        page.wait_for_selector("#economics-chart circle", state="attached", timeout=20_000)
        page.locator("[data-panel=economics]").screenshot(path=str(path))
        browser.close()
    return True


def run(settings: dict, quick: bool) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out = ROOT / "benchmarks" / ("out" if quick else "results")
    out.mkdir(parents=True, exist_ok=True)
    picture = out / "dashboard_economics.png"
    with tempfile.TemporaryDirectory() as data:
        server = subprocess.Popen([sys.executable, "-m", "tollway", "serve", "--port", str(port), "--data-dir", data,
                                   "--keys-db", os.path.join(data, "keys.sqlite")])
        try:
            wait_ready(url, server)
            total = sum(settings["streams"]) * settings["requests_per_stream"]
            with tqdm(total=total, desc="requests", unit="req") as bar:
                for streams in settings["streams"]:
                    bar.set_description(f"{streams} streams")
                    closed_loop(url, streams, settings["requests_per_stream"], settings["prompt_words"],
                                settings["max_tokens"], bar)
            economics = httpx.get(url + "/dashboard/data", timeout=30).json()["economics"]
            shot = screenshot(url, picture)
        finally:
            server.terminate()
            server.wait(30)
    bins = [b for b in economics["bins"] if b["steps"] >= MIN_STEPS]
    medians = [b["median"] for b in bins]
    return {
        "command": "python benchmarks/dashboard_economics.py" + (" --quick" if quick else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "settings": settings, "economics": economics,
        "screenshot": str(picture.relative_to(ROOT / "benchmarks")) if shot else None,
        "judged_bins": bins,
        "targets": {"decode_cost_per_token_falls_as_decode_batches_grow": len(bins) >= 2 and all(
            later < earlier for earlier, later in zip(medians, medians[1:]))},
    }


def markdown(r: dict, raw: str) -> str:
    m = r["machine"]
    rows = "\n".join(
        f"| {b['seqs_min']}–{b['seqs_max']} | {b['steps']} | {b['seqs_mean']:.1f} | {b['median']:.1f} |"
        for b in r["economics"]["bins"])
    first, last = r["judged_bins"][0], r["judged_bins"][-1]
    prefill = r["economics"]["prefill"]
    shot = f"\n\n![the dashboard's batch economics chart]({r['screenshot']})" if r["screenshot"] else ""
    priced = r["economics"]["unit"] == "$"
    cost, unit = ("engine time at the meter's price", "$") if priced else ("engine seconds", "engine s")
    return f"""Measured {r['date'][:10]} with `{r['command']}` on {m['cpu']} ({m['cores']} cores; {', '.join(m['isa_flags'])}). Raw: `{raw}`.

`tollway serve` on the default model, closed loops of {', '.join(map(str, r['settings']['streams']))} streams one after another ({r['settings']['requests_per_stream']} requests each, {r['settings']['max_tokens']} new tokens), about 15% of the streams fast and 10% batch. The live dashboard splits each step's {cost} by the step model: the decodes' part over the tokens they generated (accepted drafts included), per million, median per bin of sequences decoding together (bins with at least {MIN_STEPS} steps are judged); prefill's part over its prompt tokens, apart:

| sequences decoding in the step | steps | mean sequences | median {unit} per 1M generated tokens |
|---|---|---|---|
{rows}

A generated token in a {last['seqs_min']}–{last['seqs_max']}-sequence decode costs {last['median'] / first['median']:.2f}x one decoded alone. A prompt token costs {prefill['median']:.1f} {unit} per 1M (median over {prefill['steps']} steps); prefill took {prefill['share']:.0%} of the engine's time, and {r['economics']['unsplit']} steps could not be split.{shot}

{targets_line(r['targets'])}"""


if __name__ == "__main__":
    run_benchmark("dashboard_economics", __doc__, run, markdown, FULL, QUICK)
