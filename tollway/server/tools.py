"""OpenAI function calling (tools, tool_choice) on any model: a grammar (structured_output.py)
makes the output a call.

- a named function (tool_choice {"type": "function", ...}): the output is its arguments, JSON
  that validates against its parameter schema;
- "required": one call to one of the tools, written {"name":"...","arguments":{...}};
- "auto" (the default when tools are given): the model chooses between text and such a call.
  It can only choose well if it has seen the tools, so auto needs a chat template that renders
  them (Tokenizer.renders_tools); otherwise a 400 says so;
- "none": text, as without tools.

A call comes back as `tool_calls` (streamed as tool-call deltas) with finish_reason
"tool_calls". A template that does not render tools gets them described in a system message,
and the conversation's calls and results (assistant tool_calls, role "tool") written into its
turns as text, so that its roles still alternate as such templates require."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from tollway.server.errors import APIError
from tollway.server.structured_output import json_grammar

MAX_TOOLS = 128  # as OpenAI
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalling:
    """How a chat's output is read as a tool call."""

    function: str | None  # the named function: the output is its arguments alone
    optional: bool  # auto: the output may be text instead of a call


def tool_calling(req, renders_tools: bool) -> tuple[ToolCalling | None, str | None]:
    """A chat request's tool calling and the grammar its output follows; (None, None) without
    tools or with tool_choice "none". A 400 naming tools or tool_choice for what cannot be done."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None, None
    functions = tool_functions(req.tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None, None
    if req.response_format and req.response_format.get("type") != "text":
        raise APIError(400, "response_format cannot be combined with tool calls: set tool_choice to \"none\" or "
                            "drop response_format", param="response_format")
    strict = all(f.get("strict") for f in functions.values())
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in functions:
            raise APIError(400, f"tool_choice names a function that is not among the tools: {str(name)[:64]!r}",
                           param="tool_choice")
        function = functions[name]
        return ToolCalling(name, False), json_grammar(function.get("parameters", _NO_PARAMETERS),
                                                      bool(function.get("strict")), "tools")
    if choice == "required":
        return ToolCalling(None, False), json_grammar(call_schema(functions), strict, "tools")
    if choice != "auto":
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    if not renders_tools:
        raise APIError(400, "tool_choice \"auto\" needs a chat template that shows the model its tools, and this "
                            "model's does not: use \"required\" or name a function, or serve a template that renders "
                            "tools (--chat-template)", param="tool_choice")
    schema = {**call_schema(functions), "x-guidance": {"whitespace_flexible": False, "lenient": not strict}}
    grammar = LLMatcher.grammar_from_lark(f"start: call | text\ncall: %json {json.dumps(schema)}\ntext: /[^{{](?s:.)*/\n")
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"the tools' schemas cannot be enforced: {error}", param="tools")
    return ToolCalling(None, True), grammar


def tool_functions(tools: list[Any]) -> dict[str, dict]:
    """The tools' function definitions by name; a 400 naming tools for a malformed one."""
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with a "
                                "name of 1 to 64 letters, digits, _ or -", param="tools")
        if name in functions:
            raise APIError(400, f"tools[{i}]: the function {name!r} is defined twice", param="tools")
        if not isinstance(function.get("parameters", _NO_PARAMETERS), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
        functions[name] = function
    return functions


def call_schema(functions: dict[str, dict]) -> dict:
    """A call to any of `functions`: {"name": its name, "arguments": its parameters}."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": name},
                                                         "arguments": f.get("parameters", _NO_PARAMETERS)},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for name, f in functions.items()]}


def conversation(messages: list[dict], tools: list[dict] | None, renders_tools: bool) -> list[dict]:
    """The messages as the chat template is given them: unchanged for a template that renders
    tools; else with the tools described up front and calls and results written as text."""
    if renders_tools or not (tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)):
        return messages
    out: list[dict] = []
    if tools:
        described = "You can call these functions. To call one, answer with JSON: " \
                    '{"name": <function name>, "arguments": <its arguments>}.\n' + json.dumps(tools)
        out.append({"role": "system", "content": described})
    for m in messages:
        role, text = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")})
                     for c in m["tool_calls"]]
            text = "\n".join(filter(None, [text, *calls]))
        elif role == "tool":
            role, text = "user", f"Result of the call {m.get('tool_call_id', '')}: {text}"
        if role == "system" and out and out[0]["role"] == "system":  # one system message, the tools' after it
            out[0] = {"role": "system", "content": f"{text}\n\n{out[0]['content']}"}
        elif out and out[-1]["role"] == role:  # results given back together make one turn
            out[-1] = {"role": role, "content": f"{out[-1]['content']}\n\n{text}"}
        else:
            out.append({"role": role, "content": text})
    return out


class ToolCallReader:
    """One choice's output as it streams, read as text or as a call: the call's name, then its
    arguments piece by piece. A call wrapped as {"name":..,"arguments":..} holds back its last
    character, the wrapper's closing brace, until the output ends."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self.id = f"call_{secrets.token_hex(12)}"
        self.name = calling.function
        self.mode = "call" if calling.function else None  # "call" or "text" once known
        self.started = False  # the call's first delta (id, name) is out
        self.arguments = ""  # handed out so far
        self.content = ""  # the same, for text
        self._buffer = ""

    def push(self, text: str, finished: bool, complete: bool) -> dict:
        """What `text` adds, as a chat delta's fields; `complete`: the output ended by its
        grammar's completing (not cut by max_tokens)."""
        self._buffer += text
        if self.mode is None:
            head = _CALL_HEAD.match(self._buffer)
            if head:
                self.mode, self.name, self._buffer = "call", head.group(1), self._buffer[head.end():]
            elif finished or not _could_become_head(self._buffer):
                self.mode = "text"
            else:
                return {}
        if self.mode == "text":
            delta, self._buffer = {"content": self._buffer} if self._buffer else {}, ""
            self.content += delta.get("content", "")
            return delta
        if self.calling.function or (finished and not complete):
            pieces, self._buffer = self._buffer, ""
        elif finished:
            pieces, self._buffer = self._buffer[:-1], ""  # the wrapper's "}"
        else:
            pieces, self._buffer = self._buffer[:-1], self._buffer[-1:]
        self.arguments += pieces
        if not self.started:
            self.started = True
            return {"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                    "function": {"name": self.name, "arguments": pieces}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": pieces}}]} if pieces else {}

    @property
    def called(self) -> bool:
        return self.mode == "call"

    def message(self) -> dict:
        """The whole output as a chat message (after every push, the last one finished)."""
        if not self.called:
            return {"role": "assistant", "content": self.content}
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}]}


def _could_become_head(text: str) -> bool:
    """Whether more output could still make `text` a call's head."""
    if '{"name":"'.startswith(text) or re.fullmatch(r'\{"name":"[A-Za-z0-9_-]{0,64}', text):
        return True
    name = re.fullmatch(r'\{"name":"[A-Za-z0-9_-]{1,64}(.*)', text, re.S)
    return name is not None and '","arguments":'.startswith(name.group(1))


def finish_reason(reader: ToolCallReader | None, reason: str | None) -> str | None:
    """A chat choice's finish_reason: "tool_calls" for a call that ended as its grammar completed."""
    return "tool_calls" if reader is not None and reader.called and reason == "stop" else reason
