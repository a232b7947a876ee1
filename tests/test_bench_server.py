"""tollway bench against a real tollway server: exact prompt and output lengths, seeded tier
mixes, timings that add up, the server's step sizes and costs read back, `tollway compare` and
`tollway report`; and the HTML report opened in headless Chromium."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from live_server import MODEL, make_meter, running_server
from tollway.bench.run import BenchConfig, run_bench
from tollway.cli import main
from tollway.server.metrics import Metrics
from tollway.traffic.patterns import Limits, LoadPattern
from tollway.traffic.report import load_result, render, write_report
from tollway.traffic.results import write_result
from tollway.traffic.stats import SLO, percentile, request_latencies
from tollway.traffic.workload import Lengths, Requests, Workload

ARTIFACTS = Path(os.environ.get("TOLLWAY_ARTIFACTS", Path(__file__).resolve().parent.parent / "test-artifacts"))
PROMPT, OUTPUT = 24, 6


@pytest.fixture(scope="module")
def server(make_engine, tmp_path_factory):
    meter = make_meter(tmp_path_factory.mktemp("bench") / "ledger.sqlite")
    yield from running_server(make_engine(), Metrics(MODEL), meter=meter)


def workload(mix, seed=3) -> Workload:
    return Workload(Lengths(PROMPT, 0, PROMPT, PROMPT), Lengths(OUTPUT, 0, OUTPUT, OUTPUT), True, mix, None, seed)


def bench(server, tokenizer, profile, requests=6, mix=None, sweep=None, **options) -> dict:
    config = BenchConfig(server["url"], MODEL, workload(mix or {"fast": 0.5, "standard": 0.5}),
                         Limits(max_requests=requests), [profile] if profile else [], sweep, **options)
    return run_bench(config, tokenizer, show=False)


def test_prompts_have_the_exact_token_count_the_server_reports(server, default_tokenizer):
    result = bench(server, default_tokenizer, LoadPattern("concurrency 3", concurrency=3), requests=6,
                   slo=SLO.parse("ttft=30s,tpot=5s"))
    (stage,) = result["stages"]
    records = stage["requests"]
    assert len(records) == 6 and all(r["error"] is None for r in records)
    # usage.prompt_tokens is the server's count (BOS included); every prompt was built to PROMPT.
    assert {r["prompt_tokens"] for r in records} == {PROMPT}
    assert {r["output_tokens"] for r in records} == {OUTPUT}  # ignore_eos: the length asked for
    for r in records:
        assert r["sent"] <= r["first_token"] <= r["end"] and r["cost"] > 0 and r["engine_seconds"] > 0
        assert r["chunk_times"] == sorted(r["chunk_times"]) and r["chunk_times"][0] == r["first_token"]
    # The same seed gives the same tiers; the summary's figures are those of the records.
    again = Requests(workload({"fast": 0.5, "standard": 0.5}), default_tokenizer)
    assert [r["tier"] for r in records] == [again.next().tier for _ in records]
    summary = stage["summary"]
    assert sum(t["completed"] for t in summary["tiers"].values()) == 6
    assert summary["all"]["output_tokens"] == 6 * OUTPUT and summary["all"]["prompt_tokens"] == 6 * PROMPT
    from tollway.traffic.records import RequestRecord
    ttfts = [request_latencies(RequestRecord(**r))["ttft"] for r in records]
    assert summary["all"]["ttft"]["p90"] == pytest.approx(percentile(ttfts, 0.9))
    assert summary["all"]["goodput_share"] == 1.0  # limits far above this machine's times
    assert summary["all"]["cost_source"] == "server"
    assert summary["all"]["cost"] == pytest.approx(sum(r["cost"] for r in records))
    assert result["steps_exposed"] and stage["steps"] and all(p["seqs_per_step"] >= 1 for p in stage["steps"])


def test_a_rate_stage_with_warmup_measures_only_after_it(server, default_tokenizer):
    config = BenchConfig(server["url"], MODEL, workload({"standard": 1.0}), Limits(max_requests=3, warmup=0.5),
                         [LoadPattern("rate 8/s", rate=8.0, burstiness=0.5)])
    (stage,) = run_bench(config, default_tokenizer, show=False)["stages"]
    measured = [r for r in stage["requests"] if not r["warmup"]]
    assert len(measured) == 3 and all(r["sent"] - stage["start"] >= 0.5 for r in measured)
    assert stage["summary"]["all"]["requests"] == 3


def test_unreachable_and_refusing_servers_are_counted_as_errors(server, default_tokenizer):
    config = BenchConfig("http://127.0.0.1:9", MODEL, workload({"standard": 1.0}), Limits(max_requests=2),
                         [LoadPattern("concurrency 1", concurrency=1)])
    (stage,) = run_bench(config, default_tokenizer, show=False)["stages"]
    assert stage["summary"]["all"]["errors"] == {"connection": 2}
    config = BenchConfig(server["url"], "no-such-model", workload({"standard": 1.0}), Limits(max_requests=2),
                         [LoadPattern("concurrency 2", concurrency=2)])
    (stage,) = run_bench(config, default_tokenizer, show=False)["stages"]
    assert stage["summary"]["all"]["errors"] == {"http_404": 2} and stage["summary"]["all"]["completed"] == 0


def test_sweep_report_renders_in_chromium(server, default_tokenizer, tmp_path):
    chromium = shutil.which("chromium")
    result = bench(server, default_tokenizer, None, requests=4, sweep=3, sweep_concurrency=4, usd_per_hour=2.0)
    names = [s["profile"]["name"] for s in result["stages"]]
    assert len(names) == 3 and names[0] == "synchronous" and names[-1] == "saturated (4)" and names[1].startswith("rate")
    path = write_report([load_result(write_result(result, tmp_path))], tmp_path)
    page = path.read_text()
    assert page.count("data-drawn='1'") == 4 and "<script" not in page
    if chromium is None:
        assert not os.environ.get("TOLLWAY_REQUIRE_BROWSER"), "chromium is missing, and CI requires the browser check"
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors, fetched = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        view = browser.new_page(viewport={"width": 1300, "height": 900})
        view.on("console", lambda m: m.type == "error" and errors.append(m.text))
        view.on("pageerror", lambda e: errors.append(str(e)))
        view.on("request", lambda r: r.url != path.as_uri() and fetched.append(r.url))
        view.goto(path.as_uri())
        sizes = view.eval_on_selector_all(
            "figure.plot svg", "svgs => svgs.map(s => [s.getBoundingClientRect().width, s.getBoundingClientRect().height])")
        view.screenshot(path=str(ARTIFACTS / "bench-report.png"), full_page=True)
        browser.close()
    assert errors == [] and fetched == []
    assert len(sizes) == 4 and all(w > 200 and h > 100 for w, h in sizes)


def test_cli_bench_compare_and_report(server, default_tokenizer, tmp_path, capsys):
    common = ["--model", MODEL, "--tokenizer", "gemma3-270m", "--prompt-tokens", str(PROMPT), "--output-tokens",
              str(OUTPUT), "--max-requests", "3", "--quiet"]
    out = tmp_path / "one"
    assert main(["bench", "--url", server["url"], "--concurrency", "3", "--mix", "fast=1,standard=2",
                 "--output", str(out), *common]) == 0
    first = json.loads((out / "bench.json").read_text())
    assert first["stages"][0]["summary"]["all"]["completed"] == 3 and (out / "report.html").is_file()
    assert "standard" in capsys.readouterr().out
    # compare: all fast against all standard, on one server.
    both = tmp_path / "compare"
    assert main(["compare", "--url", server["url"], "--concurrency", "2", "--output", str(both), *common]) == 0
    table = capsys.readouterr().out
    assert "all fast" in table and "all standard" in table and "premium" in table
    for side, tier in (("side-a", "fast"), ("side-b", "standard")):
        assert {r["tier"] for r in json.loads((both / side / "bench.json").read_text())["stages"][0]["requests"]} == {tier}
    # report: merge two runs, recomputed under a new SLO.
    merged = tmp_path / "merged"
    assert main(["report", str(out / "bench.json"), str(both / "side-a" / "bench.json"), "--slo", "ttft=1ms",
                 "--output", str(merged)]) == 0
    assert "data-drawn='1'" in (merged / "report.html").read_text()


@pytest.mark.parametrize("argv, message", [
    (["bench", "--url", "http://x", "--model", "m", "--max-requests", "1"], "one of --concurrency"),
    (["bench", "--url", "http://x", "--model", "m", "--concurrency", "1"], "--max-requests or --max-duration"),
    (["bench", "--url", "http://x", "--model", "m", "--concurrency", "1", "--max-requests", "1", "--mix", "gold=1"],
     "unknown tier"),
    (["bench", "--url", "http://x", "--model", "nope", "--concurrency", "1", "--max-requests", "1"], "no tokenizer"),
    (["report", "missing.json"], "cannot read"),
])
def test_bad_bench_arguments_get_one_line_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tollway: error:") and message in err and "\n" not in err


def test_report_refuses_files_that_are_not_bench_results(tmp_path):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a tollway bench result"):
        load_result(other)
    assert render([]).startswith("<!doctype html>")
