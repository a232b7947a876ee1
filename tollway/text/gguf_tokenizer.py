"""A GGUF file's tokenizer, written out as tokenizer files (tokenizer.json and its configs) once.

GGUF keeps a tokenizer as metadata under llama.cpp's keys. transformers' GGUF converter builds
the tokenizer.json for every kind it knows, and is used for all but one: Gemma's
SentencePiece vocabulary, which every Gemma model carries (262144 tokens), is built here with
`tokenizers` alone, to the same file. The converter takes seconds more for it: importing
transformers, and its general merge recovery, which sorts every token's candidate merges.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.processors import TemplateProcessing

from tollway.gguf_file import GGUFFile

_GEMMA = ("gemma", "gemma2", "gemma3")
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def has_gguf_tokenizer(reader: GGUFFile) -> bool:
    return "tokenizer.ggml.tokens" in reader.metadata


def save_gguf_tokenizer(reader: GGUFFile, folder: Path) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json for the tokenizer in a
    GGUF file's metadata (has_gguf_tokenizer) into `folder`. Seconds, for a large vocabulary.
    Returns the tokenizer.json written, as a `tokenizers` object."""
    fields = reader.metadata
    architecture = fields["general.architecture"]
    if architecture in _GEMMA and fields.get("tokenizer.ggml.model") == "llama" \
            and fields.get("tokenizer.ggml.pre") in (None, "default"):
        backend = gemma_sentencepiece(fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.token_type") or ())
    else:
        from transformers.integrations.gguf import convert_gguf_tokenizer
        backend = _within(convert_gguf_tokenizer(architecture, _converter_fields(fields))[0],
                          len(fields["tokenizer.ggml.tokens"]))
    config = _tokenizer_config(fields)
    bos, eos = config["bos_token"], config["eos_token"]
    # The converter leaves BOS/EOS insertion to the transformers class around it; put it in tokenizer.json.
    template = ([bos] if config["add_bos_token"] and bos else []) + ["$A"] + ([eos] if config["add_eos_token"] and eos else [])
    backend.post_processor = TemplateProcessing(
        single=" ".join(template),
        special_tokens=[(t, backend.token_to_id(t)) for t in template if t != "$A"],
    )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    eos_ids = [fields[key] for key in
               ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
               if key in fields]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": list(dict.fromkeys(eos_ids))}))
    return backend


def gemma_sentencepiece(original: list[str], kinds: list[int]) -> Tokenizer:
    """The tokenizer transformers' converter builds for a Gemma GGUF, to the same tokenizer.json,
    from the file's tokens (`original`) and their token types (`kinds`): a byte-fallback BPE
    over the vocabulary with spaces as "▁", its control tokens special, its user-defined ones whole.

    The file has no merges. Gemma's merge order is the order of the tokens in the file (not
    their scores), so each token's merges come at its place, and a token's own splits (every cut
    into two tokens of the vocabulary) longest left part first, the order the converter's sort
    gives them."""
    # A token of two or more spaces is stored with real spaces; the text it matches has "▁".
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in original]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated token keeps its last id, as there
    merges = []
    for piece in sorted(vocab, key=vocab.__getitem__):
        for cut in range(len(piece) - 1, 0, -1):
            left = piece[:cut]
            if left in vocab:
                right = piece[cut:]
                if right in vocab:
                    merges.append((left, right))
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(original, kinds) if kind == _CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(original, kinds) if kind == _USER_DEFINED and t in vocab])
    return backend


def _within(backend: Tokenizer, size: int) -> Tokenizer:
    """`backend` without the added tokens past the file's `size` tokens: transformers' GPT-2 class
    adds its own "<|endoftext|>" where a vocabulary lacks it (Llama 3's does), an id past the
    model's embedding that a prompt's text could then name."""
    if backend.get_vocab_size(with_added_tokens=True) <= size:
        return backend
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    return Tokenizer.from_str(json.dumps(spec))


def _tokenizer_config(fields: dict[str, Any]) -> dict[str, Any]:
    """What tokenizer_config.json holds: the special tokens' texts, BOS/EOS insertion and the chat template."""
    tokens = fields["tokenizer.ggml.tokens"]
    config = {f"{name}_token": tokens[fields[f"tokenizer.ggml.{name}_token_id"]]
              if f"tokenizer.ggml.{name}_token_id" in fields else None for name in ("bos", "eos")}
    # Older SentencePiece files have no flag, and llama.cpp adds BOS to them.
    config["add_bos_token"] = fields.get("tokenizer.ggml.add_bos_token", fields.get("tokenizer.ggml.model") == "llama" or None)
    config["add_eos_token"] = fields.get("tokenizer.ggml.add_eos_token")
    config["chat_template"] = fields.get("tokenizer.chat_template")
    return config


def _converter_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer fields transformers' converter takes, under its names, read with tollway's
    GGUF reader (transformers' own loads torch)."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING

    return {name: fields[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in fields}
