"""Command line: tollway serve (the OpenAI-compatible server) and tollway generate "prompt"."""
from __future__ import annotations

import argparse
import sys

from tollway.config import KERNELS, POLICIES, TIERS, EngineConfig, load_config
from tollway.request import SamplingParams


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollway", description="LLM inference with fast, standard and batch lanes")
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
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    add_engine_arguments(serve)
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine settings: a TOML file, then flags on top of it."""
    parser.add_argument("--config", help="a TOML file of engine, [scheduler] and [tiers.<name>] settings")
    parser.add_argument("--model", help="a .gguf file, a Hugging Face folder, or the embedded default 'gemma3-270m'")
    parser.add_argument("--kernel", choices=("auto",) + KERNELS)
    parser.add_argument("--device")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--policy", choices=POLICIES)
    parser.add_argument("--fast-tpot-target", type=float, metavar="SECONDS", help="the fast lane's per-token target")
    parser.add_argument("--standard-tpot-slo", type=float, metavar="SECONDS", help="the standard lane's p99 TPOT SLO")


def engine_config(args) -> EngineConfig:
    config = load_config(args.config) if args.config else EngineConfig()
    sched = config.scheduler
    for value, target, name in ((args.model, config, "model"), (args.device, config, "device"),
                                (args.threads, config, "num_threads"), (args.kernel, sched, "kernel"),
                                (args.max_model_len, sched, "max_model_len"), (args.policy, sched, "policy"),
                                (args.fast_tpot_target, sched.tiers["fast"], "tpot_target"),
                                (args.standard_tpot_slo, sched.tiers["standard"], "tpot_target")):
        if value is not None:
            setattr(target, name, value)
    sched.validate()
    return config


def _generate(args) -> int:
    from tollway.engine import Engine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    params.validate()
    config = engine_config(args)
    config.profile_steps = False  # one request: nothing to shape
    engine = Engine(config)
    prompt = args.prompt
    if args.chat:  # the template writes BOS itself
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                         add_special_tokens=False)
    request_id = engine.add_request(prompt, params, tier=args.tier)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve(args) -> int:
    import ipaddress

    import uvicorn

    from tollway.async_engine import AsyncEngine
    from tollway.engine import Engine
    from tollway.server.app import create_app
    from tollway.server.metrics import Metrics

    config = engine_config(args)
    name = args.served_model_name or config.model
    metrics = Metrics(name)
    engine = AsyncEngine(Engine(config), on_step=metrics.on_step)
    try:
        if not _is_loopback(args.host, ipaddress):
            print(f"tollway: warning: serving {args.host} with no API keys: anyone who can reach it can use it",
                  file=sys.stderr)
        uvicorn.run(create_app(engine, name, metrics), host=args.host, port=args.port, log_level="warning")
    finally:
        engine.shutdown()
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
        return _serve(args) if args.command == "serve" else _generate(args)
    except ValueError as e:  # bad model path, unsupported architecture, long prompt, bad sampling values
        print(f"tollway: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
