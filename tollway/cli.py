"""Command line: tollway generate "prompt" (more subcommands come with the server)."""
from __future__ import annotations

import argparse
import sys

from tollway.config import KERNELS, EngineConfig, SchedulerConfig
from tollway.request import SamplingParams


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollway", description="LLM inference with fast, standard and batch lanes")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=EngineConfig.model,
                     help="a .gguf file, a Hugging Face folder, or the embedded default 'gemma3-270m'")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default here)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string; repeat for more")
    gen.add_argument("--kernel", default="auto", choices=("auto",) + KERNELS)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=SchedulerConfig.max_model_len)
    return parser


def _generate(args) -> int:
    from tollway.engine import Engine

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop)
    params.validate()
    config = EngineConfig(model=args.model, device=args.device, num_threads=args.threads,
                          scheduler=SchedulerConfig(kernel=args.kernel, max_model_len=args.max_model_len))
    engine = Engine(config)
    prompt = args.prompt
    if args.chat:  # the template writes BOS itself
        prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                                         add_special_tokens=False)
    request_id = engine.add_request(prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _generate(args)
    except ValueError as e:  # bad model path, unsupported architecture, long prompt, bad sampling values
        print(f"tollway: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
