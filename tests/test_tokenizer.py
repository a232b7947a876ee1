"""Tokenizer: encoding parity with transformers, chat templates, streaming detokenization."""
from __future__ import annotations

import json
import random
import shutil

import pytest

from tollway.text.tokenizer import IncrementalDetokenizer, Tokenizer
from tollway.model.weights import load_weights

# Expected ids from transformers 5.24: AutoTokenizer.from_pretrained(<dir>, gguf_file=<the default
# .gguf>)(text).input_ids, computed once and pasted here (that conversion takes ~40 s).
TRANSFORMERS_IDS = [
    ("Hello, world!", [2, 9259, 236764, 1902, 236888]),
    ("  two leading spaces", [2, 138, 13498, 5830, 9952]),
    ("trailing spaces   ", [2, 136697, 9952, 139]),
    ("line one\nline two\n\n\tindented", [2, 1257, 886, 107, 1257, 1156, 108, 255968, 724, 16764]),
    ("Ünïcödé façade naïve — “quotes”", [2, 238194, 236749, 238527, 236755, 55515, 236859, 96008, 120362, 2192, 999, 52231, 236919]),
    ("emoji 😀👍🏽🦩 family 👨\u200d👩\u200d👧", [2, 67906, 163543, 240493, 242713, 478, 397, 404, 407, 2523, 236743, 243874, 237243, 243767, 237243, 244814]),
    ("日本語のテキスト、中文文本，한국어", [2, 94951, 236945, 95830, 236951, 55041, 57489, 236900, 114216, 237430]),
    ("def square(x):\n    return x ** 2  # comment\n", [2, 2063, 6281, 236769, 236781, 1473, 107, 140, 2060, 1123, 5213, 236743, 236778, 138, 236865, 5739, 107]),
    ("𓀀 ꙮ 𠜎", [2, 478, 385, 366, 366, 236743, 472, 391, 412, 236743, 478, 398, 394, 380]),
    ("<start_of_turn>user\nhi<end_of_turn>\n", [2, 105, 2364, 107, 2202, 106, 107]),
    ("3.14159 and 1234567890", [2, 236800, 236761, 236770, 236812, 236770, 236810, 236819, 532, 236743, 236770, 236778, 236800, 236812, 236810, 236825, 236832, 236828, 236819, 236771]),
]

# Characters Gemma's vocabulary lacks, so they are spelled with byte-fallback tokens.
BYTE_FALLBACK_TEXTS = ["𓀀𓀁 ꙮ 𠜎𠜱 𝔘𝔫𝔦 end", "a 🦩 flamingo", "🦩🦩"]
STREAM_TEXTS = BYTE_FALLBACK_TEXTS + [
    "emoji 😀👍🏽 family 👨\u200d👩\u200d👧", "日本語のテキスト、中文文本，한국어", "  spaced\n\n\tout  ", "naïve façade",
]


@pytest.mark.parametrize("text, expected", TRANSFORMERS_IDS)
def test_encode_matches_transformers(default_tokenizer, text, expected):
    assert default_tokenizer.encode(text) == expected
    assert default_tokenizer.encode(text, add_special_tokens=False) == expected[1:]
    assert default_tokenizer.decode(expected) == text.replace("<start_of_turn>", "").replace("<end_of_turn>", "")
    assert default_tokenizer.decode(expected, skip_special_tokens=False) == "<bos>" + text


def test_special_tokens(default_tokenizer):
    assert default_tokenizer.bos_token_id == 2
    assert default_tokenizer.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>
    assert default_tokenizer.vocab_size == 262144


def test_gemma_chat_template(default_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  Hi there \n"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
    ]
    prompt = default_tokenizer.apply_chat_template(messages)
    assert prompt == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert default_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == prompt.removesuffix(
        "<start_of_turn>model\n")
    ids = default_tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[:3] == [2, 105, 2364] and ids.count(105) == 4 and ids.count(106) == 3 and ids.count(2) == 1


@pytest.mark.parametrize("messages", [
    [],
    [{"role": "system", "content": "only a system message"}],
    [{"role": "assistant", "content": "starts with the model"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
])
def test_gemma_chat_template_rejects_bad_conversations(default_tokenizer, messages):
    with pytest.raises(ValueError):
        default_tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_incremental_detokenizer_equals_full_decode(default_tokenizer, text):
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer)
    deltas = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(deltas) == default_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_byte_fallback_texts_are_spelled_with_byte_tokens(default_tokenizer):
    for text in BYTE_FALLBACK_TEXTS:
        ids = default_tokenizer.encode(text, add_special_tokens=False)
        assert any(i in default_tokenizer._byte_token_ids for i in ids), text


def test_incremental_detokenizer_streams_before_the_end(default_tokenizer):
    ids = default_tokenizer.encode("a 🦩 flamingo and more words", add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer)
    deltas = [detok.push(i) for i in ids]
    assert deltas[0] == "a" and "🦩" in "".join(deltas[:-1])


def test_incremental_detokenizer_with_prompt(default_tokenizer):
    prompt = default_tokenizer.encode("Say hi:")
    ids = default_tokenizer.encode(" hi 🦩<end_of_turn>", add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer, prompt)
    assert "".join([detok.push(i) for i in ids] + [detok.flush()]) == " hi 🦩"


def test_incremental_detokenizer_random_ids(default_tokenizer):
    """Arbitrary ids, invalid byte runs and special tokens included: joined deltas still equal decode()."""
    rng = random.Random(0)
    byte_ids = sorted(default_tokenizer._byte_token_ids)
    special_ids = sorted(default_tokenizer._special_token_ids)
    for _ in range(200):
        ids = []
        for _ in range(rng.randrange(1, 24)):
            r = rng.random()
            pool = byte_ids if r < 0.4 else special_ids if r < 0.55 else range(default_tokenizer.vocab_size)
            ids.append(rng.choice(pool))
        for skip in (True, False):
            detok = IncrementalDetokenizer(default_tokenizer, skip_special_tokens=skip)
            deltas = [detok.push(i) for i in ids] + [detok.flush()]
            assert "".join(deltas) == default_tokenizer.decode(ids, skip_special_tokens=skip), ids


# --- a Llama-style SentencePiece tokenizer, from the tiny GGUF ---------------------------------

@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tiny_gguf, tmp_path_factory):
    return load_weights(tiny_gguf, cache_dir=tmp_path_factory.mktemp("cache")).tokenizer_path


def test_tiny_gguf_tokenizer(tiny_tokenizer_dir):
    tok = Tokenizer.load(tiny_tokenizer_dir)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,) and tok.vocab_size == 320
    ids = tok.encode("hello world")
    assert ids == [1, 315, 319]  # <s> ▁hello ▁world
    assert tok.decode(tok.encode("hello  world é😀")) == "hello  world é😀"
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_detokenizer_keeps_the_leading_space_a_strip_decoder_drops(tiny_tokenizer_dir):
    # This decoder strips the first token's leading space, as Llama 2's does: decode([▁world]) == "world".
    tok = Tokenizer.load(tiny_tokenizer_dir)
    prompt, output = tok.encode("hello"), tok.encode(" world é😀", add_special_tokens=False)
    assert tok.decode(output) == "world é😀"
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(i) for i in output] + [detok.flush()]
    assert "".join(deltas) == " world é😀" and not any("\ufffd" in d for d in deltas)
    without_prompt = IncrementalDetokenizer(tok)
    assert "".join([without_prompt.push(i) for i in output] + [without_prompt.flush()]) == tok.decode(output)


def test_chat_template_from_tokenizer_config(tiny_tokenizer_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(folder)
    messages = [{"role": "user", "content": "<b>é</b>"}]
    assert tok.apply_chat_template(messages) == '<s>[user] "<b>é</b>"\n[assistant]'
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == '<s>[user] "<b>é</b>"\n'
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])

    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")  # takes precedence, as in transformers
    assert Tokenizer.load(folder).apply_chat_template(messages) == "<b>é</b>!"


def test_load_requires_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
