"""A GGUF's tokenizer written out as tokenizer files: Gemma's built by tollway, the rest by transformers' converter."""
from __future__ import annotations

import json

import gguf
import pytest

from tollway.gguf_file import GGUFFile
from tollway.text.gguf_tokenizer import (_byte_level_split, _converter_fields, _within, byte_level_bpe,
                                         gemma_sentencepiece, save_gguf_tokenizer)
from tollway.text.tokenizer import Tokenizer


def test_gemmas_vocabulary_builds_the_tokenizer_transformers_converter_builds(default_weights):
    from transformers.integrations.gguf import convert_gguf_tokenizer

    fields = default_weights.gguf.metadata
    ours = gemma_sentencepiece(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"])
    theirs = convert_gguf_tokenizer(fields["general.architecture"], _converter_fields(fields))[0]
    # All but the post-processor, which save_gguf_tokenizer sets for both from the file's BOS/EOS flags.
    ours_json, theirs_json = json.loads(ours.to_str()), json.loads(theirs.to_str())
    del ours_json["post_processor"], theirs_json["post_processor"]
    assert ours_json == theirs_json
    text = "Hello  world,\tnaïve café 🙂 <start_of_turn>user\n   spaced"
    assert ours.encode(text).ids == theirs.encode(text).ids


def test_a_token_of_spaces_is_respelled_and_merges_follow_the_files_order():
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "  ", "\u2581", "abab", "ba"]
    kinds = [3, 3, 3, 2, 1, 1, 1, 4, 1, 1, 1]
    model = json.loads(gemma_sentencepiece(tokens, kinds).to_str())["model"]
    assert "\u2581\u2581" in model["vocab"] and "  " not in model["vocab"]
    # Each token's merges at its place in the file, its longest left part first.
    assert model["merges"] == [["a", "b"], ["\u2581", "\u2581"], ["ab", "ab"], ["b", "a"]]


def _byte_level_file(path, pre: str, extra: list[str] = (), extra_kinds: list[int] = ()) -> GGUFFile:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = list(bytes_to_unicode().values())
    tokens = [*alphabet, "\u0120t", "he", "\u0120the", *extra, "<|begin_of_text|>", "<|eot_id|>"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(alphabet) + 3) + list(extra_kinds) + [3, 3])
    writer.add_token_merges(["\u0120 t", "h e", "\u0120t he"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return GGUFFile(path)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_a_byte_level_vocabulary_builds_the_tokenizer_transformers_converter_builds(tmp_path, pre):
    from transformers.integrations.gguf import convert_gguf_tokenizer

    # A user-defined tag, a control token and a token spelled outside the byte alphabet ("é").
    fields = _byte_level_file(tmp_path / "bpe.gguf", pre, ["<think>", "<|im_start|>", "\u00e9t\u00e9"], [4, 3, 1]).metadata
    ours = byte_level_bpe(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"],
                          fields["tokenizer.ggml.merges"], _byte_level_split(fields))
    theirs = _within(convert_gguf_tokenizer(fields["general.architecture"], _converter_fields(fields))[0],
                     len(fields["tokenizer.ggml.tokens"]))
    # All but the post-processor, which save_gguf_tokenizer sets for both from the file's BOS/EOS flags.
    ours_json, theirs_json = json.loads(ours.to_str()), json.loads(theirs.to_str())
    del ours_json["post_processor"], theirs_json["post_processor"]
    assert ours_json == theirs_json
    text = "the  <think>été 123456\n\n<|im_start|>x"
    assert ours.encode(text).ids == theirs.encode(text).ids


def test_a_byte_level_vocabulary_gets_no_token_past_the_files(tmp_path):
    # transformers' GPT-2 class adds its own "<|endoftext|>" when the vocabulary lacks it (Llama 3's
    # does): one id past the model's embedding, which a prompt's text could then name.
    reader = _byte_level_file(tmp_path / "bpe.gguf", "llama-bpe")
    tokens = reader.metadata["tokenizer.ggml.tokens"]
    save_gguf_tokenizer(reader, tmp_path)
    tokenizer = Tokenizer.load(tmp_path)
    assert tokenizer.vocab_size == len(tokens)
    ids = tokenizer.encode("the <|endoftext|> the<|eot_id|>")
    assert max(ids) < len(tokens) and ids[0] == len(tokens) - 2 and ids[-1] == len(tokens) - 1
    assert tokenizer.decode(ids) == "the <|endoftext|> the"
