"""The engine's command-line settings, shared by `tollway serve`, `generate` and `profile`: a
TOML file, then flags on top of it, read into an EngineConfig."""
from __future__ import annotations

import argparse
from pathlib import Path

from tollway.config import KERNELS, KV_CACHE_DTYPES, POLICIES, EngineConfig, load_config, memory_budget
from tollway.server.tool_parsers import TOOL_CALL_PARSERS


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine settings: a TOML file, then flags on top of it."""
    parser.add_argument("--config", help="a TOML file of engine, [scheduler] and [tiers.<name>] settings")
    parser.add_argument("--model", help="a .gguf file, a Hugging Face folder, or the embedded default 'gemma3-270m'")
    parser.add_argument("--kernel", choices=("auto",) + KERNELS)
    parser.add_argument("--device")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                        help="auto: float16 on the CPU (float32 under --kernel fp32), bfloat16 on a GPU")
    parser.add_argument("--max-model-len", type=int,
                        help="prompt + output tokens per request (default: what the model supports and the KV pool holds)")
    parser.add_argument("--max-num-seqs", type=int, help="sequences per step at most")
    parser.add_argument("--max-num-batched-tokens", type=int, help="tokens per step at most (decodes + prefill chunks)")
    parser.add_argument("--kv-cache-memory", metavar="SIZE",
                        help="the KV pool's memory: bytes (2GiB, 500MB) or a share of the device's memory (0.2); "
                             "default: 2048 blocks of 16 tokens")
    parser.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                        help="a Jinja chat template, as a file or inline, in place of the model's own")
    parser.add_argument("--tool-call-parser", metavar="|".join(TOOL_CALL_PARSERS),
                        help="the syntax the model writes tool calls in, read from its replies under tool_choice "
                             "auto (constrained: a grammar writes them); default: the one its chat template teaches, "
                             "else constrained")
    # vLLM's name too: its fcfs and priority policies are tollway's of those names
    parser.add_argument("--policy", "--scheduling-policy", dest="policy", choices=POLICIES)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        help="reuse the KV of a prompt's cached prefix (default: on)")
    parser.add_argument("--fast-tpot-target", type=float, metavar="SECONDS", help="the fast lane's per-token target")
    parser.add_argument("--standard-tpot-slo", type=float, metavar="SECONDS", help="the standard lane's p99 TPOT SLO")


def engine_config(args) -> EngineConfig:
    config = load_config(args.config) if args.config else EngineConfig()
    sched = config.scheduler
    model = getattr(args, "model_path", None)
    if model and args.model and model != args.model:
        raise ValueError(f"two models given: {model} and --model {args.model}")
    for value, target, name in ((model or args.model, config, "model"), (args.device, config, "device"),
                                (args.threads, config, "num_threads"), (args.kernel, sched, "kernel"),
                                (args.kv_cache_dtype, config, "kv_cache_dtype"),
                                (args.max_model_len, sched, "max_model_len"), (args.policy, sched, "policy"),
                                (args.max_num_seqs, sched, "max_num_seqs"),
                                (args.max_num_batched_tokens, sched, "max_num_batched_tokens"),
                                (args.enable_prefix_caching, sched, "enable_prefix_caching"),
                                (args.kv_cache_memory, config, "kv_cache_memory"),
                                (chat_template(args.chat_template), config, "chat_template"),
                                (args.tool_call_parser, config, "tool_call_parser"),
                                (args.fast_tpot_target, sched.tiers["fast"], "tpot_target"),
                                (args.standard_tpot_slo, sched.tiers["standard"], "tpot_target")):
        if value is not None:
            setattr(target, name, value)
    sched.validate()
    if config.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {config.tool_call_parser!r}")
    if config.kv_cache_memory is not None:
        memory_budget(config.kv_cache_memory, 1)  # refused here, before the model loads
    return config


def chat_template(value: str | None) -> str | None:
    """--chat-template's Jinja text: the file it names, or the text itself; checked here, so that
    a template that does not parse is one line now rather than an error on every chat request."""
    import jinja2

    from tollway.text.chat_template import check_syntax

    if value is None:
        return None
    path = Path(value)
    is_file = "{" not in value and path.is_file()
    if "{" not in value and not is_file:
        raise ValueError(f"--chat-template: no such file {value} (inline templates contain {{%, {{{{ or {{#)")
    text = path.read_text() if is_file else value
    try:
        check_syntax(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse: {e.message} (line {e.lineno})") from None
    return text
