"""OpenAI function calling (tools, tool_choice): calls read from the model's own syntax, or made
by a grammar (structured_output.py) on any model.

- a named function (tool_choice {"type": "function", ...}): the output is its arguments, JSON
  that validates against its parameter schema;
- "required": one call to one of the tools, written {"name":"...","arguments":{...}}. One only:
  a grammar that allowed more would leave a small model free to call on and on, where nothing
  but max_tokens stops it;
- "auto" (the default when tools are given): the model chooses between text and calls. It can
  only choose well if it has seen the tools, so auto needs a chat template that renders them
  (Tokenizer.renders_tools); otherwise a 400 says so. Where the template teaches a call syntax
  that tool_parsers.py reads (or --tool-call-parser names one), the model writes its calls so,
  unconstrained, and they are read from its text, several if it makes several (the first only
  under parallel_tool_calls false); otherwise a grammar lets it write text or a call in the
  format of "required";
- "none": text, as without tools.

Calls come back as `tool_calls` (streamed as tool-call deltas), text around them as content, with
finish_reason "tool_calls". A template that does not render tools gets them described in a system
message, and the conversation's calls and results (assistant tool_calls, role "tool") written into
its turns as text, so that its roles still alternate as such templates require."""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from tollway.server.errors import APIError
from tollway.server.structured_output import json_grammar
from tollway.server.tool_parsers import CONSTRAINED, PARSERS, ArgumentsParser, JsonCallsParser

MAX_TOOLS = 128  # as OpenAI
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCalling:
    """How a chat's output is read as tool calls."""

    function: str | None  # the named function: the output is its arguments alone
    syntax: str = CONSTRAINED  # a tool_parsers.PARSERS name, or CONSTRAINED (a grammar wrote the calls)
    parallel: bool = True  # several calls in one reply (parallel_tool_calls); else the first only


def tool_calling(req, renders_tools: bool, syntax: str = CONSTRAINED) -> tuple[ToolCalling | None, str | None]:
    """A chat request's tool calling and the grammar its output follows; (None, None) without
    tools or with tool_choice "none". `syntax`: the model's own call syntax, which "auto" reads
    unconstrained (CONSTRAINED: none). A 400 naming tools or tool_choice for what cannot be done."""
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
        return ToolCalling(name), json_grammar(function.get("parameters", _NO_PARAMETERS),
                                               bool(function.get("strict")), "tools")
    if choice == "required":
        return ToolCalling(None), json_grammar(call_schema(functions), strict, "tools")
    if choice != "auto":
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    if not renders_tools:
        raise APIError(400, "tool_choice \"auto\" needs a chat template that shows the model its tools, and this "
                            "model's does not: use \"required\" or name a function, or serve a template that renders "
                            "tools (--chat-template)", param="tool_choice")
    if syntax != CONSTRAINED:
        return ToolCalling(None, syntax, parallel=req.parallel_tool_calls is not False), None
    schema = {**call_schema(functions), "x-guidance": {"whitespace_flexible": False, "lenient": not strict}}
    grammar = LLMatcher.grammar_from_lark(f"start: call | text\ncall: %json {json.dumps(schema)}\ntext: /[^{{](?s:.)*/\n")
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"the tools' schemas cannot be enforced: {error}", param="tools")
    return ToolCalling(None), grammar


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
    """The messages as the chat template is given them. For a template that renders tools, as
    they are, but with the calls' arguments as objects: templates write them with tojson, as
    transformers documents (and vLLM passes them). For one that does not, with the tools
    described up front and calls and results written as text."""
    if renders_tools:
        return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    if not (tools or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)):
        return messages
    out: list[dict] = []
    if tools:
        described = "You can call these functions. To call one, answer with JSON: " \
                    '{"name": <function name>, "arguments": <its arguments>}.\n' + json.dumps(tools)
        out.append({"role": "system", "content": described})
    for m in messages:
        role, text = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c)}) for c in m["tool_calls"]]
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


def _arguments(call: dict) -> Any:
    """A call's arguments as sent (JSON text) made an object; text that is not JSON as it is."""
    arguments = call["function"].get("arguments") or "{}"
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


class ToolCallReader:
    """One choice's output as it streams, read as content and tool calls by the parser of its
    ToolCalling: `push` gives what each piece of text adds, as a chat delta's fields."""

    def __init__(self, calling: ToolCalling):
        self.calling = calling
        self._parser = ArgumentsParser(calling.function) if calling.function else \
            PARSERS.get(calling.syntax, _CONSTRAINED_CALLS)
        self._text = ""
        self.content = ""  # handed out so far
        self.calls: list[dict] = []  # handed out so far, as a message's tool_calls

    def push(self, text: str, finished: bool) -> dict:
        """What `text` adds, as a chat delta's fields; `finished`: the output has ended."""
        self._text += text
        parsed = self._parser.parse(self._text, finished)
        delta: dict[str, Any] = {}
        if len(parsed.content) > len(self.content):
            delta["content"], self.content = parsed.content[len(self.content):], parsed.content
        calls = []
        for index, call in enumerate(parsed.calls if self.calling.parallel else parsed.calls[:1]):
            if index == len(self.calls):
                head = {"id": f"call_{secrets.token_hex(12)}", "type": "function"}
                self.calls.append({**head, "function": {"name": call.name, "arguments": call.arguments}})
                calls.append({"index": index, **head, "function": {"name": call.name, "arguments": call.arguments}})
                continue
            function = self.calls[index]["function"]
            if len(call.arguments) > len(function["arguments"]):
                calls.append({"index": index, "function": {"arguments": call.arguments[len(function["arguments"]):]}})
                function["arguments"] = call.arguments
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def message(self) -> dict:
        """The whole output as a chat message (after every push, the last one finished)."""
        if not self.called:
            return {"role": "assistant", "content": self.content}
        return {"role": "assistant", "content": self.content or None, "tool_calls": self.calls}


_CONSTRAINED_CALLS = JsonCallsParser()  # the grammar's calls are JSON objects, one per line


def finish_reason(reader: ToolCallReader | None, reason: str | None) -> str | None:
    """A chat choice's finish_reason: "tool_calls" for calls that ended as the output did (not cut
    by max_tokens)."""
    return "tool_calls" if reader is not None and reader.called and reason == "stop" else reason
