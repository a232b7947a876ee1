"""Tool calls in the model families' own syntax (server/tool_parsers.py), read by ToolCallReader
from replies as such models write them: whole, and streamed a character at a time, where the
deltas must add up to the same message and no part of a call marker may leak out as content."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tollway.server.tool_parsers import native_syntax
from tollway.server.tools import ToolCallReader, ToolCalling, finish_reason

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = ("get_weather", {"city": "Zürich", "days": 2})
TIME = ("get_time", {"zone": "CET"})


def streamed(syntax: str, output: str, parallel: bool = True) -> tuple[dict, list[dict]]:
    """The message that the stream's deltas add up to (as the openai client accumulates them), and
    the deltas."""
    reader = ToolCallReader(ToolCalling(None, syntax, parallel))
    deltas = [d for i, ch in enumerate(output) if (d := reader.push(ch, i == len(output) - 1))]
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] not in calls:
                assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                assert "id" not in tc and "name" not in tc["function"]
            calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "calls": [calls[i] for i in sorted(calls)]}, deltas


def whole(syntax: str, output: str, parallel: bool = True) -> dict:
    reader = ToolCallReader(ToolCalling(None, syntax, parallel))
    reader.push(output, True)
    return reader.message()


def read(syntax: str, output: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, dict]]]:
    """The reply's content and calls (arguments parsed), checked to be the same streamed and whole."""
    message = whole(syntax, output, parallel)
    stream, _ = streamed(syntax, output, parallel)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    assert stream["calls"] == [{"name": n, "arguments": a} for n, a in calls]
    assert stream["content"] == (message["content"] or "")
    return message["content"], [(n, json.loads(a)) for n, a in calls]


HERMES_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


@pytest.mark.parametrize("syntax, output, content, calls", [
    # Hermes / Qwen: blocks anywhere, text before them stays content
    ("hermes", HERMES_TWO, None, [WEATHER, TIME]),
    ("hermes", "Let me look that up.\n\n" + HERMES_TWO, "Let me look that up.", [WEATHER, TIME]),
    ("hermes", '<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}</tool_call>', None, [TIME]),
    ("hermes", "It is sunny. 1 < 2 and <b>bold</b>.", "It is sunny. 1 < 2 and <b>bold</b>.", []),
    ("hermes", "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    # Llama 3: the reply is the calls, after <|python_tag|> or not, ";" between them
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}', None, [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", "days": 2}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [WEATHER, TIME]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "The weather is {sunny}.", "The weather is {sunny}.", []),
    # Mistral: a list after [TOOL_CALLS], or name[ARGS]{...} per call
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [WEATHER, TIME]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": 2}'
                '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "Checking.", [WEATHER, TIME]),
    ("mistral", 'Sure [TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}', "Sure", [TIME]),
    ("mistral", "[TOOL_ CALLS are written so]", "[TOOL_ CALLS are written so]", []),
    # tollway's grammar-made calls: JSON objects, one per line
    ("constrained", '{"name":"get_weather","arguments":{"city":"Zürich","days":2}}\n'
                    '{"name":"get_time","arguments":{"zone":"CET"}}', None, [WEATHER, TIME]),
])
def test_each_syntax_read_whole_and_streamed(syntax, output, content, calls):
    assert read(syntax, output) == (content, [(n, a) for n, a in calls])


def test_arguments_stream_as_the_model_writes_them():
    _, deltas = streamed("hermes", HERMES_TWO)
    pieces = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if tc["index"] == 0]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Zürich", "days": 2}'  # the text itself, piece by piece
    # the second call's name is out as its arguments begin
    first_of_second = next(tc for d in deltas for tc in d.get("tool_calls", []) if tc["index"] == 1)
    assert first_of_second["function"] == {"name": "get_time", "arguments": "{"}


@pytest.mark.parametrize("syntax, output", [
    ("hermes", "Sure.\n" + HERMES_TWO),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}]'),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}'),
])
def test_no_part_of_a_marker_is_content(syntax, output):
    _, deltas = streamed(syntax, output)
    content = "".join(d.get("content", "") for d in deltas)
    assert content in ("", "Sure.") and "<" not in content and "[" not in content


def test_parallel_tool_calls_false_keeps_the_first_call():
    assert read("hermes", HERMES_TWO, parallel=False) == (None, [WEATHER])


def test_a_call_cut_short_is_a_call_with_the_arguments_it_got_to():
    reader = ToolCallReader(ToolCalling(None, "hermes"))
    reader.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zü', True)
    assert reader.message()["tool_calls"][0]["function"]["arguments"] == '{"city": "Zü'
    assert finish_reason(reader, "length") == "length" and finish_reason(reader, "stop") == "tool_calls"
    reader = ToolCallReader(ToolCalling(None, "hermes"))
    reader.push("<tool_call>\n{\"na", True)  # cut in the head: nothing to call, the text as it came
    assert reader.message() == {"role": "assistant", "content": "<tool_call>\n{\"na"}


@pytest.mark.parametrize("file, syntax", [
    ("qwen2.5.jinja", "hermes"), ("qwen3.jinja", "hermes"), ("hermes3.jinja", "hermes"),
    ("smollm3-training.jinja", "hermes"), ("llama3.2.jinja", "llama3_json"), ("mistral.jinja", "mistral"),
    ("gemma3.jinja", None), ("phi3.jinja", None), ("deepseek-v3.jinja", None), ("glm4.jinja", None),
])
def test_the_syntax_is_the_one_the_template_teaches(file, syntax):
    assert native_syntax((TEMPLATES / file).read_text()) == syntax


def test_a_marker_that_is_a_special_token_stays_in_the_text():
    import tokenizers
    from tokenizers import models, pre_tokenizers

    from tollway.text.tokenizer import IncrementalDetokenizer, Tokenizer

    backend = tokenizers.Tokenizer(models.WordLevel({"sure": 0, "{}": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["[TOOL_CALLS]", "</s>"])
    tokenizer = Tokenizer(backend, eos_token="</s>")
    ids = tokenizer.encode("sure [TOOL_CALLS] {} </s>", add_special_tokens=False)
    assert tokenizer.decode(ids) == "sure {}"  # special tokens are skipped...
    tokenizer.keep_special_tokens(["[TOOL_CALLS]", "[ARGS]"])  # ...except the syntax's markers ([ARGS]: not in it)
    assert tokenizer.decode(ids) == "sure [TOOL_CALLS] {}"
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert "".join(detokenizer.push(i) for i in ids) + detokenizer.flush() == "sure [TOOL_CALLS] {}"
