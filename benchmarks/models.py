"""Test models for issue 54: random-weight models in the shapes of the GGUF models users run
(Gemma 3 1B and 4B, Llama 3.2 1B and 3.1 8B, Qwen2.5 1.5B, Qwen3), each written as GGUF with a
tokenizer of the right kind in the file and quantized to Q4_K_M by llama.cpp's own
`llama-quantize`: what tollway's memory and speed are measured on beside llama-server.

    python benchmarks/models.py --list                       # the shapes, and which are made
    python benchmarks/models.py --make gemma3-1b llama3.2-1b  # make these (none named: all); prints their paths
    python benchmarks/models.py --compare gemma3-1b [--quick] [--threads N]  # vs_llamacpp.py --model on each

Each model is made once into `<cache>/test-models/` (the user cache, `~/.cache/tollway`, or
$TOLLWAY_CACHE), never into the repository, and reused while its recipe is the same (a JSON
beside each file records the recipe, the file's size and its tensor bytes by GGUF type). Making
one writes an F16 GGUF (streamed one tensor at a time: no model is ever held whole in memory),
quantizes it with `llama-quantize` (built with the peer, see vs_llamacpp.peer_binaries), and
deletes the F16 file. On this 2-core machine a 1B shape takes 1 to 2 minutes (about 30 s to write
2-4 GB of F16, 20-90 s to quantize); the 8B shape writes 16 GB of F16 first (check the free
disk), so expect several times that.

The weights are seeded normal draws (std 0.02; norms 1; the embedding rows of tokens that are not
text 10 times smaller, as training leaves them, so that greedy decoding writes text), so a file
is made the same again (with the same numpy, tokenizers and llama.cpp), and the metadata and
tensor names are those llama.cpp's convert_hf_to_gguf.py writes for the architecture. The
tokenizers:

- Gemma 3: the default model's (Gemma 3 270M's GGUF), copied key by key: the same 262144-token
  SentencePiece vocabulary as every Gemma 3.
- Llama 3 (pre-tokenizer `llama-bpe`) and Qwen (`qwen2`): byte-level BPEs trained here with the
  `tokenizers` package to the real vocabularies' sizes (128000 merged tokens + 256 Llama 3
  specials; 151643 + Qwen's specials, padded to 151936 as the converter pads), with each
  model's pre-tokenizer regex and special tokens. They are trained on a corpus drawn from the
  Gemma 3 vocabulary's pieces (so the same everywhere): English words are one token each, as in
  the real ones, though the merges are not Meta's or Alibaba's.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # so a plain checkout runs it without `pip install -e .`
sys.path.insert(0, str(ROOT / "benchmarks"))  # common.py, vs_llamacpp.py, also when imported from elsewhere

from common import gguf_summary, gguf_summary_line  # noqa: E402
from tollway.checkpoint import DEFAULT_MODEL, cache_root, resolve_model  # noqa: E402

SEED = 54  # issue 54
STD = 0.02  # of every weight matrix, embeddings and biases: about what trained models have
QUANT = "Q4_K_M"
# The rows of the embedding (and of the LM head) of tokens that are not text (control, user-defined,
# unused and padding tokens) are drawn this much smaller, as training leaves them: their logits
# then never win a greedy step. At full scale a random model's greedy stream often settled on one
# control token, so a whole request's text came back empty (no first token: tollway bench's
# summary then fails on the None).
SPECIAL_ROW_SCALE = 0.1
# Bump when what a recipe writes changes (tensors, metadata, tokenizer): cached models are remade.
RECIPE_VERSION = 2
# Bump when the trained BPEs change (the models with one are remade). 2: each corpus piece stands
# alone on its line; run together, a piece with no space before it ("ict") made one long word,
# and the BPE learned tokens of a piece repeated ("ictictict").
BPE_VERSION = 2


@dataclass(frozen=True)
class Shape:
    """One test model: the hyperparameters of the real model it is shaped like, in HF's terms."""

    name: str
    like: str  # the real model whose shape it has
    arch: str  # GGUF general.architecture: gemma3 | llama | qwen2 | qwen3
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool  # the LM head is the token embedding (no output.weight)
    context: int
    rope_theta: float
    rms_eps: float
    tokenizer: str  # gemma3 | llama3 | qwen2 | qwen3
    sliding_window: int | None = None  # gemma3
    rope_linear_factor: float | None = None  # gemma3 4B's linear rope scaling
    llama3_rope: dict | None = None  # Llama 3.1/3.2's rope scaling, baked into rope_freqs.weight
    head_dim_in_config: bool = True  # whether config.json has head_dim (the converter then writes key_length)

    @property
    def file_name(self) -> str:
        return f"{self.name}-shape-random-{QUANT}.gguf"

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(GGUF name, numpy shape (out, in), kind) in the converter's order; kind is weight
        (F16, random), norm (F32, ones), bias (F32, random) or rope_freqs (F32, computed)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("token_embd.weight", (self.vocab, h), "weight")]
        if self.llama3_rope:
            out.append(("rope_freqs.weight", (self.head_dim // 2,), "rope_freqs"))
        for i in range(self.layers):
            b = f"blk.{i}."
            out += [(b + "attn_norm.weight", (h,), "norm"), (b + "attn_q.weight", (q, h), "weight"),
                    (b + "attn_k.weight", (kv, h), "weight"), (b + "attn_v.weight", (kv, h), "weight")]
            if self.arch == "qwen2":
                out += [(b + "attn_q.bias", (q,), "bias"), (b + "attn_k.bias", (kv,), "bias"),
                        (b + "attn_v.bias", (kv,), "bias")]
            if self.arch in ("gemma3", "qwen3"):
                out += [(b + "attn_q_norm.weight", (self.head_dim,), "norm"),
                        (b + "attn_k_norm.weight", (self.head_dim,), "norm")]
            out.append((b + "attn_output.weight", (h, q), "weight"))
            if self.arch == "gemma3":
                out.append((b + "post_attention_norm.weight", (h,), "norm"))
            out += [(b + "ffn_norm.weight", (h,), "norm"), (b + "ffn_gate.weight", (self.intermediate, h), "weight"),
                    (b + "ffn_up.weight", (self.intermediate, h), "weight"),
                    (b + "ffn_down.weight", (h, self.intermediate), "weight")]
            if self.arch == "gemma3":
                out.append((b + "post_ffw_norm.weight", (h,), "norm"))
        out.append(("output_norm.weight", (h,), "norm"))
        if not self.tied:
            out.append(("output.weight", (self.vocab, h), "weight"))
        return out

    def parameters(self) -> int:
        return sum(math.prod(shape) for _, shape, kind in self.tensors() if kind != "rope_freqs")


_LLAMA31_ROPE = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)

SHAPES = {s.name: s for s in [
    # Gemma 3 1B's config: hidden 1152 is not a multiple of 256, so llama-quantize gives its
    # matrices legacy quants (Q5_0, Q8_0) in place of K-quants, as in the real 1B Q4_K_M.
    Shape("gemma3-1b", "Gemma 3 1B", "gemma3", hidden=1152, layers=26, intermediate=6912, heads=4, kv_heads=1,
          head_dim=256, vocab=262144, tied=True, context=32768, rope_theta=1e6, rms_eps=1e-6, tokenizer="gemma3",
          sliding_window=512),
    # No such Gemma 3: between 1B and 4B, with a hidden size K-quants apply to (Q4_K and Q6_K).
    Shape("gemma3-1.5b", "no real model: a Gemma 3 of 1.5B besides its embedding, hidden 2048", "gemma3",
          hidden=2048, layers=24, intermediate=8192, heads=8, kv_heads=4, head_dim=256, vocab=262144, tied=True,
          context=32768, rope_theta=1e6, rms_eps=1e-6, tokenizer="gemma3", sliding_window=1024),
    Shape("gemma3-4b", "Gemma 3 4B (its text model)", "gemma3", hidden=2560, layers=34, intermediate=10240, heads=8,
          kv_heads=4, head_dim=256, vocab=262144, tied=True, context=131072, rope_theta=1e6, rms_eps=1e-6,
          tokenizer="gemma3", sliding_window=1024, rope_linear_factor=8.0),
    Shape("llama3.2-1b", "Llama 3.2 1B", "llama", hidden=2048, layers=16, intermediate=8192, heads=32, kv_heads=8,
          head_dim=64, vocab=128256, tied=True, context=131072, rope_theta=500000.0, rms_eps=1e-5, tokenizer="llama3",
          llama3_rope=_LLAMA32_ROPE),
    Shape("llama3.1-8b", "Llama 3.1 8B", "llama", hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8,
          head_dim=128, vocab=128256, tied=False, context=131072, rope_theta=500000.0, rms_eps=1e-5,
          tokenizer="llama3", llama3_rope=_LLAMA31_ROPE),
    Shape("qwen2.5-1.5b", "Qwen2.5 1.5B", "qwen2", hidden=1536, layers=28, intermediate=8960, heads=12, kv_heads=2,
          head_dim=128, vocab=151936, tied=True, context=32768, rope_theta=1e6, rms_eps=1e-6, tokenizer="qwen2",
          head_dim_in_config=False),
    Shape("qwen3-0.6b", "Qwen3 0.6B", "qwen3", hidden=1024, layers=28, intermediate=3072, heads=16, kv_heads=8,
          head_dim=128, vocab=151936, tied=True, context=40960, rope_theta=1e6, rms_eps=1e-6, tokenizer="qwen3"),
    Shape("qwen3-1.7b", "Qwen3 1.7B", "qwen3", hidden=2048, layers=28, intermediate=6144, heads=16, kv_heads=8,
          head_dim=128, vocab=151936, tied=True, context=40960, rope_theta=1e6, rms_eps=1e-6, tokenizer="qwen3"),
]}


def models_folder() -> Path:
    return cache_root() / "test-models"


def model_path(name: str) -> Path:
    return models_folder() / SHAPES[name].file_name


def recipe(shape: Shape) -> dict:
    """What a made file depends on: a cached file whose recipe differs is remade."""
    return {"version": RECIPE_VERSION, "seed": SEED, "std": STD, "special_row_scale": SPECIAL_ROW_SCALE,
            "quant": QUANT, "shape": asdict(shape)} | ({} if shape.tokenizer == "gemma3" else {"bpe": BPE_VERSION})


# --- Tokenizers -----------------------------------------------------------------------------

# GGUF value types, by name, so this file reads without gguf's enums at every line
@dataclass
class KV:
    key: str
    value: object
    type: str  # a GGUFValueType name
    sub_type: str | None = None


# The pre-tokenizer regexes llama.cpp runs for these pre names (llama-vocab.cpp), as Hugging Face
# spells them (transformers' GGUF tokenizer mapping uses the same).
_SPLITS = {
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
# llama.cpp's token types
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6

_LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                     "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                     "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
                    + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)])
_QWEN25_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                    "<|repo_name|>", "<|file_sep|>"]
_QWEN3_SPECIALS = _QWEN25_SPECIALS + ["<tool_response>", "</tool_response>", "<think>", "</think>"]

_LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
_CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@dataclass(frozen=True)
class BPEKind:
    pre: str
    merged: int  # tokens before the specials: the 256 bytes and the merges
    specials: tuple[str, ...]
    size: int  # with the specials, and [PAD<i>] up to the embedding's rows
    bos: str
    eos: str
    add_bos: bool
    template: str
    padding: str | None = None


BPE_KINDS = {
    "llama3": BPEKind("llama-bpe", 128000, tuple(_LLAMA3_SPECIALS), 128256, "<|begin_of_text|>", "<|eot_id|>", True,
                      _LLAMA3_TEMPLATE),
    "qwen2": BPEKind("qwen2", 151643, tuple(_QWEN25_SPECIALS), 151936, "<|endoftext|>", "<|im_end|>", False,
                     _CHATML_TEMPLATE, padding="<|endoftext|>"),
    "qwen3": BPEKind("qwen2", 151643, tuple(_QWEN3_SPECIALS), 151936, "<|endoftext|>", "<|im_end|>", False,
                     _CHATML_TEMPLATE, padding="<|endoftext|>"),
}


def _value_type(name: str):
    from gguf import GGUFValueType

    return GGUFValueType[name]


@functools.lru_cache(maxsize=1)
def _default_gguf_fields() -> dict:
    from gguf import GGUFReader

    return GGUFReader(resolve_model(DEFAULT_MODEL)).fields


def gemma3_tokenizer() -> list[KV]:
    """The default model's tokenizer.* keys, as they are: Gemma 3's one vocabulary."""
    from gguf import GGUFValueType

    out = []
    for key, f in _default_gguf_fields().items():
        if key.startswith("tokenizer."):
            array = f.types[0] == GGUFValueType.ARRAY
            out.append(KV(key, f.contents(), f.types[0].name, f.types[1].name if array else None))
    return out


def _bpe_corpus(split: str):
    """Texts to train a byte-level BPE on, the same on every machine: Gemma 3's vocabulary pieces
    (a multilingual, SentencePiece-ranked list of words and word parts), each on a line of its own
    as many times as its rank says (frequent pieces first, as in text), and numbers written as the
    split cuts them. A newline splits every piece from the next, so each is one word to the BPE."""
    fields = _default_gguf_fields()
    tokens, types = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.token_type"].contents()
    pieces = [t.replace("\u2581", " ") for t, kind in zip(tokens, types) if kind == NORMAL]
    for rank, piece in enumerate(pieces):
        if piece.strip():
            yield (piece + "\n") * max(1, 2000 // (1 + rank // 64))
    digits = 3 if "{1,3}" in split else 1
    for n in range(10 ** digits):
        yield f" {n}\n" * max(1, 200 // (1 + n // 10))


@functools.lru_cache(maxsize=None)
def _trained_bpe(pre: str, merged: int) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a byte-level BPE of `merged` tokens trained for pre-tokenizer `pre`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = _SPLITS[pre]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=merged, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    print(f"models: training a {merged}-token byte-level BPE ({pre} pre-tokenizer)", file=sys.stderr)
    tokenizer.train_from_iterator(_bpe_corpus(split), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda item: item[1])
    if len(vocab) != merged or [i for _, i in vocab] != list(range(merged)):
        raise SystemExit(f"models: the BPE trained to {len(vocab)} tokens, not {merged}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return [t for t, _ in vocab], merges


def bpe_tokenizer(kind: str) -> list[KV]:
    spec = BPE_KINDS[kind]
    tokens, merges = _trained_bpe(spec.pre, spec.merged)
    tokens = tokens + list(spec.specials)
    # control for <|...|> specials, user-defined for the plain-text ones (<think>, <tool_call>), as
    # the converter marks Qwen's added tokens that are not `special`
    types = [NORMAL] * spec.merged + [CONTROL if t.startswith("<|") else USER_DEFINED for t in spec.specials]
    pads = range(len(tokens), spec.size)
    tokens += [f"[PAD{i}]" for i in pads]
    types += [UNUSED] * len(pads)
    out = [KV("tokenizer.ggml.model", "gpt2", "STRING"), KV("tokenizer.ggml.pre", spec.pre, "STRING"),
           KV("tokenizer.ggml.tokens", tokens, "ARRAY", "STRING"),
           KV("tokenizer.ggml.token_type", types, "ARRAY", "INT32"),
           KV("tokenizer.ggml.merges", merges, "ARRAY", "STRING"),
           KV("tokenizer.ggml.bos_token_id", tokens.index(spec.bos), "UINT32"),
           KV("tokenizer.ggml.eos_token_id", tokens.index(spec.eos), "UINT32")]
    if spec.padding:
        out.append(KV("tokenizer.ggml.padding_token_id", tokens.index(spec.padding), "UINT32"))
    out += [KV("tokenizer.ggml.add_bos_token", spec.add_bos, "BOOL"),
            KV("tokenizer.chat_template", spec.template, "STRING")]
    return out


def tokenizer_kvs(shape: Shape) -> list[KV]:
    kvs = gemma3_tokenizer() if shape.tokenizer == "gemma3" else bpe_tokenizer(shape.tokenizer)
    tokens = next(kv.value for kv in kvs if kv.key == "tokenizer.ggml.tokens")
    if len(tokens) != shape.vocab:
        raise SystemExit(f"models: {shape.name}'s tokenizer has {len(tokens)} tokens, its embedding {shape.vocab} rows")
    return kvs


# --- Writing the F16 GGUF -------------------------------------------------------------------

def _llama3_rope_factors(shape: Shape) -> np.ndarray:
    """convert_hf_to_gguf's rope_freqs for rope_type llama3 (LlamaModel.generate_extra_tensors)."""
    p, dim = shape.llama3_rope, shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(p["factor"])
        else:
            smooth = ((p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"])
                      / (p["high_freq_factor"] - p["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _tensor_data(shape: Shape, name: str, dims: tuple[int, ...], kind: str, special_rows: np.ndarray) -> np.ndarray:
    """A tensor's values: seeded by the model and the tensor's name, so each is reproducible alone.
    Matrices are drawn in row chunks of about 64 MB of float32, straight into float16; the rows of
    `special_rows` of the token embedding and LM head SPECIAL_ROW_SCALE times smaller."""
    if kind == "norm":
        return np.ones(dims, dtype=np.float32)
    if kind == "rope_freqs":
        return _llama3_rope_factors(shape)
    rng = np.random.default_rng([SEED, zlib.crc32(shape.name.encode()), zlib.crc32(name.encode())])
    if kind == "bias":
        return (rng.standard_normal(dims, dtype=np.float32) * STD).astype(np.float32)
    out = np.empty(dims, dtype=np.float16)
    rows = max(1, (16 << 20) // dims[1])
    for start in range(0, dims[0], rows):
        chunk = rng.standard_normal((min(rows, dims[0] - start), dims[1]), dtype=np.float32)
        chunk *= STD
        out[start:start + rows] = chunk
    if name in ("token_embd.weight", "output.weight"):
        out[special_rows] *= np.float16(SPECIAL_ROW_SCALE)
    return out


def write_f16(shape: Shape, path: Path) -> None:
    """The model as llama.cpp's converter writes it with --outtype f16: matrices F16, vectors F32."""
    import gguf

    tensors = shape.tensors()
    writer = gguf.GGUFWriter(path, shape.arch)
    a = shape.arch

    def add(key: str, value, type_name: str, sub_type: str | None = None) -> None:
        writer.add_key_value(key, value, _value_type(type_name), _value_type(sub_type) if sub_type else None)

    add("general.type", "model", "STRING")
    add("general.name", f"random {shape.name} shape", "STRING")
    add("general.description", f"Random weights (seed {SEED}, normal std {STD}, norms 1; the embedding rows of "
        f"tokens that are not text {SPECIAL_ROW_SCALE} times smaller) in the shape of {shape.like}; made by "
        "tollway's benchmarks/models.py for measuring, not for use", "STRING")
    add("general.file_type", int(gguf.LlamaFileType.MOSTLY_F16), "UINT32")
    add("general.quantization_version", gguf.GGML_QUANT_VERSION, "UINT32")
    add(f"{a}.block_count", shape.layers, "UINT32")
    add(f"{a}.context_length", shape.context, "UINT32")
    add(f"{a}.embedding_length", shape.hidden, "UINT32")
    add(f"{a}.feed_forward_length", shape.intermediate, "UINT32")
    add(f"{a}.attention.head_count", shape.heads, "UINT32")
    add(f"{a}.attention.head_count_kv", shape.kv_heads, "UINT32")
    add(f"{a}.rope.freq_base", shape.rope_theta, "FLOAT32")
    add(f"{a}.attention.layer_norm_rms_epsilon", shape.rms_eps, "FLOAT32")
    if shape.head_dim_in_config:
        add(f"{a}.attention.key_length", shape.head_dim, "UINT32")
        add(f"{a}.attention.value_length", shape.head_dim, "UINT32")
    if a == "gemma3":
        add(f"{a}.attention.sliding_window", shape.sliding_window, "UINT32")
        add(f"{a}.rope.freq_base_swa", 10000.0, "FLOAT32")
    if shape.rope_linear_factor:
        add(f"{a}.rope.scaling.type", "linear", "STRING")
        add(f"{a}.rope.scaling.factor", shape.rope_linear_factor, "FLOAT32")
    if a == "llama":
        add(f"{a}.vocab_size", shape.vocab, "UINT32")
        add(f"{a}.rope.dimension_count", shape.head_dim, "UINT32")
    tokenizer = tokenizer_kvs(shape)
    for kv in tokenizer:
        add(kv.key, kv.value, kv.type, kv.sub_type)
    types = np.array(next(kv.value for kv in tokenizer if kv.key == "tokenizer.ggml.token_type"))
    special_rows = np.flatnonzero((types != NORMAL) & (types != BYTE))

    for name, dims, kind in tensors:
        dtype = np.float16 if kind == "weight" else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), math.prod(dims) * np.dtype(dtype).itemsize)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(math.prod(dims) * (2 if kind == "weight" else 4) for _, dims, kind in tensors)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}") as bar:
        for name, dims, kind in tensors:
            data = _tensor_data(shape, name, dims, kind, special_rows)
            writer.write_tensor_data(data)
            bar.update(data.nbytes)
            del data
    writer.close()


# --- Quantizing and describing ------------------------------------------------------------

def llama_quantize() -> Path:
    """llama.cpp's llama-quantize, built with the peer (vs_llamacpp.py) where the cache has none."""
    from vs_llamacpp import peer_tool

    return peer_tool("llama-quantize")


def quantize(source: Path, target: Path, threads: int) -> None:
    """`llama-quantize source target Q4_K_M threads`, under a bar fed by its [i/n] lines."""
    command = [str(llama_quantize()), str(source), str(target), QUANT, str(threads)]
    counter = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")
    log = []
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with tqdm(desc=f"llama-quantize {target.name}", unit="tensor") as bar:
            for line in run.stdout:
                log.append(line)
                if match := counter.match(line):
                    bar.total = int(match[2])
                    bar.update(int(match[1]) - bar.n)
    finally:
        if run.poll() is None and sys.exc_info()[0] is not None:  # stopped (Ctrl-C, SIGTERM): stop it too
            run.kill()
    if run.wait() != 0:
        raise SystemExit(f"models: llama-quantize failed ({run.returncode}):\n{''.join(log[-40:])}")


def _record_path(path: Path) -> Path:
    return path.with_suffix(".json")


def made(name: str) -> dict | None:
    """The record of `name`'s model where it is made with the current recipe, else None."""
    path = model_path(name)
    try:
        record = json.loads(_record_path(path).read_text())
    except (OSError, ValueError):
        return None
    if record.get("recipe") != json.loads(json.dumps(recipe(SHAPES[name]))) or not path.is_file() \
            or path.stat().st_size != record["summary"]["bytes"]:
        return None
    return record


def make(name: str, threads: int | None = None) -> Path:
    """`name`'s Q4_K_M file, made now unless the cache has it with the current recipe."""
    shape, path = SHAPES[name], model_path(name)
    if made(name):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    f16 = path.with_name(path.name.replace(QUANT, "F16"))
    partial = path.with_name(path.name + ".partial")
    start = time.perf_counter()
    try:
        write_f16(shape, f16)
        written = time.perf_counter()
        quantize(f16, partial, threads or os.cpu_count())
        os.replace(partial, path)
    finally:
        f16.unlink(missing_ok=True)
        partial.unlink(missing_ok=True)
    summary = gguf_summary(path)
    record = {"recipe": recipe(shape), "summary": summary, "made": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "write_seconds": round(written - start, 1), "quantize_seconds": round(time.perf_counter() - written, 1)}
    _record_path(path).write_text(json.dumps(record, indent=1) + "\n")
    return path


# --- The command line -----------------------------------------------------------------------

def _names(given: list[str]) -> list[str]:
    unknown = [n for n in given if n not in SHAPES]
    if unknown:
        raise SystemExit(f"models: no shape named {', '.join(unknown)}; the shapes: {', '.join(SHAPES)}")
    return given or list(SHAPES)


def main() -> None:
    # SIGTERM as Ctrl-C: make() then deletes its F16 and partial files (16 GB for the 8B) on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="the shapes, and the files made of them")
    what.add_argument("--make", nargs="*", metavar="NAME", help="make these models (none named: all); prints paths")
    what.add_argument("--compare", nargs="*", metavar="NAME",
                      help="run vs_llamacpp.py --model on each (none named: all), made first where needed")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="llama-quantize's threads; with --compare, each server's (default: all cores)")
    parser.add_argument("--quick", action="store_true", help="with --compare: vs_llamacpp.py --quick")
    args = parser.parse_args()

    if args.list:
        print(f"test models in {models_folder()}:")
        for name, shape in SHAPES.items():
            record = made(name)
            print(f"  {name:13} {shape.parameters() / 1e9:5.2f}B {shape.arch:6} hidden {shape.hidden}, "
                  f"{shape.layers} layers, ffn {shape.intermediate}, heads {shape.heads}/{shape.kv_heads}x"
                  f"{shape.head_dim}, vocab {shape.vocab}{'' if shape.tied else ', untied'}; like {shape.like}")
            print(f"    {model_path(name)}: " + (gguf_summary_line(record["summary"]) if record else "not made"))
        return
    if args.make is not None:
        for name in _names(args.make):
            path = make(name, args.threads)
            print(path)
            print("  " + gguf_summary_line(made(name)["summary"]))
        return
    failed = []
    for name in _names(args.compare):
        path = make(name, args.threads)
        command = [sys.executable, str(Path(__file__).resolve().parent / "vs_llamacpp.py"), "--model", str(path),
                   "--threads", str(args.threads)] + (["--quick"] if args.quick else [])
        print(f"models: {' '.join(command)}", file=sys.stderr)
        if subprocess.run(command).returncode != 0:
            failed.append(name)
    if failed:
        raise SystemExit(f"models: the comparison failed on {', '.join(failed)}")


if __name__ == "__main__":
    main()
