"""Chat templates (text/chat_template.py) render as transformers' apply_chat_template renders
them: the templates of real model families (tests/data/chat_templates), each given a
conversation with a system prompt, tools, calls, their results and non-ASCII text, compared
character for character with transformers' own renderer."""
from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
import tokenizers
from tokenizers import models
from transformers import PreTrainedTokenizerFast

from tollway.engine_arguments import chat_template as cli_chat_template
from tollway.text.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, in °C",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "A city's name, e.g. Zürich"},
        "days": {"type": "integer", "description": "How many days ahead"}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "description": "UTC or CET"}},
                   "required": ["zone"]}}}
SYSTEM = {"role": "system", "content": "You are terse. Réponds en français si on te parle français."}
ASK = {"role": "user", "content": "Quel temps fait-il à Zürich ? 天气怎么样？"}


def call(name: str, arguments: dict, id: str = "call_1", as_text: bool = False) -> dict:
    """An assistant tool call; arguments as a dict (transformers' convention, and what tollway
    hands a template), or as the JSON text of OpenAI's wire format."""
    return {"id": id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments) if as_text else arguments}}


def tool_turns(as_text: bool = False, ids: tuple[str, str] = ("call_1", "call_2")) -> list[dict]:
    return [
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Zürich", "days": 2}, ids[0],
                                                                 as_text)]},
        {"role": "tool", "tool_call_id": ids[0], "content": "sonnig, 21 °C"},
        {"role": "assistant", "content": "Sonnig, 21 °C."},
        {"role": "user", "content": "And the time in CET?"},
    ]


PLAIN = [SYSTEM, ASK, {"role": "assistant", "content": "Il fait beau."}, {"role": "user", "content": "Merci !"}]
# (template file, messages, tools): each family's own kind of conversation.
CASES = {
    "llama3.2": ("llama3.2.jinja", [SYSTEM, ASK, *tool_turns()], [WEATHER, TIME]),
    "qwen2.5": ("qwen2.5.jinja", [SYSTEM, ASK, *tool_turns()], [WEATHER, TIME]),
    "qwen3": ("qwen3.jinja", [SYSTEM, ASK, {**tool_turns()[0], "reasoning_content": "The user wants weather."},
                              *tool_turns()[1:]], [WEATHER, TIME]),
    "qwen3-no-tools": ("qwen3.jinja", PLAIN, None),
    "hermes3": ("hermes3.jinja", [SYSTEM, ASK, *tool_turns()], [WEATHER, TIME]),
    "mistral": ("mistral.jinja", [SYSTEM, ASK, *tool_turns(ids=("abcDEF123", "xyz987UVW"))], [WEATHER, TIME]),
    "gemma3": ("gemma3.jinja", PLAIN, None),
    "phi4-mini": ("phi4-mini.jinja", [SYSTEM, ASK, *tool_turns()], [WEATHER, TIME]),
    "phi3": ("phi3.jinja", PLAIN, None),
    "deepseek-v3": ("deepseek-v3.jinja", [SYSTEM, ASK, *tool_turns(as_text=True)], None),
    "glm4": ("glm4.jinja", [SYSTEM, ASK, *tool_turns()], [WEATHER, TIME]),
    "smollm3-training": ("smollm3-training.jinja", [SYSTEM, ASK, *tool_turns()], [WEATHER]),
}
SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def transformers_render(text: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """transformers' apply_chat_template, on a tokenizer built here (no download) with the template."""
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(models.BPE()), chat_template=text,
                                        **SPECIAL_TOKENS)
    return tokenizer.apply_chat_template(copy.deepcopy(messages), tools=copy.deepcopy(tools), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_each_family_renders_as_transformers_renders_it(case, add_generation_prompt):
    file, messages, tools = CASES[case]
    text = (TEMPLATES / file).read_text()
    ours = ChatTemplate(text).render(copy.deepcopy(messages), add_generation_prompt, copy.deepcopy(tools),
                                     SPECIAL_TOKENS)
    assert ours == transformers_render(text, messages, tools, add_generation_prompt)
    # The conversation is in it: the templates are not rendering around it.
    assert "Zürich" in ours or "Merci" in ours
    if tools:
        assert "get_weather" in ours


def test_the_features_transformers_adds_to_jinja():
    template = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'tool' %}{% break %}{% endif %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% endfor %}|{{ tools | tojson(ensure_ascii=False, separators=(',', ':'), sort_keys=True) }}"
        "|{{ tools | tojson(ensure_ascii=True) }}|{{ '<b>' | tojson }}|{{ strftime_now('%Y') }}|{{ documents }}")
    out = template.render([{"role": "user", "content": "é"}, {"role": "tool", "content": "never"}], True,
                          [{"b": "ü", "a": 1}])
    year = datetime.now().strftime("%Y")
    assert out == f'é|[{{"a":1,"b":"ü"}}]|[{{"b": "\\u00fc", "a": 1}}]|"<b>"|{year}|None'


def test_raise_exception_is_a_value_error_with_the_templates_words():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="chat template: roles must alternate"):
        template.render([], True)


def test_the_sandbox_holds():
    with pytest.raises(ValueError):  # an immutable sandbox: the template cannot change what it is given
        ChatTemplate("{% set _ = messages.append(1) %}").render([], True)
    with pytest.raises(ValueError):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([], True)


def test_variables_cannot_replace_the_messages():
    out = ChatTemplate("{{ messages[0].content }} {{ extra }}").render(
        [{"role": "user", "content": "hi"}], True, None, {"messages": [{"content": "no"}], "extra": "x"})
    assert out == "hi x"


def test_the_cli_takes_templates_that_use_these_features():
    for file in ("smollm3-training.jinja", "glm4.jinja"):
        text = (TEMPLATES / file).read_text()
        assert cli_chat_template(text) == text
    with pytest.raises(ValueError, match="does not parse"):
        cli_chat_template("{% generation %}{{ x }}")
    with pytest.raises(jinja2.TemplateSyntaxError):
        ChatTemplate("{% for m in messages %}")
