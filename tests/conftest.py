"""Shared fixtures. Model fixtures are session-scoped: the default model is loaded once."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tollway.text.tokenizer import Tokenizer
from tollway.model.host_memory import return_freed_memory
from tollway.model.weights import LoadedModel, load_weights

from postgres_server import postgres, store_target  # noqa: F401 -- fixtures: one server for the session


# What makes a test slow to start: a model loaded, models built, native code compiled, a
# database server, a Ray cluster. A test that needs none of them is `quick` (pytest -m quick, for the edit-test
# loop), unless it is marked `slow` (it starts processes or servers of its own).
HEAVY_FIXTURES = {"default_weights", "tiny_hf_models", "tiny_gguf", "native_cache", "postgres", "store_target", "fleet"}


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: needs no model, compiler or database (selected automatically)")
    config.addinivalue_line("markers", "slow: starts processes or servers of its own: never quick")


def pytest_collection_modifyitems(items):
    for item in items:
        if not HEAVY_FIXTURES & set(item.fixturenames) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


def _peak_memory_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def pytest_terminal_summary(terminalreporter):
    """The test process's peak memory, printed after every run: the suite must fit in 8 GB."""
    terminalreporter.write_line(f"peak resident memory of the test process: {_peak_memory_gib():.2f} GiB")


def pytest_sessionfinish(session, exitstatus):
    """Under .ci/run ($TOLLWAY_MAX_TEST_MEMORY_GIB), a run past that peak fails, whatever passed."""
    limit = os.environ.get("TOLLWAY_MAX_TEST_MEMORY_GIB")
    if limit and _peak_memory_gib() > float(limit) and exitstatus == 0:
        session.exitstatus = 1
        print(f"\nthe test process peaked at {_peak_memory_gib():.2f} GiB, over the {limit} GiB allowed")


@pytest.fixture(autouse=True, scope="module")
def free_what_the_module_built():
    """After each module, give back the engines it built: the suite must fit in 8 GB. Three things
    would keep them for the whole session: FastAPI (0.165) caches each endpoint it classifies in
    module-level LRUs, and the endpoints' closures hold their app's AsyncEngine; a server's
    AsyncEngine and its LiveStats form a cycle, which the next Engine's gc.freeze() puts out of
    the collector's reach; and freed heap stays in the process (host_memory.keep_freed_memory)."""
    yield
    import fastapi.dependencies.models

    for value in vars(fastapi.dependencies.models).values():
        if hasattr(value, "cache_clear"):
            value.cache_clear()
    gc.unfreeze()  # the next Engine freezes what is alive then again
    gc.collect()
    return_freed_memory()


@pytest.fixture(scope="session")
def default_weights() -> LoadedModel:
    """The embedded Gemma 3 270M, read in place (its tokenizer through the user cache, $TOLLWAY_CACHE honoured)."""
    return load_weights(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_weights: LoadedModel) -> Tokenizer:
    """The engine's: read natively from the file (sentencepiece_bpe.py)."""
    return default_weights.load_tokenizer()


@pytest.fixture(scope="session")
def tiny_hf_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny random HF checkpoints (no tokenizer), name -> folder:
    llama (fp32, untied), qwen2 (fp32, q/k/v bias, untied), qwen3 (bf16, qk-norm, tied),
    gemma3 (fp32, layers sliding then full, tied). Norm weights are randomized too, so a
    forward pass that gets the norm convention wrong does not match transformers."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    configs = {
        "llama": (LlamaConfig(**common, tie_word_embeddings=False), torch.float32),
        "qwen2": (Qwen2Config(**common, tie_word_embeddings=False), torch.float32),
        "qwen3": (Qwen3Config(**common, head_dim=16, tie_word_embeddings=True), torch.bfloat16),
        "gemma3": (Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"]), torch.float32),
    }
    root = tmp_path_factory.mktemp("tiny_hf")
    folders = {}
    for seed, (name, (config, dtype)) in enumerate(configs.items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                param.add_(torch.randn_like(param) * (0.1 if "norm" in param_name else 0.02))
        folders[name] = root / name
        model.to(dtype).save_pretrained(folders[name], safe_serialization=True)
    return folders


@pytest.fixture(scope="session")
def tiny_gguf(tiny_hf_models, tmp_path_factory) -> Path:
    """tiny_hf_models["llama"] written as llama.cpp would: a llama-architecture GGUF with Q/K rows
    permuted, blk.0.ffn_up quantized to Q8_0 (the rest F32), and a 320-token SentencePiece vocabulary."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = tiny_hf_models["llama"]
    config = AutoConfig.from_pretrained(folder)
    hf = load_file(folder / "model.safetensors")
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.gguf"

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words = ["ll", "\u2581he", "\u2581hell", "\u2581hello", "or", "ld", "\u2581wor", "\u2581world"]
    pieces = ["\u2581", *letters, *("\u2581" + c for c in letters), *words]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    assert len(tokens) == config.vocab_size
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))  # unknown, control, byte, normal
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)

    layer_names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    global_names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, tensor in hf.items():
        base = name.removesuffix(".weight")
        if base in global_names:
            gguf_name = global_names[base]
        else:
            _, _, layer, part = base.split(".", 3)
            gguf_name = f"blk.{layer}.{layer_names[part]}"
        values = tensor.float().numpy()
        if gguf_name.endswith(("attn_q", "attn_k")):  # llama.cpp's permute for its rope layout
            heads = config.num_attention_heads if gguf_name.endswith("attn_q") else config.num_key_value_heads
            values = values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        if gguf_name == "blk.0.ffn_up":
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name + ".weight", gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name + ".weight", np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def native_cache(tmp_path_factory):
    """A fresh cache folder for the whole test session: each native source compiles into it once."""
    return tmp_path_factory.mktemp("native-cache")


@pytest.fixture
def cache_with_shared_native(tmp_path) -> Path:
    """A cache folder of the test's own (weights, step profiles), but for compiled native code:
    libraries are named by a hash of their sources, flags and CPU, so the user cache's are the
    same bits, and compiling them afresh for every such test cost seconds each."""
    from tollway.checkpoint import cache_root

    shared = cache_root() / "native"
    shared.mkdir(parents=True, exist_ok=True)
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "native").symlink_to(shared, target_is_directory=True)
    return folder


@pytest.fixture(scope="session")
def native_library(native_cache):
    """The native matmul kernels, compiled once per test session into a fresh cache."""
    from tollway.model.native.qmatmul import q8_library

    library = q8_library(native_cache)
    assert library is not None
    return library


@pytest.fixture(scope="session")
def make_engine(default_weights):
    """Build an Engine on the already-loaded default model: make_engine(kernel="fp32", num_blocks=64, ...)."""
    from tollway.config import EngineConfig, SchedulerConfig
    from tollway.engine import Engine

    def build(profile_steps=False, **scheduler_options):
        # No step profile unless asked: each distinct config would time its own (seconds each).
        return Engine(EngineConfig(scheduler=SchedulerConfig(**scheduler_options), profile_steps=profile_steps),
                      progress=False, loaded=default_weights)

    return build


@pytest.fixture(scope="session")
def run_to_completion():
    """run(engine, prompts, params) adds every prompt and steps until done;
    returns ([final RequestOutput per prompt], [every StepPlan])."""

    def run(engine, prompts, params):
        ids = [engine.add_request(p, params) for p in prompts]
        finals, plans = {}, []
        while engine.has_unfinished():
            report = engine.step()
            for out in report.outputs:
                if out.finished:
                    finals[out.request_id] = out
            plans.append(report.plan)
        return [finals[i] for i in ids], plans

    return run
