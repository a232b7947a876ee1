"""Command line: tollway serve (the OpenAI-compatible server), tollway keys, tollway generate "prompt",
tollway usage and tollway report (the ledger), the bench (tollway bench, compare, report FILE...) and
the simulator (tollway profile, simulate, plan)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from platformdirs import user_data_dir

from tollway import __version__, profile_command
from tollway.bench import cli as bench_cli
from tollway.bench_extra import COMMANDS, check_bench_extra
from tollway.config import TIERS, EngineConfig, KeySpec, ServerConfig, load_server_config
from tollway.engine_arguments import add_engine_arguments, engine_config
from tollway.meter.ledger import GROUPS
from tollway.request import SamplingParams
from tollway.server.log_level import LOG_LEVELS, uvicorn_logging
from tollway.sim import cli as sim_cli
from tollway.traffic.arguments import DEFAULT_OUTPUT


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollway", description="LLM inference with fast, standard and batch lanes")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default here)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string; repeat for more")
    gen.add_argument("--tier", default="standard", choices=TIERS)
    add_engine_arguments(gen)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("model_path", nargs="?", metavar="MODEL",
                       help="a .gguf file or a Hugging Face folder (default: the embedded gemma3-270m); as --model")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="default 8000")
    serve.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    serve.add_argument("--api-key", action="append", default=[],
                       help="a key allowed every tier; repeat for more. Also read from $TOLLWAY_API_KEY, "
                            "which keeps it out of the process list")
    serve.add_argument("--admin-key", action="append", default=[],
                       help="a key that may also open /dashboard (admin = true in [[keys]] does the same)")
    serve.add_argument("--keys-db", help=f"the SQLite key store (default {default_keys_db()})")
    serve.add_argument("--data-dir", help=f"Batch API files and jobs (default {user_data_dir('tollway')})")
    serve.add_argument("--database-url", help=DATABASE_URL_HELP)
    serve.add_argument("--replicas", type=int,
                       help="run N engines as a Ray Serve deployment behind the tier-aware router (needs tollway[ray])")
    serve.add_argument("--ray-address", help="with --replicas: join this Ray cluster (default: start a local one)")
    serve.add_argument("--sse-keep-alive", type=float, metavar="SECONDS",
                       help="send a stream that has been silent this long a keep-alive comment (default 15)")
    serve.add_argument("--otlp-traces-endpoint", metavar="URL",
                       help="send a span per API call, its stages as children, to this OTLP/HTTP collector "
                            "(e.g. http://localhost:4318/v1/traces; needs tollway[otel]); default "
                            "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    serve.add_argument("--canary-share", type=float, metavar="SHARE",
                       help="promote this share (0-1) of requests sent with service_tier auto or none, from keys "
                            "entitled to fast, to the fast lane, to compare with the rest: tollway report --canary")
    serve.add_argument("--canary-seed", type=int, help="the seed of the canary's hash of request ids (default 0)")
    serve.add_argument("--canary-key", action="append", default=[], metavar="NAME",
                       help="only this key's requests are in the canary; repeat for more")
    serve.add_argument("--canary-tag", action="append", default=[], metavar="TAG",
                       help="only requests with this tag are in the canary; repeat for more")
    serve.add_argument("--canary-bill-promoted", action="store_true",
                       help="bill promoted requests at the fast price (default: standard's, the difference "
                            "recorded as the canary's cost)")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                       help="uvicorn's log level; at info and below, every request is logged (the access log). "
                            "With --replicas: the ingress's, each replica's and Ray Serve's")
    add_engine_arguments(serve)
    keys = sub.add_parser("keys", help="manage API keys in the key store")
    keys.add_argument("action", choices=("add", "list", "revoke"))
    keys.add_argument("--name", help="who the key is for (add, revoke)")
    keys.add_argument("--tiers", default=",".join(TIERS), help="comma-separated tiers the key may use")
    keys.add_argument("--rpm", type=int, help="requests per minute")
    keys.add_argument("--tpm", type=int, help="tokens per minute")
    keys.add_argument("--keys-db", help=f"default {default_keys_db()}")
    keys.add_argument("--database-url", help="the servers' PostgreSQL database, instead of --keys-db")
    usage = sub.add_parser("usage", help="usage from the ledger, grouped, as a table or CSV")
    usage.add_argument("--group-by", default="tier", choices=GROUPS)
    usage.add_argument("--start", help="unix seconds or ISO 8601 (UTC unless it says); inclusive")
    usage.add_argument("--end", help="exclusive")
    usage.add_argument("--format", default="table", choices=("table", "csv"))
    add_ledger_arguments(usage)
    report = sub.add_parser("report", help="economics per tier from the ledger (cost, price, margin, fast premium); "
                                           "or, given bench JSON files, rebuild or merge their HTML report")
    report.add_argument("files", nargs="*", metavar="FILE", help="bench JSON files (tollway bench --output)")
    report.add_argument("--start", help="ledger: from (unix seconds or ISO 8601)")
    report.add_argument("--end", help="ledger: until")
    add_ledger_arguments(report)
    report.add_argument("--canary", action="store_true",
                        help="ledger: the canary's promoted requests against its control (tollway serve "
                             "--canary-share): latency and money, with bootstrap 95%% intervals")
    report.add_argument("--output", default=DEFAULT_OUTPUT, help="bench files: the report's folder")
    report.add_argument("--slo", help="bench files: recompute goodput under these limits")
    report.add_argument("--usd-per-hour", type=float, help="bench files: recompute cost at this price")
    bench_cli.add_parsers(sub)
    profile_command.add_parser(sub)
    sim_cli.add_parsers(sub)
    return parser


DATABASE_URL_HELP = ("postgresql://user@host/db: API keys, the ledger, budgets and Batch API jobs in one PostgreSQL "
                     "database that several servers share (needs tollway[postgres]); default: SQLite files")


def add_ledger_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ledger", help="the ledger's SQLite file (default: the one `tollway serve` writes)")
    parser.add_argument("--database-url", help="the servers' PostgreSQL database, instead of a SQLite ledger")
    parser.add_argument("--config", help="the server's TOML file, for its [meter] ledger and [server] data_dir "
                                         "or database_url")
    parser.add_argument("--data-dir", help=f"default {user_data_dir('tollway')}")


def default_ledger(server: ServerConfig) -> Path:
    return Path(server.meter.ledger or Path(server.data_dir or user_data_dir("tollway")) / "ledger.sqlite")


def _open_ledger(args):
    from tollway.meter.ledger import Ledger

    server = load_server_config(args.config) if args.config else ServerConfig()
    if args.data_dir:
        server.data_dir = args.data_dir
    if args.database_url or (server.database_url and not args.ledger):
        return Ledger(_database(args.database_url or server.database_url))
    path = Path(args.ledger) if args.ledger else default_ledger(server)
    if not path.is_file():
        raise ValueError(f"no ledger at {path}")
    return Ledger(path)


def _usage(args) -> int:
    from tollway.meter.ledger import parse_time
    from tollway.meter.report import format_csv, format_table

    rows = _open_ledger(args).usage(args.group_by, parse_time(args.start, "--start"), parse_time(args.end, "--end"))
    print(format_csv(rows) if args.format == "csv" else format_table(rows), end="" if args.format == "csv" else "\n")
    return 0


def _report(args) -> int:
    if args.files:
        if args.ledger or args.start or args.end or args.canary:
            raise ValueError("report: give bench JSON files or ledger options (--ledger, --start, --end, --canary), "
                             "not both")
        return bench_cli.report_main(args)
    from tollway.meter.ledger import parse_time
    from tollway.meter.report import economics, format_report

    window = parse_time(args.start, "--start"), parse_time(args.end, "--end")
    if args.canary:
        from tollway.meter.canary_report import compare, format_canary

        print(format_canary(compare(_open_ledger(args).canary_rows(*window))))
        return 0
    print(format_report(economics(_open_ledger(args), *window)))
    return 0


def default_keys_db() -> Path:
    return Path(user_data_dir("tollway")) / "keys.sqlite"


def _generate(args) -> int:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    params.validate()
    config = engine_config(args)
    config.profile_steps = False  # one request: nothing to shape
    from tollway.engine import Engine  # after the flags are checked: torch takes seconds to import

    engine = Engine(config)
    prompt = args.prompt
    if args.chat:  # the template writes BOS itself
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                         add_special_tokens=False)
    request_id = engine.add_request(prompt, params, tier=args.tier)
    while engine.has_unfinished():
        for out in engine.step().outputs:
            if out.request_id == request_id:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args) -> int:
    server = load_server_config(args.config) if args.config else ServerConfig()
    for value, name in ((args.host, "host"), (args.port, "port"), (args.served_model_name, "served_model_name"),
                        (args.keys_db, "keys_db"), (args.data_dir, "data_dir"), (args.database_url, "database_url"),
                        (args.sse_keep_alive, "sse_keep_alive"), (args.otlp_traces_endpoint, "otlp_traces_endpoint")):
        if value is not None:
            setattr(server, name, value)
    for value, name in ((args.canary_share, "share"), (args.canary_seed, "seed"),
                        (args.canary_key or None, "keys"), (args.canary_tag or None, "tags"),
                        (args.canary_bill_promoted or None, "bill_promoted")):
        if value is not None:
            setattr(server.canary, name, value)
    server.canary.validate()
    server.keys += [KeySpec(key) for key in args.api_key + api_keys_from_environment()]
    server.keys += [KeySpec(key, "admin", admin=True) for key in args.admin_key]
    config = engine_config(args)
    name = server.served_model_name or config.model
    if args.replicas is not None:
        from tollway.fleet.fleet import serve_fleet
        from tollway.fleet.replica import ReplicaSpec

        return serve_fleet(ReplicaSpec(name, config, server, server_parts, log_level=args.log_level), args.replicas,
                           args.ray_address, server.host, server.port)
    # Only now: torch and the server take seconds to import, and a bad flag is a one-line error at once.
    import ipaddress

    import uvicorn

    from tollway.async_engine import AsyncEngine
    from tollway.engine import Engine
    from tollway.server.app import create_app
    from tollway.server.metrics import Metrics
    from tollway.server.tracing import tracing_for

    gatekeeper, meter, batch_dir = server_parts(server, config)
    tracing = tracing_for(server.otlp_traces_endpoint, name)  # before the engine: a missing extra fails fast
    metrics = Metrics(name)
    engine = AsyncEngine(Engine(config), on_step=metrics.on_step)
    engine.fault_in_kv()
    try:
        if gatekeeper.open and not _is_loopback(server.host, ipaddress):
            print(f"tollway: warning: serving {server.host} with no API keys: anyone who can reach it can use it",
                  file=sys.stderr)
        print(f"tollway: serving {name} on http://{server.host}:{server.port}/v1 "
              f"(live dashboard: /dashboard{'' if gatekeeper.open else '?key=ADMIN_KEY'})", file=sys.stderr)
        print(f"tollway: ledger {meter.ledger.database}", file=sys.stderr)
        uvicorn.run(create_app(engine, name, metrics, gatekeeper, batch_dir, meter,
                               keep_alive=server.sse_keep_alive, canary=server.canary, tracing=tracing),
                    host=server.host,
                    port=server.port, **uvicorn_logging(args.log_level))
    finally:
        engine.shutdown()
        meter.budgets.close()
        if meter.budgets.webhook is not None:
            meter.budgets.webhook.close()
        for database in {meter.ledger.database, gatekeeper.database.database}:
            database.close()
    return 0


def api_keys_from_environment() -> list[str]:
    """$TOLLWAY_API_KEY: one key, or several separated by commas; unlike --api-key, not shown by ps."""
    return [key.strip() for key in os.environ.get("TOLLWAY_API_KEY", "").split(",") if key.strip()]


def server_parts(server: ServerConfig, config: EngineConfig):
    """What a serving process builds from the server's settings: its gatekeeper, its meter and
    the Batch API's store. (Each replica of a fleet builds its own.)"""
    from tollway.server.keys import Gatekeeper, KeyDatabase

    shared = _shared_database(server)
    gatekeeper = Gatekeeper(server.keys, KeyDatabase(shared or server.keys_db or default_keys_db()))
    return (gatekeeper, _meter(server, config, shared),
            shared or Path(server.data_dir or user_data_dir("tollway")) / "batches")


def _shared_database(server: ServerConfig):
    """The fleet's PostgreSQL database, when the server is given one (None: SQLite files)."""
    if not server.database_url:
        return None
    if server.keys_db or server.meter.ledger:
        raise ValueError("a database URL holds the keys and the ledger too: drop --keys-db / keys_db and [meter] ledger")
    return _database(server.database_url)


def _database(url: str):
    from tollway.storage.database import Database, is_database_url

    if not is_database_url(url):
        raise ValueError(f"a database URL must be postgresql://..., got {url!r}")
    return Database(url)


def _meter(server: ServerConfig, config: EngineConfig, shared=None):
    from tollway.meter.budgets import Budgets
    from tollway.meter.ledger import Ledger
    from tollway.meter.meter import Meter
    from tollway.meter.price_card import PriceCard
    from tollway.meter.webhook import Webhook

    ledger = Ledger(shared or default_ledger(server))
    webhook = Webhook(server.meter.webhook) if server.meter.webhook else None
    return Meter(PriceCard(server.meter.price_per_hour, config.scheduler.tiers), ledger,
                 Budgets(server.meter.budgets, ledger, webhook))


def _keys(args) -> int:
    from tollway.server.keys import KeyDatabase

    if args.database_url and args.keys_db:
        raise ValueError("keys: give --database-url or --keys-db, not both")
    db = KeyDatabase(_database(args.database_url) if args.database_url else args.keys_db or default_keys_db())
    if args.action == "list":
        for k in db.list():
            print(f"{k['name']}\ttiers={','.join(k['tiers'])}\trpm={k['rpm'] or '-'}\ttpm={k['tpm'] or '-'}")
        return 0
    if not args.name:
        raise ValueError(f"keys {args.action} needs --name")
    if args.action == "revoke":
        if not db.revoke(args.name):
            raise ValueError(f"no key named {args.name!r}")
        return 0
    print(db.add(args.name, [t.strip() for t in args.tiers.split(",") if t.strip()], args.rpm, args.tpm))
    return 0


def _is_loopback(host: str, ipaddress) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        if args.command in COMMANDS or (args.command == "report" and args.files):
            check_bench_extra(args.command)
        commands = {"serve": _serve, "keys": _keys, "generate": _generate, "usage": _usage, "report": _report,
                    "bench": bench_cli.bench_main, "compare": bench_cli.compare_main, "profile": profile_command.profile_main,
                    "simulate": sim_cli.simulate_main, "plan": sim_cli.plan_main,
                    "advise": sim_cli.advise_main}
        return commands[args.command](args)
    except ValueError as e:  # bad model path, unsupported architecture, long prompt, bad sampling values
        print(f"tollway: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
