"""The command-line arguments `tollway bench` and `tollway simulate` share: the load, the
workload and where results go; and the per-stage tables both print at the end."""
from __future__ import annotations

import argparse

DEFAULT_OUTPUT = "tollway-bench"


def add_load_arguments(parser: argparse.ArgumentParser, sweep: bool = True) -> None:
    load = parser.add_argument_group("load (one of --concurrency, --rate" + (", --sweep)" if sweep else ")"))
    load.add_argument("--concurrency", type=int, help="requests kept in flight")
    load.add_argument("--rate", type=float, help="new requests per second (open loop)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the gaps between requests: 1 is Poisson, below 1 burstier")
    if sweep:
        load.add_argument("--sweep", type=int, metavar="STAGES",
                          help="synchronous, saturated, and STAGES-2 rates evenly between them")
        load.add_argument("--sweep-max-concurrency", type=int, default=64, help="the saturated end of a sweep")
    load.add_argument("--max-requests", type=int, help="measured requests per stage")
    load.add_argument("--max-duration", type=float, metavar="SECONDS", help="per stage, warm-up included")
    load.add_argument("--warmup", type=float, default=0.0, metavar="SECONDS",
                      help="requests sent this early in a stage are not measured")


def add_workload_arguments(parser: argparse.ArgumentParser, prompts_from_text: bool = True) -> None:
    work = parser.add_argument_group("workload")
    work.add_argument("--mix", default="standard=1", help="tier shares sent as service_tier, e.g. fast=0.1,standard=0.9")
    work.add_argument("--prompt-tokens", default="256", help="exact, or mean=N,stdev=S,min=A,max=B")
    work.add_argument("--output-tokens", default="128", help="exact, or mean=N,stdev=S,min=A,max=B")
    work.add_argument("--seed", type=int, default=0)
    if prompts_from_text:
        work.add_argument("--natural-output", action="store_true",
                          help="let outputs end at EOS (default: ignore_eos, so lengths are as drawn)")
        work.add_argument("--dataset", help="JSONL of {\"prompt\": ..., \"output_tokens\": N}")
        work.add_argument("--tokenizer", help="a folder with tokenizer.json, a .gguf, or 'gemma3-270m' "
                                              "(default: --model, where tollway can load it)")


def add_result_arguments(parser: argparse.ArgumentParser, price_help: str) -> None:
    out = parser.add_argument_group("results")
    out.add_argument("--slo", help="goodput limits, e.g. ttft=500ms,tpot=50ms,fast:tpot=20ms")
    out.add_argument("--usd-per-hour", type=float, help=price_help)
    out.add_argument("--output", default=DEFAULT_OUTPUT, help=f"folder for the JSON and HTML (default {DEFAULT_OUTPUT})")
    out.add_argument("--label", help="this run's name in reports")
    out.add_argument("--quiet", action="store_true", help="no progress display")


def workload_from_args(args):
    from tollway.traffic.workload import Lengths, Workload, parse_mix

    return Workload(Lengths.parse(args.prompt_tokens, "--prompt-tokens"),
                    Lengths.parse(args.output_tokens, "--output-tokens"), not getattr(args, "natural_output", False),
                    parse_mix(args.mix), getattr(args, "dataset", None), args.seed)


def print_stages(result: dict) -> None:
    from tollway.traffic.console import stdout_console, tier_table

    console = stdout_console()
    for stage in result["stages"]:
        console.print(tier_table(stage["summary"], f"{result['label']}: {stage['profile']['name']}"))
