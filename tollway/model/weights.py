"""Checkpoints -> float32 tensors under Hugging Face names, with converted GGUF files cached on disk.

A GGUF file is dequantized once and the result cached as safetensors: later loads are a plain
memory copy instead of tens of seconds of metadata parsing and dequantization. An HF folder is
already in that shape and loads directly.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.quants import dequantize
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from tollway.checkpoint import CACHE_FORMAT, ModelNotFoundError, cache_complete, cache_folder, cache_root, resolve_model
from tollway.gguf_file import GGUFFile
from tollway.model_config import ModelConfig
from tollway.text.tokenizer import save_gguf_tokenizer

_log = logging.getLogger(__name__)

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
class LoadedModel:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # float32, contiguous, HF names (see expected_tensor_shapes)
    tokenizer_path: Path | None  # folder for Tokenizer.load; None when the checkpoint has no tokenizer
    source: Path  # the .gguf file or HF folder the weights came from
    from_cache: bool  # True when read from the converted-weights cache
    load_seconds: float


def load_weights(model: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
                 progress: bool = True) -> LoadedModel:
    """Load `model`: None or "gemma3-270m" (the embedded default), a .gguf file, or an HF folder."""
    start = time.perf_counter()
    source = resolve_model(model)
    if source.is_dir():
        config, tensors, tokenizer_path = _load_hf_folder(source)
        from_cache = False
    else:
        config, tensors, tokenizer_path, from_cache = _load_gguf(source, cache_root(cache_dir), progress)
    return LoadedModel(config, tensors, tokenizer_path, source, from_cache, time.perf_counter() - start)


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


def _check_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, source: Path) -> None:
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


# --- GGUF files and the converted-weights cache -----------------------------------------------

def _load_gguf(path: Path, root: Path, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], Path | None, bool]:
    folder = cache_folder(path, root)
    if cache_complete(folder):
        try:
            config, tensors, tokenizer_path = _read_cache(folder)
            return config, tensors, tokenizer_path, True
        except (OSError, ValueError, TypeError, KeyError, SafetensorError) as exc:
            _log.warning("converted weights in %s are unreadable (%s); converting again", folder, exc)
    elif folder.exists():
        _log.warning("converted weights in %s are incomplete; converting again", folder)
    _log.info("converting %s once; later loads read %s", path, folder)
    reader = GGUFFile(path)
    config = ModelConfig.from_gguf(reader)
    tensors = _convert_gguf_tensors(reader, config, progress)
    _check_tensors(tensors, config, path)
    has_tokenizer = _write_cache(folder, path, reader, config, tensors)
    return config, tensors, folder if has_tokenizer else None, False


def _read_cache(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path | None]:
    config = ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    tensors = load_file(folder / "model.safetensors")
    _check_tensors(tensors, config, folder)
    return config, tensors, folder if (folder / "tokenizer.json").is_file() else None


def _write_cache(folder: Path, source: Path, reader: GGUFFile, config: ModelConfig, tensors: dict[str, torch.Tensor]) -> bool:
    """Write the cache folder atomically: a temp folder beside it, renamed into place when complete."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
        save_file(tensors, tmp / "model.safetensors", metadata={"source": str(source)})
        has_tokenizer = save_gguf_tokenizer(source, reader, tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir()}
        manifest = {"format": CACHE_FORMAT, "source": str(source), "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        _install(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return has_tokenizer


def _install(tmp: Path, folder: Path) -> None:
    if folder.exists():  # a broken or stale copy: move it aside first so the rename below can land
        trash = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(folder, trash)
        except FileNotFoundError:
            pass
        shutil.rmtree(trash, ignore_errors=True)
    try:
        os.replace(tmp, folder)
    except OSError:
        if not cache_complete(folder):  # else a concurrent conversion of the same file won the race
            raise


def _convert_gguf_tensors(reader: GGUFFile, config: ModelConfig, progress: bool) -> dict[str, torch.Tensor]:
    # llama.cpp's converter interleaves Q/K rows for its rotary layout in the llama architecture only.
    permuted = reader.metadata["general.architecture"] == "llama"
    tensors = {}
    for t in tqdm(reader.tensors, desc="converting GGUF", unit="tensor", disable=not progress):
        if t.name == "rope_freqs.weight":
            continue  # already in config.rope_scaling
        values = dequantize(t.data, t.tensor_type)
        if config.architecture == "gemma3" and t.name.endswith("norm.weight"):
            values = values - np.float32(1.0)  # llama.cpp stores Gemma norms as 1 + w; HF keeps w
        if permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            values = _unpermute_rotary(values, config.num_heads if ".attn_q." in t.name else config.num_kv_heads)
        # F32 tensors come back as read-only views of the file's memory map; own a writable copy.
        tensors[_hf_name(t.name, config.architecture)] = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
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
