"""A GGUF's tokenizer written out as tokenizer files: Gemma's built by tollway, the rest by transformers' converter."""
from __future__ import annotations

import json

from tollway.text.gguf_tokenizer import _converter_fields, gemma_sentencepiece


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
