"""Tool calls in a model's own syntax, read from its output text as it grows.

A tool-trained model writes its calls the way its chat template taught it:
- hermes (Hermes, Qwen 2.5 and 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call;
- llama3_json (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`, possibly
  after `<|python_tag|>`, several separated by `;`. tollway's own format for a grammar-made call
  ({"name": ..., "arguments": ...}, one per line) is read the same way;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or in newer models
  `[TOOL_CALLS]name[ARGS]{...}` per call.

Where a marker is a special token of the model's vocabulary (Mistral's [TOOL_CALLS], Hermes 3's
<tool_call>), the server has the tokenizer keep it in the text (Tokenizer.keep_special_tokens).

A parser reads the whole text so far (`parse(text, final)`) and says what is settled: the content
(text outside calls; the end of it that may still become a call marker, and trailing whitespace,
held back until it cannot) and each call as far as it has come. What it reports only grows as the
text grows, so a stream can send the difference. A call's arguments are its JSON text as the model
wrote it: the pieces streamed add up to exactly the final arguments.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
_NAME_CHARS = r"[A-Za-z0-9_.\-]"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text; while the call is incomplete, as far as it has come
    complete: bool = False


@dataclass
class Parsed:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class _Pending(Exception):
    """What follows may still be a call: nothing after this point is settled."""


def _prefix_pattern(atoms: list[tuple[str, str]]) -> re.Pattern:
    """A pattern that fully matches every prefix of the sequence of `atoms`, each (its pattern,
    the pattern of its prefixes)."""
    pattern = ""
    for full, partial in reversed(atoms):
        pattern = f"(?:{full}{pattern}|{partial})"
    return re.compile(pattern, re.S)


def _literal(text: str) -> tuple[str, str]:
    partial = ""
    for ch in reversed(text):
        partial = f"(?:{re.escape(ch)}{partial})?"
    return re.escape(text), partial


def _either(*literals: str) -> tuple[str, str]:
    return "(?:" + "|".join(_literal(t)[0] for t in literals) + ")", \
        "(?:" + "|".join(_literal(t)[1] for t in literals) + ")"


_WS = (r"\s*", r"\s*")
_HEAD_ATOMS = [_literal("{"), _WS, _literal('"name"'), _WS, _literal(":"), _WS, _literal('"'),
               (f"{_NAME_CHARS}+", f"{_NAME_CHARS}*"), _literal('"'), _WS, _literal(","), _WS,
               _either('"arguments"', '"parameters"'), _WS, _literal(":"), _WS]
# A call object's head, up to where its arguments begin; and any text that may still become one.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"(' + _NAME_CHARS + r'+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_HEAD_PREFIX = _prefix_pattern(_HEAD_ATOMS)


def _call_object(text: str, pos: int, final: bool) -> tuple[ParsedCall, int | None] | None:
    """The call object at `pos` in `text` and the index after it (None while it is incomplete);
    None when there is none there. _Pending while it may still become one."""
    head = _HEAD.match(text, pos)
    if head:
        start = head.end()
        if text[start:start + 1] != "{":  # arguments that are not an object: read once whole
            return _whole_call(text, pos, final)
        try:
            _, end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            return ParsedCall(head.group(1), text[start:]), None
        arguments = text[start:end]
        close = _skip_space(text, end)
        if close < len(text) and text[close] == "}":
            return ParsedCall(head.group(1), arguments, complete=True), close + 1
        try:  # more keys after the arguments (an id)
            _, end = _DECODER.raw_decode(text, pos)
            return ParsedCall(head.group(1), arguments, complete=True), end
        except json.JSONDecodeError:
            return ParsedCall(head.group(1), arguments), None
    if not final and _HEAD_PREFIX.fullmatch(text, pos):
        raise _Pending
    return _whole_call(text, pos, final)


def _whole_call(text: str, pos: int, final: bool) -> tuple[ParsedCall, int] | None:
    """A call object whose keys come in another order or whose arguments are not an object."""
    if not text.startswith("{", pos):
        return None
    try:
        value, end = _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        if final:
            return None
        raise _Pending from None
    name = value.get("name") if isinstance(value, dict) else None
    arguments = value.get("arguments", value.get("parameters")) if isinstance(value, dict) else None
    if not isinstance(name, str) or not re.fullmatch(f"{_NAME_CHARS}+", name) or arguments is None:
        return None
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(name, arguments, complete=True), end


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _settled(text: str, final: bool, *markers: str) -> str:
    """`text` less what may still change: trailing whitespace, and an end that may be the start of
    a marker."""
    if final:
        return text
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                text = text[:-k]
                break
    return text.rstrip()


class HermesParser:
    """`<tool_call>{json}</tool_call>` blocks anywhere in the reply."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def parse(self, text: str, final: bool) -> Parsed:
        parsed, pos = Parsed(), 0
        while True:
            start = text.find(self.OPEN, pos)
            if start < 0:
                tail = _after_call if parsed.calls else _settled
                parsed.content += tail(text[pos:], final, self.OPEN)
                return parsed
            between = text[pos:start]
            parsed.content += _after_call(between, True) if parsed.calls else _before_call(between)
            close = text.find(self.CLOSE, start)
            body_end = close if close >= 0 else len(text)
            body = _skip_space(text, start + len(self.OPEN))
            try:
                found = _call_object(text[:body_end], body, final or close >= 0)
            except _Pending:
                return parsed
            if found is None:  # not a call after all: the block is content
                if close < 0 and not final:
                    return parsed
                parsed.content += text[start:close + len(self.CLOSE) if close >= 0 else len(text)]
            else:
                call, _ = found
                call.complete = call.complete and close >= 0
                parsed.calls.append(call)
            if close < 0:
                return parsed
            pos = close + len(self.CLOSE)


class JsonCallsParser:
    """A reply that is JSON call objects, one after another (`;` or whitespace between), possibly
    after `<|python_tag|>`: Llama 3's format, and that of tollway's grammar-made calls."""

    name = "llama3_json"
    TAG, SEPARATOR = "<|python_tag|>", ";"
    markers = (TAG,)

    def parse(self, text: str, final: bool) -> Parsed:
        pos = _skip_space(text, 0)
        if text.startswith(self.TAG, pos):
            pos = _skip_space(text, pos + len(self.TAG))
        if not final and (pos == len(text) or self.TAG.startswith(text[pos:])):
            return Parsed()
        parsed = Parsed()
        try:
            while pos < len(text):
                found = _call_object(text, pos, final)
                if found is None:
                    break
                call, end = found
                parsed.calls.append(call)
                if end is None:
                    return parsed
                pos = _skip_space(text, end)
                if text.startswith(self.SEPARATOR, pos):
                    pos = _skip_space(text, pos + len(self.SEPARATOR))
        except _Pending:
            return parsed
        if not parsed.calls:
            return Parsed(_settled(text, final, self.TAG))
        parsed.content = _after_call(text[pos:], final)
        return parsed


class MistralParser:
    """`[TOOL_CALLS]` then a JSON list of calls, or `name[ARGS]{...}` per call."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    markers = (MARKER, "[ARGS]", "[CALL_ID]")
    _NAMED = re.compile(f"({_NAME_CHARS}+)" + r"(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")
    _NAMED_PREFIX = re.compile(f"{_NAME_CHARS}*" + r"(?:\[[A-Z_]*\]?[A-Za-z0-9]*)*\[?[A-Z_]*")

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.MARKER)
        if start < 0:
            return Parsed(_settled(text, final, self.MARKER))
        parsed = Parsed(_before_call(text[:start]))
        pos = _skip_space(text, start + len(self.MARKER))
        try:
            if text.startswith("[", pos):
                self._list(text, pos + 1, final, parsed)
            else:
                self._named(text, pos, final, parsed)
        except _Pending:
            pass
        return parsed

    def _list(self, text: str, pos: int, final: bool, parsed: Parsed) -> None:
        while True:
            pos = _skip_space(text, pos)
            if pos == len(text) and not final:
                raise _Pending
            found = _call_object(text, pos, final)
            if found is None:
                return
            call, end = found
            parsed.calls.append(call)
            if end is None:
                return
            pos = _skip_space(text, end)
            if not text.startswith(",", pos):
                return
            pos += 1

    def _named(self, text: str, pos: int, final: bool, parsed: Parsed) -> None:
        while True:
            named = self._NAMED.match(text, pos)
            if named is None:
                if not final and self._NAMED_PREFIX.fullmatch(text, pos):
                    raise _Pending
                return
            start = named.end()
            try:
                _, end = _DECODER.raw_decode(text, start)
            except json.JSONDecodeError:
                parsed.calls.append(ParsedCall(named.group(1), text[start:]))
                return
            parsed.calls.append(ParsedCall(named.group(1), text[start:end], complete=True))
            pos = _skip_space(text, end)
            if not text.startswith(self.MARKER, pos):
                return
            pos += len(self.MARKER)


class ArgumentsParser:
    """The output of a call to one named function (tool_choice names it): its arguments alone."""

    def __init__(self, function: str):
        self.name = function

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed(calls=[ParsedCall(self.name, text, complete=final)])


def _before_call(text: str) -> str:
    return text.rstrip()


def _after_call(text: str, final: bool, *markers: str) -> str:
    """Text between or after calls, without the whitespace around it."""
    return _settled(text, final, *markers).strip()


PARSERS = {p.name: p for p in (HermesParser(), JsonCallsParser(), MistralParser())}
CONSTRAINED = "constrained"  # tollway's own: a grammar makes the call (tools.py), for any model
TOOL_CALL_PARSERS = (*PARSERS, CONSTRAINED)


def native_syntax(template: str | None) -> str | None:
    """The parser for the call syntax a chat template teaches its model; None for one it does not
    know (or no template)."""
    if not template:
        return None
    if MistralParser.MARKER in template:
        return "mistral"
    if HermesParser.OPEN in template:
        return "hermes"
    if JsonCallsParser.TAG in template or '"parameters": dictionary of argument name' in template:
        return "llama3_json"
    return None
