"""A GGUF file's tokenizer, written out as tokenizer files (tokenizer.json and its configs) once.

GGUF keeps a tokenizer as metadata under llama.cpp's keys. transformers' GGUF converter builds
the tokenizer.json for every kind it knows; the two kinds users run most are built here with
`tokenizers` alone, to the same file (tests compare the two): Gemma's SentencePiece vocabulary
(262144 tokens in every Gemma), where the converter's general merge recovery sorts every token's
candidate merges, and byte-level BPE with a pre-tokenizer it knows (Llama 3's, Qwen's). Importing
transformers alone was most of such a model's first start.

A server reads Gemma's natively instead (model/sentencepiece_bpe.py); these files serve the rest, and
the clients that tokenize without a model (tollway bench).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.processors import TemplateProcessing

from tollway.gguf_file import GGUFFile

_GEMMA = ("gemma", "gemma2", "gemma3")
# The byte-level pre-tokenizers byte_level_bpe knows (tokenizer.ggml.pre): the regex each model's
# own tokenizer.json splits text with before its merges.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def has_gguf_tokenizer(reader: GGUFFile) -> bool:
    return "tokenizer.ggml.tokens" in reader.metadata


def is_gemma_sentencepiece(fields: dict[str, Any]) -> bool:
    """Whether a GGUF's metadata holds Gemma's kind of SentencePiece tokenizer (gemma_sentencepiece,
    model/sentencepiece_bpe.py)."""
    return fields.get("general.architecture") in _GEMMA and fields.get("tokenizer.ggml.model") == "llama" \
        and fields.get("tokenizer.ggml.pre") in (None, "default")


def save_gguf_tokenizer(reader: GGUFFile, folder: Path) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json for the tokenizer in a
    GGUF file's metadata (has_gguf_tokenizer) into `folder`. Seconds, for a large vocabulary.
    Returns the tokenizer.json written, as a `tokenizers` object."""
    fields = reader.metadata
    architecture = fields["general.architecture"]
    split = _byte_level_split(fields)
    if is_gemma_sentencepiece(fields):
        backend = gemma_sentencepiece(fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.token_type") or ())
    elif split is not None:
        backend = byte_level_bpe(fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.token_type") or (),
                                 fields["tokenizer.ggml.merges"], split)
    else:
        from transformers.integrations.gguf import convert_gguf_tokenizer
        backend = _within(convert_gguf_tokenizer(architecture, _converter_fields(fields))[0],
                          len(fields["tokenizer.ggml.tokens"]))
    config = tokenizer_config(fields, fields["tokenizer.ggml.tokens"].__getitem__)
    bos, eos = config["bos_token"], config["eos_token"]
    # The converter leaves BOS/EOS insertion to the transformers class around it; put it in tokenizer.json.
    template = ([bos] if config["add_bos_token"] and bos else []) + ["$A"] + ([eos] if config["add_eos_token"] and eos else [])
    backend.post_processor = TemplateProcessing(
        single=" ".join(template),
        special_tokens=[(t, backend.token_to_id(t)) for t in template if t != "$A"],
    )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_ids(fields)}))
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


def byte_level_bpe(tokens: list[str], kinds: list[int], merges: list[str], split: str) -> Tokenizer:
    """The tokenizer transformers' converter builds for a byte-level BPE file (Llama 3's, Qwen's),
    to the same tokenizer.json, from its tokens, their types, its merges and the pre-tokenizer's
    split pattern (_SPLITS): the converter's GPT-2 class without the import of transformers, which
    took most of such a model's first start."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet)
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    backend = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # A control token spelled outside the byte alphabet is a mislabel there: not added (it would
    # take an id past the model's).
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, kinds) if kind == _CONTROL and set(t) <= spelled])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, kinds) if kind == _USER_DEFINED and t in vocab])
    return backend


def _byte_level_split(fields: dict[str, Any]) -> str | None:
    """The split pattern of a byte-level BPE file byte_level_bpe builds; None for another kind, or
    one it leaves to the converter: a pre-tokenizer it does not know, or a vocabulary where
    "<|endoftext|>" is an ordinary token (the converter's class makes it special)."""
    if fields.get("tokenizer.ggml.model") != "gpt2" or "tokenizer.ggml.merges" not in fields:
        return None
    split = _SPLITS.get(fields.get("tokenizer.ggml.pre"))
    if split is None:
        return None
    tokens, kinds = fields["tokenizer.ggml.tokens"], fields.get("tokenizer.ggml.token_type") or ()
    if "<|endoftext|>" in tokens and (not kinds or kinds[tokens.index("<|endoftext|>")] != _CONTROL):
        return None
    return split


@functools.cache
def _byte_alphabet() -> list[str]:
    """Byte b as the character byte-level BPE spells it: the printable Latin-1 bytes as themselves,
    the rest moved past 255 in order (GPT-2's scheme, which every byte-level vocabulary uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(moved)) for b in range(256)]


def _within(backend: Tokenizer, size: int) -> Tokenizer:
    """`backend` without the added tokens past the file's `size` tokens: transformers' GPT-2 class
    adds its own "<|endoftext|>" where a vocabulary lacks it (Llama 3's does), an id past the
    model's embedding that a prompt's text could then name."""
    if backend.get_vocab_size(with_added_tokens=True) <= size:
        return backend
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    return Tokenizer.from_str(json.dumps(spec))


def adds_bos_eos(fields: dict[str, Any]) -> tuple[bool | None, bool | None]:
    """Whether the file's tokenizer adds BOS and EOS (None: the file does not say). Older
    SentencePiece files have no flag, and llama.cpp adds BOS to them."""
    return (fields.get("tokenizer.ggml.add_bos_token", fields.get("tokenizer.ggml.model") == "llama" or None),
            fields.get("tokenizer.ggml.add_eos_token"))


def tokenizer_config(fields: dict[str, Any], token: Callable[[int], str]) -> dict[str, Any]:
    """What tokenizer_config.json holds: the special tokens' texts (`token`: an id's), BOS/EOS
    insertion and the chat template."""
    config = {f"{name}_token": token(fields[f"tokenizer.ggml.{name}_token_id"])
              if f"tokenizer.ggml.{name}_token_id" in fields else None for name in ("bos", "eos")}
    config["add_bos_token"], config["add_eos_token"] = adds_bos_eos(fields)
    config["chat_template"] = fields.get("tokenizer.chat_template")
    return config


def eos_token_ids(fields: dict[str, Any]) -> list[int]:
    """The ids that end a reply: end of sequence, of turn, of message."""
    return list(dict.fromkeys(fields[key] for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                                      "tokenizer.ggml.eom_token_id") if key in fields))


def _converter_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer fields transformers' converter takes, under its names, read with tollway's
    GGUF reader (transformers' own loads torch)."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING

    return {name: fields[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
            if f"tokenizer.{key}" in fields}
