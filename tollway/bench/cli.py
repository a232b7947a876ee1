"""The command lines of the bench: `tollway bench`, `tollway compare` and `tollway report FILE...`."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tollway.traffic.arguments import (
    add_load_arguments, add_result_arguments, add_workload_arguments, print_stages, workload_from_args,
)

def add_server_arguments(parser: argparse.ArgumentParser, single_url: bool = True) -> None:
    server = parser.add_argument_group("server")
    if single_url:
        server.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    server.add_argument("--model", help="the model name the server expects (default: the one its /v1/models lists)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    server.add_argument("--endpoint", default="completions", choices=("completions", "chat"))
    server.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def add_bench_arguments(parser: argparse.ArgumentParser, single_url: bool = True) -> None:
    add_server_arguments(parser, single_url)
    add_load_arguments(parser)
    add_workload_arguments(parser)
    add_result_arguments(parser, "the machine's price (default: the server's usage.cost)")


def add_parsers(sub) -> None:
    bench = sub.add_parser("bench", help="measure an OpenAI-compatible server per lane: latency, throughput, cost")
    add_bench_arguments(bench)
    compare = sub.add_parser("compare", help="one workload twice (all fast vs all standard, or two servers), side by side")
    compare.add_argument("--url", action="append", required=True, help="one server, or give it twice for two")
    compare.add_argument("--tiers", default="fast,standard", help="with one --url: the two tiers to compare")
    add_bench_arguments(compare, single_url=False)


def bench_config(args, url: str):
    from tollway.bench.run import BenchConfig
    from tollway.traffic.patterns import Limits, pattern_from_args
    from tollway.traffic.stats import SLO

    if args.usd_per_hour is not None and args.usd_per_hour < 0:
        raise ValueError("--usd-per-hour must be >= 0")
    workload = workload_from_args(args)
    patterns = [] if args.sweep is not None else [pattern_from_args(args.concurrency, args.rate, args.burstiness)]
    if args.sweep is not None and (args.concurrency is not None or args.rate is not None):
        raise ValueError("give one of --concurrency, --rate or --sweep")
    config = BenchConfig(url, args.model, workload, Limits(args.max_requests, args.max_duration, args.warmup),
                         patterns, args.sweep, args.sweep_max_concurrency, SLO.parse(args.slo), args.usd_per_hour,
                         args.api_key, args.endpoint, args.label, args.timeout)
    config.check()
    return config


def served_model(url: str, api_key: str | None) -> str:
    """The model the server at `url` lists first on /v1/models (--model's default)."""
    import httpx

    from tollway.bench.client import server_root

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{server_root(url)}/v1/models", headers=headers, timeout=30.0)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"no --model given, and {url}/v1/models did not name one ({e}): pass --model") from None


def load_tokenizer(args):
    """The tokenizer prompts are measured with; None where only a dataset is sent and none is given."""
    from tollway.checkpoint import ModelNotFoundError, tokenizer_path
    from tollway.text.tokenizer import Tokenizer

    name = args.tokenizer or args.model
    candidate = Path(name).expanduser()
    if (candidate / "tokenizer.json").is_file():
        return Tokenizer.load(candidate)
    try:
        folder = tokenizer_path(name)
    except ModelNotFoundError:
        if args.dataset and not args.tokenizer:
            return None
        raise ValueError(f"no tokenizer for {name!r}: pass --tokenizer (a folder with tokenizer.json, a .gguf, "
                         "or gemma3-270m)") from None
    if folder is None:
        raise ValueError(f"{name!r} has no tokenizer; pass --tokenizer")
    return Tokenizer.load(folder)


def bench_main(args) -> int:
    from tollway.bench.run import run_bench
    from tollway.traffic.report import write_report
    from tollway.traffic.results import write_result

    args.model = args.model or served_model(args.url, args.api_key)
    result = run_bench(bench_config(args, args.url), load_tokenizer(args), show=not args.quiet)
    output = Path(args.output)
    json_path = write_result(result, output)
    html_path = write_report([result], output)
    print_stages(result)
    print(f"tollway bench: wrote {json_path} and {html_path}", file=sys.stderr)
    return 0


def compare_main(args) -> int:
    from tollway.bench.compare import side_figures, sides, table
    from tollway.bench.run import run_bench
    from tollway.traffic.console import stdout_console
    from tollway.traffic.report import write_report
    from tollway.traffic.results import write_result

    args.model = args.model or served_model(args.url[0], args.api_key)
    tokenizer = load_tokenizer(args)
    base = bench_config(args, args.url[0])
    if len(base.patterns) != 1:
        raise ValueError("compare runs one load pattern: give --concurrency or --rate")
    runs = sides(base, args.url, [t.strip() for t in args.tiers.split(",") if t.strip()])
    results = []
    for i, side in enumerate(runs):
        results.append(run_bench(side.config, tokenizer, show=not args.quiet))
        write_result(results[-1], Path(args.output) / f"side-{'ab'[i]}")
    html_path = write_report(results, Path(args.output))
    stdout_console().print(table([s.label for s in runs], [side_figures(r) for r in results]))
    print(f"tollway compare: wrote {args.output}/side-a, side-b and {html_path}", file=sys.stderr)
    return 0


def report_main(args) -> int:
    from tollway.traffic.report import load_result, resummarize, write_report
    from tollway.traffic.stats import SLO

    slo = SLO.parse(args.slo) if args.slo is not None else None
    results = [resummarize(load_result(Path(f)), slo, args.usd_per_hour) for f in args.files]
    path = write_report(results, Path(args.output))
    for result in results:
        print_stages(result)
    print(f"tollway report: wrote {path}", file=sys.stderr)
    return 0
