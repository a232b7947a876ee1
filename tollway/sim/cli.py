"""The command lines of the simulator: `tollway simulate`, `tollway plan` and `tollway advise`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tollway.sim.hardware import HARDWARE
from tollway.traffic import arguments


def add_parsers(sub) -> None:
    simulate = sub.add_parser("simulate", help="run a workload on simulated replicas with the real scheduler; "
                                               "writes the same JSON and HTML as tollway bench")
    _add_machine_arguments(simulate)
    simulate.add_argument("--replicas", type=int, default=1)
    simulate.add_argument("--routing", default="least_outstanding", help="round_robin, least_outstanding, tier_aware")
    simulate.add_argument("--trace", help="JSONL of {arrival, tier, prompt_tokens, output_tokens}, instead of a load pattern")
    arguments.add_load_arguments(simulate, sweep=False)
    arguments.add_workload_arguments(simulate, prompts_from_text=False)
    arguments.add_result_arguments(simulate, "the fleet's price (default: the profile's, per replica)")
    plan = sub.add_parser("plan", help="the cheapest fleet (replicas, batch cap, fast reserve) that meets every "
                                       "tier's SLOs at a target rate, by simulation")
    _add_machine_arguments(plan)
    plan.add_argument("--qps", type=float, required=True, help="the target request rate")
    plan.add_argument("--slo", required=True, help="per-tier limits, e.g. ttft=2s,tpot=100ms,fast:tpot=30ms")
    plan.add_argument("--attainment", type=float, default=0.99, help="share of each tier's requests within its SLOs")
    plan.add_argument("--requests", type=int, default=2000, help="simulated requests per candidate")
    plan.add_argument("--max-replicas", type=int, default=64)
    plan.add_argument("--batch-caps", default="64,128,256", help="max_num_seqs values to try")
    plan.add_argument("--reserves", default="0.05,0.125,0.25", help="fast reserved_seq_share values to try")
    plan.add_argument("--usd-per-hour", type=float, help="one replica's price (default: the profile's)")
    plan.add_argument("--quiet", action="store_true")
    arguments.add_workload_arguments(plan, prompts_from_text=False)
    advise = sub.add_parser("advise", help="the cheapest lane (fast, standard, batch) for each class of traffic "
                                           "that meets its SLOs, by simulating the mix")
    _add_machine_arguments(advise)
    source = advise.add_argument_group("classes (one of)")
    source.add_argument("--classes", help="a TOML file of [classes.<name>] (rate, prompt_tokens, output_tokens, slo)")
    source.add_argument("--ledger", help="derive the classes from this ledger's SQLite file (read-only)")
    advise.add_argument("--group-by", default="key", help="ledger: one class per key or per tag")
    advise.add_argument("--start", help="ledger: from (unix seconds or ISO 8601)")
    advise.add_argument("--end", help="ledger: until")
    advise.add_argument("--slo", help="ledger: each class's limits, e.g. ttft=2s,tpot=100ms,chat:tpot=30ms")
    advise.add_argument("--percentile", type=float, default=99, help="ledger: the SLOs' percentile (default 99)")
    advise.add_argument("--replicas", type=int, default=1)
    advise.add_argument("--routing", default="tier_aware", help="round_robin, least_outstanding, tier_aware")
    advise.add_argument("--requests", type=int, default=1000, help="simulated requests per assignment")
    advise.add_argument("--seed", type=int, default=0)
    advise.add_argument("--usd-per-hour", type=float, help="one replica's price (default: the profile's)")
    advise.add_argument("--output", default="advice", help="the folder for advice.json and advice.html")
    advise.add_argument("--format", default="table", choices=("table", "json"), help="what to print")
    advise.add_argument("--quiet", action="store_true")


def _add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    machine = parser.add_argument_group("machine (one of)")
    machine.add_argument("--profile", help="a profile JSON from `tollway profile`")
    machine.add_argument("--hardware", help="an analytic estimate: " + ", ".join(HARDWARE))
    machine.add_argument("--model", default="gemma3-270m", help="with --hardware: the model whose shapes to use")
    machine.add_argument("--config", help="a TOML file of [scheduler] and [tiers.<name>] settings")
    machine.add_argument("--policy", help="lanes, priority or fcfs")


def _machine(args):
    from tollway.scheduler.machine_profile import MachineProfile

    if (args.profile is None) == (args.hardware is None):
        raise ValueError("give one of --profile or --hardware")
    if args.profile:
        return MachineProfile.load(args.profile)
    from tollway.sim.hardware import estimated_profile

    return estimated_profile(args.hardware, args.model)


def _scheduler_config(args):
    from tollway.config import POLICIES, EngineConfig, load_config

    config = (load_config(args.config) if args.config else EngineConfig()).scheduler
    if args.policy is not None:
        if args.policy not in POLICIES:
            raise ValueError(f"--policy: expected one of {', '.join(POLICIES)}, got {args.policy!r}")
        config.policy = args.policy
    return config


def simulate_main(args) -> int:
    from tollway.sim.simulator import read_trace, simulate
    from tollway.traffic.patterns import Limits, pattern_from_args
    from tollway.traffic.report import write_report
    from tollway.traffic.results import write_result
    from tollway.traffic.stats import SLO

    machine = _machine(args)
    workload = arguments.workload_from_args(args)
    trace = read_trace(args.trace) if args.trace else None
    if trace is not None:
        if args.concurrency is not None or args.rate is not None:
            raise ValueError("give a --trace or a load pattern (--concurrency, --rate), not both")
        from tollway.traffic.patterns import LoadPattern

        patterns = [LoadPattern(f"trace {Path(args.trace).name}")]
        limits = Limits(args.max_requests or len(trace), args.max_duration, args.warmup)
    else:
        patterns = [pattern_from_args(args.concurrency, args.rate, args.burstiness)]
        limits = Limits(args.max_requests, args.max_duration, args.warmup)
    limits.check()
    result = simulate(_scheduler_config(args), machine, workload, patterns, limits, args.replicas, args.routing,
                      SLO.parse(args.slo), args.usd_per_hour, trace, progress=not args.quiet)
    if args.label:
        result["label"] = args.label
    output = Path(args.output)
    json_path, html_path = write_result(result, output), write_report([result], output)
    arguments.print_stages(result)
    sim = result["simulation"]
    print(f"tollway simulate: {sim['steps']} steps in {sim['wall_seconds']:.1f} s"
          + (" (an estimate from specs)" if sim["estimate"] else "") + f"; wrote {json_path} and {html_path}",
          file=sys.stderr)
    return 0


def _numbers(text: str, flag: str, kind):
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: give at least one value")
    return values


def plan_main(args) -> int:
    from rich.table import Table

    from tollway.sim.planner import plan
    from tollway.traffic.console import fmt_num, stdout_console
    from tollway.traffic.stats import SLO

    machine = _machine(args)
    if args.usd_per_hour is not None:
        machine.usd_per_hour = args.usd_per_hour
    if not 0 < args.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
    caps = tuple(_numbers(args.batch_caps, "--batch-caps", int))
    reserves = tuple(_numbers(args.reserves, "--reserves", float))
    ranked = plan(_scheduler_config(args), machine, arguments.workload_from_args(args), args.qps, SLO.parse(args.slo),
                  args.attainment, args.requests, args.max_replicas, caps, reserves, progress=not args.quiet)
    tiers = sorted({t for c in ranked for t in c.attainment})
    table = Table(title=f"tollway plan: {args.qps:g} req/s on {machine.hardware}"
                  + (" (estimate from specs)" if machine.estimate else ""), title_justify="left")
    for column in ("", "fleet", "$/hour", "meets SLOs", *(f"{t} within SLO" for t in tiers),
                   *(f"{t} $/1M out" for t in tiers)):
        table.add_column(column, justify="left" if column in ("", "fleet") else "right")
    for i, c in enumerate(ranked):
        table.add_row("chosen" if i == 0 and c.meets else ("runner-up" if c.meets else "fails"), c.describe(),
                      f"{c.usd_per_hour:.2f}", "yes" if c.meets else "no",
                      *(fmt_num(100 * c.attainment.get(t, 0), ".1f") + "%" for t in tiers),
                      *(fmt_num(c.cost_per_m_output.get(t), ".3f") for t in tiers))
    stdout_console().print(table)
    if not ranked[0].meets:
        print(f"tollway plan: no fleet of up to {args.max_replicas} replicas meets the SLOs", file=sys.stderr)
        return 1
    return 0


def _traffic_classes(args):
    from tollway.meter.ledger import parse_time
    from tollway.sim.ledger_classes import classes_from_ledger
    from tollway.sim.traffic_classes import check_percentile, load_classes
    from tollway.traffic.stats import SLO

    if (args.classes is None) == (args.ledger is None):
        raise ValueError("give one of --classes (a TOML file) or --ledger")
    if args.classes:
        if args.slo or args.start or args.end:
            raise ValueError("--slo, --start and --end are for --ledger; a TOML file's classes carry their own SLOs")
        return load_classes(args.classes)
    if not args.slo:
        raise ValueError("--ledger needs --slo: the ledger does not say what latency each class needs")
    return classes_from_ledger(args.ledger, args.group_by, SLO.parse(args.slo),
                               check_percentile(args.percentile, "--percentile"),
                               parse_time(args.start, "--start"), parse_time(args.end, "--end"))


def advise_main(args) -> int:
    import json

    from tollway.sim import advice_report
    from tollway.sim.advisor import Advisor
    from tollway.traffic.console import stdout_console

    classes = _traffic_classes(args)
    machine = _machine(args)
    if args.usd_per_hour is not None:
        machine.usd_per_hour = args.usd_per_hour
    advice = Advisor(_scheduler_config(args), machine, classes, args.replicas, args.routing, args.requests,
                     args.seed).advise(progress=not args.quiet)
    json_path, html_path = advice_report.write(advice, Path(args.output))
    if args.format == "json":
        print(json.dumps(advice.to_dict(), indent=1))
    else:
        stdout_console().print(advice_report.table(advice))
        print(advice_report.summary_line(advice))
    print(f"tollway advise: wrote {json_path} and {html_path}", file=sys.stderr)
    return 0 if all(c.lane for c in advice.classes) else 1
