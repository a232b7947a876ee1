"""Small GGUF models of each architecture, their tensors in the types a Q4_K_M file holds (Q4_K, Q6_K,
Q5_0, Q8_0, with q/k/v of two types in one fused matmul), written on the fly: each loads at its
file's own width, and its native steps give the same logits as torch's fp32 on the same values."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_blocks import random_blocks
from tollway.config import SchedulerConfig
from tollway.model.native.qmatmul import GGUF_KINDS
from tollway.model.runner import ModelRunner
from tollway.model.weights import GGUFWeight, load_weights
from tollway.request import SamplingParams
from tollway.scheduler.plan import ScheduledSeq, StepPlan

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 512, 2
# GGUF name -> type, as llama-quantize's Q4_K_M lays out a model whose widths are multiples of 256
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q5_0",
         "ffn_up": "Q5_0", "ffn_down": "Q6_K", "token_embd": "Q8_0", "output": "Q6_K"}
# (architecture, tied embeddings, q/k/v bias, q/k norms)
ARCHITECTURES = {"llama": ("llama", False, False, False), "qwen2": ("qwen2", False, True, False),
                 "qwen3": ("qwen3", True, False, True), "gemma3": ("gemma3", True, False, True)}


def _write_model(path, name: str) -> None:
    arch, tied, bias, qk_norm = ARCHITECTURES[name]
    rng = np.random.default_rng(len(name))
    writer = gguf.GGUFWriter(path, arch)
    for key, value in [("block_count", LAYERS), ("context_length", 256), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("attention.head_count", HEADS),
                       ("attention.head_count_kv", KV_HEADS), ("attention.key_length", HEAD_DIM),
                       ("attention.value_length", HEAD_DIM)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if arch == "gemma3":
        writer.add_uint32(f"{arch}.attention.sliding_window", 8)

    def matrix(gguf_name: str, rows: int, cols: int, kind: str) -> None:
        blocks = random_blocks(TYPES[kind], rows, cols, seed=int(rng.integers(1 << 30)), zero_row=False,
                               scales=(2e-5, 1e-4) if TYPES[kind] in ("Q4_K", "Q6_K") else (1e-4, 5e-4))
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[TYPES[kind]]]
        writer.add_tensor(gguf_name, blocks, raw_shape=(rows, cols // block * block_bytes),
                          raw_dtype=gguf.GGMLQuantizationType[TYPES[kind]])

    def vector(gguf_name: str, size: int) -> None:
        writer.add_tensor(gguf_name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    matrix("token_embd.weight", VOCAB, HIDDEN, "token_embd")
    if not tied:
        matrix("output.weight", VOCAB, HIDDEN, "output")
    vector("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        for part, rows, cols in [("attn_q", HEADS * HEAD_DIM, HIDDEN), ("attn_k", KV_HEADS * HEAD_DIM, HIDDEN),
                                 ("attn_v", KV_HEADS * HEAD_DIM, HIDDEN), ("attn_output", HIDDEN, HEADS * HEAD_DIM),
                                 ("ffn_gate", FFN, HIDDEN), ("ffn_up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)]:
            matrix(f"blk.{i}.{part}.weight", rows, cols, part)
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if arch == "gemma3" else [])
        for norm in norms:
            vector(f"blk.{i}.{norm}.weight", HIDDEN)
        if qk_norm:
            vector(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
            vector(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        if bias:
            for part, size in [("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM), ("attn_v", KV_HEADS * HEAD_DIM)]:
                writer.add_tensor(f"blk.{i}.{part}.bias", (0.01 * rng.standard_normal(size)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def quantized_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf_models") / f"{request.param}.gguf"
    _write_model(path, request.param)
    loaded = load_weights(path, cache_dir=tmp_path_factory.mktemp("cache"))
    return request.param, path, loaded


def _runner(loaded, kernel: str) -> ModelRunner:
    return ModelRunner(loaded.config, loaded.tensors, SchedulerConfig(block_size=4, num_blocks=16),
                       torch.device("cpu"), {kernel})


def test_every_matrix_is_packed_at_its_files_width(quantized_model, native_library):
    name, path, loaded = quantized_model
    model = _runner(loaded, "q8").model
    for layer in model.layers:
        qkv = layer.attn.qkv_proj.native
        assert [p.kind for p in qkv.parts] == ["q4k", "q6k"]  # q and k stacked, v apart
        assert (layer.attn.o_proj.native.kind, layer.mlp.gate_up.native.kind, layer.mlp.down.native.kind) == \
            ("q4k", "q5", "q6k")
    assert model.lm_head.native.kind == GGUF_KINDS[TYPES["token_embd" if ARCHITECTURES[name][1] else "output"]]
    quantized = [t for t in loaded.tensors.values() if isinstance(t, GGUFWeight)]
    file_bytes = sum(t.nbytes for t in quantized)
    linears = [lin for layer in model.layers
               for lin in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)]
    packed = sum(lin.native.streamed_bytes() for lin in [*linears, model.lm_head])
    embed_apart = 0 if ARCHITECTURES[name][1] else loaded.tensors["model.embed_tokens.weight"].nbytes
    assert packed <= 1.03 * (file_bytes - embed_apart)
    assert model.embed.dense is None  # the embedding's rows are read from the file's blocks


def test_native_steps_give_torchs_logits_on_the_files_values(quantized_model):
    """Teacher-forced over 12 tokens, a 5-token prefill then a token a step: the q8 runner (the
    file's blocks, int8 activations) against the fp32 one (the same values dequantized)."""
    _, _, loaded = quantized_model
    runners = {kernel: _runner(loaded, kernel) for kernel in ("q8", "fp32")}
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, logprobs=8)
    chunks = [(0, 5)] + [(i, i + 1) for i in range(5, 12)]
    for step, (start, end) in enumerate(chunks):
        tokens = {}
        for kernel, runner in runners.items():
            seq = ScheduledSeq("r", "standard", tuple(ids[start:end]), start, tuple(range(4)), True, params)
            [tokens[kernel]] = runner.execute(StepPlan(step, [seq], kernel)).tokens["r"]
        exact, native = tokens["fp32"], tokens["q8"]
        top = sorted(exact.top_logprobs, key=exact.top_logprobs.get, reverse=True)
        got = torch.tensor([native.top_logprobs.get(t, float("-inf")) for t in top[:4]])
        # int8 activations move a logprob of these random models by up to ~2%; a wrong scale or row
        # order moves them by far more
        torch.testing.assert_close(got, torch.tensor([exact.top_logprobs[t] for t in top[:4]]), atol=0.1, rtol=0)
        if exact.top_logprobs[top[0]] - exact.top_logprobs[top[1]] > 0.2:
            assert native.token_id == exact.token_id
