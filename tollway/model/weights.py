"""Checkpoints -> tensors under Hugging Face names, each at its own width.

A GGUF file is read in place: its quantized tensors stay the file's blocks in its memory map
(GGUFWeight), which the native kernels pack as they are (Q4_K stays Q4_K) and the embedding reads
row by row; only the small float tensors (norms) are copied out. So nothing of the weights is
converted or cached on disk: only the tokenizer, slow to convert from the file's vocabulary, is
(checkpoint.tokenizer_path). An HF folder's safetensors load as float32.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import tokenizers
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file

from tollway.checkpoint import ModelNotFoundError, resolve_model, tokenizer_source
from tollway.gguf_file import GGUFFile, MappedFile
from tollway.model.native.qmatmul import GGUF_KINDS
from tollway.model_config import ModelConfig
from tollway.model.sentencepiece_bpe import native_tokenizer
from tollway.text.tokenizer import Tokenizer

_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp calls the pre-FFN norm ffn_norm in both families; HF Llama calls it post_attention_layernorm,
# a name Gemma 3 uses for the norm on the attention output.
_GGUF_LAYER_NAMES_BY_ARCH = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
# Parts of multimodal checkpoints that the text model does not use.
_NON_TEXT_PARTS = ("vision_tower.", "multi_modal_projector.", "rotary_emb.inv_freq")
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),  # transformers 5 multimodal layout
    ("language_model.model.", "model."),  # transformers 4 multimodal layout
    ("language_model.lm_head.", "lm_head."),
)


@dataclass
class GGUFWeight:
    """A quantized tensor of a GGUF file, as the file holds it: its rows' blocks, a view of the
    file's memory map, in HF's row order (llama's Q and K rows are put back from llama.cpp's
    rotary order only where they are read: a copy of all of them would outlive the load in the
    heap)."""

    gguf_type: GGMLQuantizationType
    data: np.ndarray  # [rows, bytes per row] uint8, the file's
    shape: tuple[int, int]  # (rows, values per row): the HF weight's shape
    file: MappedFile | None = None
    row_order: np.ndarray | None = None  # HF row i is the file's row row_order[i]
    _values: torch.Tensor | None = field(default=None, repr=False, compare=False)  # float(), once made

    @property
    def blocks(self) -> np.ndarray:
        """[rows, bytes per row] in HF's row order: the file's bytes in place where it has that order."""
        return self.data if self.row_order is None else self.data[self.row_order]

    def float(self) -> torch.Tensor:
        """Its values in float32, as GGUF dequantizes them, for torch's kernels (fp32, bf16, int8)
        and references: made once, and shared by every engine built on this load, as a float
        checkpoint's tensors are. A q8 engine never asks for them."""
        if self._values is None:
            self._values = torch.from_numpy(np.require(dequantize(self.blocks, self.gguf_type), np.float32, ["C", "W"]))
        return self._values

    def release_pages(self, start: int = 0, end: int | None = None) -> None:
        """Gives back this process's pages of the file's rows start..end of this tensor (all of
        them by default; see MappedFile.release_pages)."""
        if self.file is not None:
            self.file.release_pages(self.data[start:end])

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class LoadedModel:
    config: ModelConfig
    # HF names (see expected_tensor_shapes) -> float32 tensors (norms; every tensor of an HF folder),
    # or GGUFWeight for a GGUF file's quantized ones
    tensors: dict[str, torch.Tensor | GGUFWeight]
    # checkpoint.tokenizer_source's answer, found when first asked for: a GGUF's first load
    # converts its tokenizer, which an engine does beside building its runner.
    tokenizer_source: Callable[[], tuple[Path | None, tokenizers.Tokenizer | None]]
    source: Path  # the .gguf file or HF folder the weights came from
    load_seconds: float
    gguf: GGUFFile | None = None  # the file the GGUFWeights lie in
    cache_dir: str | os.PathLike | None = None  # checkpoint.cache_root's argument

    @property
    def tokenizer_path(self) -> Path | None:
        """The folder for Tokenizer.load; None when the checkpoint has no tokenizer."""
        return self.tokenizer_source()[0]

    def load_tokenizer(self, chat_template: str | None = None) -> Tokenizer | None:
        """A GGUF's own tokenizer read natively where sentencepiece_bpe serves it (Gemma's); else
        Tokenizer.load of tokenizer_path, from the tokenizer a conversion just built where there
        is one (handed out once: each engine's own)."""
        native = native_tokenizer(self.gguf, chat_template, self.cache_dir) if self.gguf is not None else None
        if native is not None:
            return native
        folder, built = self.tokenizer_source()
        if built is not None:
            self.tokenizer_source = lambda: (folder, None)
        return Tokenizer.load(folder, chat_template, backend=built) if folder else None

    def float_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor in float32, the quantized ones dequantized: for a reference implementation
        (model/reference.py), not for serving."""
        return {name: t.float() for name, t in self.tensors.items()}

    def resident_bytes(self, packed: bool) -> int:
        """About what its weights take once loaded, `packed` for the native kernels or not: a GGUF
        tensor of a native format its own bytes (its scales up to 3% more), another matrix int8
        blocks (34 bytes a block of 32), float32 where not packed; the float tensors as they are."""
        total = 0
        for t in self.tensors.values():
            values = math.prod(t.shape)
            if isinstance(t, GGUFWeight):
                native = packed and t.gguf_type.name in GGUF_KINDS
                total += int(t.nbytes * 1.03) if native else values * 34 // 32 if packed else values * 4
            else:
                total += values * 4 + (values * 34 // 32 if packed and len(t.shape) == 2 else 0)
        return total

    def release_pages(self) -> None:
        """Gives back the pages of the GGUF file this process has read (packing the weights reads
        all of them), so they stop counting as its memory; what is read again comes back from the
        page cache."""
        if self.gguf is not None:
            self.gguf.mapped.release_pages()


def load_weights(model: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None) -> LoadedModel:
    """Load `model`: None or "gemma3-270m" (the embedded default), a .gguf file, or an HF folder.
    `cache_dir`: where a GGUF's tokenizer is kept once converted (checkpoint.cache_root)."""
    start = time.perf_counter()
    source = resolve_model(model)
    if source.is_dir():
        config, tensors, tokenizer = _load_hf_folder(source)
        return LoadedModel(config, tensors, lambda: (tokenizer, None), source, time.perf_counter() - start)
    reader = GGUFFile(source)
    config = ModelConfig.from_gguf(reader)
    tensors = _gguf_tensors(reader, config)
    _check_tensors(tensors, config, source)
    return LoadedModel(config, tensors, functools.cache(functools.partial(tokenizer_source, source, cache_dir, reader)),
                       source, time.perf_counter() - start, reader, cache_dir)


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, by HF name. Tied models have no lm_head."""
    hidden, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    layer = {
        "self_attn.q_proj.weight": (q_out, hidden),
        "self_attn.k_proj.weight": (kv_out, hidden),
        "self_attn.v_proj.weight": (kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q_out,), "self_attn.k_proj.bias": (kv_out,), "self_attn.v_proj.bias": (kv_out,)}
    if config.qk_norm:
        layer |= {"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)}
    if config.architecture == "gemma3":
        layer |= {"pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,)}
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _check_tensors(tensors: dict[str, torch.Tensor | GGUFWeight], config: ModelConfig, source: Path) -> None:
    expected = expected_tensor_shapes(config)
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    wrong = sorted(n for n in expected.keys() & tensors.keys() if tuple(tensors[n].shape) != expected[n])
    if missing or unexpected or wrong:
        detail = "; ".join(
            f"{label} {names[:3]}{' ...' if len(names) > 3 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
            if names
        )
        raise ValueError(f"{source}: weights do not match its {config.architecture} config: {detail}")


# --- Hugging Face folders ---------------------------------------------------------------------

def _load_hf_folder(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path | None]:
    config = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    tensors = {}
    for shard in _safetensors_files(folder):
        for name, tensor in load_file(shard).items():
            hf_name = _text_model_name(name)
            if hf_name is not None:
                tensors[hf_name] = tensor.float().contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some checkpoints store the tied copy as well
    _check_tensors(tensors, config, folder)
    return config, tensors, folder if (folder / "tokenizer.json").is_file() else None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder} has a config.json but no *.safetensors weights")
    return files


def _text_model_name(name: str) -> str | None:
    """The name a tensor has in a text-only HF model, or None if the text model does not use it."""
    if any(part in name for part in _NON_TEXT_PARTS):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


# --- GGUF files ------------------------------------------------------------------------------

def _gguf_tensors(reader: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor | GGUFWeight]:
    # llama.cpp's converter interleaves Q/K rows for its rotary layout in the llama architecture only.
    permuted = reader.metadata["general.architecture"] == "llama"
    tensors = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # already in config.rope_scaling
        heads = config.num_heads if ".attn_q." in t.name else config.num_kv_heads
        rotary = permuted and (".attn_q." in t.name or ".attn_k." in t.name)
        if t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) and len(t.shape) == 2:
            order = _unpermute_rotary(np.arange(len(t.data)), heads) if rotary else None
            weight = GGUFWeight(t.tensor_type, t.data, (int(t.shape[1]), int(t.shape[0])), reader.mapped, order)
        else:  # plain numbers: norms, and the weights of unquantized files
            values = dequantize(t.data, t.tensor_type) if t.tensor_type != GGMLQuantizationType.F32 else t.data
            if config.architecture == "gemma3" and t.name.endswith("norm.weight"):
                values = values - np.float32(1.0)  # llama.cpp stores Gemma norms as 1 + w; HF keeps w
            if rotary:
                values = _unpermute_rotary(values, heads)
            # a writable copy of our own: F32 tensors come back as read-only views of the file's map
            weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"]).copy())
        tensors[_hf_name(t.name, config.architecture)] = weight
    return tensors


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order. Per head, llama.cpp's rope kernel wants each rotary pair
    interleaved (x0, y0, x1, y1, ...); HF keeps the halves apart (x0, x1, ..., y0, y1, ...)."""
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str, architecture: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        hf_part = _GGUF_LAYER_NAMES_BY_ARCH[architecture].get(part) or _GGUF_LAYER_NAMES.get(part)
        if hf_part is not None:
            return f"model.layers.{layer}.{hf_part}.{kind}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in a {architecture} GGUF file")
