"""Chat templates rendered as transformers renders them (its apply_chat_template).

Templates on the Hub are written against transformers' Jinja environment, so anything else
renders some of them differently or not at all. The same environment here: a sandbox whose
objects cannot be changed, blocks trimmed as transformers trims them, `tojson` that keeps
non-ASCII text and takes json.dumps' options, loop controls (`break`, `continue`), the
`{% generation %}` block of training templates (rendered as its body), `raise_exception`,
`strftime_now`, and the same variables (`tools` and `documents` are None when not given).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplate:
    """A chat template, compiled once."""

    def __init__(self, text: str):
        """A jinja2.TemplateSyntaxError for text that does not parse."""
        self.text = text
        self._template = _environment().from_string(text)

    @property
    def renders_tools(self) -> bool:
        """Whether it reads a `tools` variable: shows the model the tools it may call."""
        return "tools" in self.text

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[dict] | None = None,
               variables: dict[str, Any] | None = None) -> str:
        """The prompt text; `variables`: the rest the template reads (bos_token, a request's
        chat_template_kwargs), which cannot replace the messages, tools or add_generation_prompt.
        ValueError for what the template refuses (raise_exception)."""
        try:
            return self._template.render({**(variables or {}), "messages": messages, "tools": tools,
                                          "documents": None, "add_generation_prompt": add_generation_prompt})
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e.message}") from None


def check_syntax(text: str) -> None:
    """Raise jinja2.TemplateSyntaxError where `text` would not compile as a chat template."""
    _environment().parse(text)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks;
    rendering a prompt keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
