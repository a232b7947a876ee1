"""Gemma's tokenizer read natively from the GGUF (sentencepiece_bpe.c) against the `tokenizers` one
built from the same tokens: the same ids, the same text, the same llguidance vocabulary."""
from __future__ import annotations

import random

import gguf
import llguidance
import numpy as np
import pytest
import tokenizers

from tollway.gguf_file import GGUFFile
from tollway.text.gguf_tokenizer import save_gguf_tokenizer
from tollway.model.sentencepiece_bpe import SentencePieceBPE, native_tokenizer
from tollway.text.tokenizer import HFBackend

SPECIALS = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<mask>", "<unused7>", "<table>"]


def _random_text(rng: random.Random, pieces: list[str], alphabet: list[str], extras: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(0, 30)):
        k = rng.random()
        if k < 0.5:
            parts.append(rng.choice(pieces).replace("\u2581", " "))
        elif k < 0.8:
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(rng.choice(extras))
    return "".join(parts)


def _assert_same(native: SentencePieceBPE, hf: tokenizers.Tokenizer, texts: list[str], rng: random.Random) -> None:
    byte_ids = sorted(native.byte_token_ids)
    for text in texts:
        for special in (True, False):
            assert native.encode(text, special) == hf.encode(text, add_special_tokens=special).ids, (text, special)
        ids = hf.encode(text).ids + [rng.randrange(native.size) for _ in range(rng.randint(0, 5))]
        ids += [rng.choice(byte_ids) for _ in range(rng.randint(0, 4))] if byte_ids else []
        if rng.random() < 0.3:  # byte runs cut and broken up: U+FFFDs
            rng.shuffle(ids)
        for skip in (True, False):
            assert native.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)


@pytest.fixture(scope="module")
def default_pair(default_weights):
    """The default model's native tokenizer, and the `tokenizers` one written from the same file."""
    hf = tokenizers.Tokenizer.from_file(str(default_weights.tokenizer_path / "tokenizer.json"))
    return SentencePieceBPE.from_gguf(default_weights.gguf), hf


def test_gemmas_vocabulary_encodes_and_decodes_as_the_tokenizers_library(default_pair):
    native, hf = default_pair
    assert native.vocab_size == hf.get_vocab_size(with_added_tokens=True) == 262144
    rng = random.Random(0)
    pieces = list(hf.get_vocab())
    alphabet = [chr(c) for c in [*range(32, 127), 9, 10, 13, 0xA0, 0x3000, 0x2581, 0xE9, 0x4E2D, 0x1F600,
                                 0x10FFFF, 0xFFFD, 0x200B]]
    extras = [" ", "  ", "\n", "\n\n", "\t", *SPECIALS]
    texts = [_random_text(rng, pieces, alphabet, extras) for _ in range(400)]
    texts += ["", " ", "Hello  world,\tnaïve café 🙂 <start_of_turn>user\n   spaced", "a" * 300,
              "The quick brown fox jumps over the lazy dog. " * 40]
    _assert_same(native, hf, texts, rng)


def test_the_engines_tokenizer_is_the_native_one_and_needs_no_conversion(default_weights, tmp_path, monkeypatch):
    from tollway.model.weights import load_weights

    loaded = load_weights(None, cache_dir=tmp_path)
    tokenizer = loaded.load_tokenizer()
    assert isinstance(tokenizer._backend, SentencePieceBPE)
    assert not [p for p in tmp_path.iterdir() if "tokenizer" in p.name]  # nothing converted, nothing cached
    assert tokenizer.bos_token_id == 2 and tokenizer.eos_token_ids == (1, 106)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tokenizer.encode(prompt, add_special_tokens=False)[:3] == [2, 105, 2364]  # <bos><start_of_turn>user
    monkeypatch.setenv("TOLLWAY_NATIVE", "0")  # the `tokenizers` one then serves, from the converted files
    assert not isinstance(loaded.load_tokenizer()._backend, SentencePieceBPE)


def test_its_llguidance_vocabulary_is_the_one_llguidance_reads_from_tokenizer_json(default_weights, default_pair):
    native, hf = default_pair
    tokenizer = native_tokenizer(default_weights.gguf)
    ours = tokenizer.lltokenizer(native.size)
    theirs = llguidance.LLTokenizer(hf.to_str(), n_vocab=native.size, eos_token=list(tokenizer.eos_token_ids))
    # Every control, user-defined and byte token, and a sample of the rest.
    ids = sorted(native.special_token_ids | native.byte_token_ids | set(range(0, native.size, 97))
                 | set(np.flatnonzero(native._flags).tolist()))
    assert [ours.decode_bytes([i]) for i in ids] == [theirs.decode_bytes([i]) for i in ids]
    assert [ours.is_special_token(i) for i in ids] == [theirs.is_special_token(i) for i in ids]
    text = "hello <start_of_turn> world  \n\n<table>é"
    assert ours.tokenize_str(text) == theirs.tokenize_str(text)


def _write_vocabulary(path, tokens: list[str], kinds: list[int]) -> GGUFFile:
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_bos_token_id(tokens.index("<bos>"))
    writer.add_eos_token_id(tokens.index("<eos>"))
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.mark.parametrize("byte_tokens", [True, False])
def test_a_small_vocabulary_rich_in_merges_repeats_and_spaces_encodes_alike(tmp_path, byte_tokens):
    """Many merges over a few letters (ranks decide), a repeated token (its later id serves), tokens
    of real spaces (respelled as U+2581, one of them repeating a U+2581 token), added tokens with
    and without spaces, and without byte tokens, unknown characters fused into one <unk>."""
    rng = random.Random(1)
    letters = ["a", "b", "c", "\u2581", "\n", "\t"]
    words = sorted({"".join(rng.choice(letters[:4]) for _ in range(rng.randint(2, 5))) for _ in range(300)})
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<tag>",
              *([f"<0x{b:02X}>" for b in range(256)] if byte_tokens else []),
              *letters, *words, "ab", "\u2581\u2581\u2581", "   ", "\n\n", "\t\t", "  x", " \t"]
    kinds = [3, 3, 3, 2, 3, 3, 4, *([6] * 256 if byte_tokens else []), *[1] * (len(letters) + len(words) + 2),
             1, 4, 4, 4, 1]
    reader = _write_vocabulary(tmp_path / "vocab.gguf", tokens, kinds)
    hf = save_gguf_tokenizer(reader, tmp_path)
    native = SentencePieceBPE.from_gguf(reader)
    assert native.vocab_size == hf.get_vocab_size(with_added_tokens=True) < len(tokens)  # repeats count once
    assert native.special_token_ids == {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    texts = [_random_text(rng, words, ["a", "b", "c", " ", "x", "\n", "\t", "é", "中"],
                          ["<tag>", "<start_of_turn>", "  ", "   ", "\n\n\n", "\t\t", "  x"]) for _ in range(500)]
    _assert_same(native, hf, texts, rng)


def test_strings_that_run_past_their_array_are_refused(tmp_path):
    reader = _write_vocabulary(tmp_path / "vocab.gguf", ["<pad>", "<eos>", "<bos>", "<unk>", "a"], [3, 3, 3, 2, 1])
    whole = reader.array_bytes

    def cut(key):  # the native reader checks each string's length against the bytes it is given
        item, n, data = whole(key)
        return (item, n, data[:-1]) if key == "tokenizer.ggml.tokens" else (item, n, data)

    reader.array_bytes = cut
    with pytest.raises(ValueError, match="cut short"):
        SentencePieceBPE.from_gguf(reader)


def test_another_kind_of_vocabulary_is_left_to_the_tokenizers_library(tiny_gguf, tmp_path):
    from tollway.model.weights import load_weights

    assert SentencePieceBPE.from_gguf(GGUFFile(tiny_gguf)) is None  # Llama's SentencePiece file, not Gemma's
    assert isinstance(load_weights(tiny_gguf, cache_dir=tmp_path).load_tokenizer()._backend, HFBackend)


def test_both_backends_refuse_a_lone_surrogate_alike(default_pair):
    native, hf = default_pair
    for backend in (native, HFBackend(hf)):
        with pytest.raises(UnicodeEncodeError):
            backend.encode("a\ud800b", True)
