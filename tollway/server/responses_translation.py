"""A Responses API request as the chat completion it runs as: its input items become chat
messages (after the conversation of its previous response), `instructions` a system message,
`text.format` a response_format, flat function tools chat's nested ones, and `include`'s
output text logprobs (with `top_logprobs`) chat's logprobs. The chat path
then does the rest (validation.py: the chat template, tools.py, structured_output.py), and its
refusals are renamed to the Responses fields they concern."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tollway.server.errors import APIError
from tollway.server.protocol import ChatCompletionRequest
from tollway.server.responses_protocol import LOGPROBS, ResponsesRequest

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# chat's parameters -> the Responses fields they come from
RENAMED = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text"}
_RENAMED_WORDS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                  "max_tokens": "max_output_tokens", "the messages": "the input"}


def chat_request(req: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat completion `req` runs as, and its turn's conversation (`history`, the previous
    response's, then the input, without the instructions: OpenAI does not carry them over)."""
    turn = history + input_messages(req.input)
    if not turn:
        raise APIError(400, "input is empty: send a string or a list of items", param="input")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + turn
    logprobs = LOGPROBS in (req.include or ())
    if req.top_logprobs and not logprobs:
        raise APIError(400, f"top_logprobs needs include: [{LOGPROBS!r}], which asks for the logprobs",
                       param="top_logprobs")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
                            "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
                            "parallel_tool_calls": req.parallel_tool_calls,
                            "response_format": response_format(req.text), "service_tier": req.service_tier,
                            "metadata": req.metadata, "user": req.user, "safety_identifier": req.safety_identifier,
                            "prompt_cache_key": req.prompt_cache_key, "stream": req.stream,
                            "temperature": req.temperature, "top_p": req.top_p, "logprobs": logprobs or None,
                            "top_logprobs": req.top_logprobs if logprobs else None}
    try:  # what is not given keeps chat's default
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}), turn
    except ValidationError as e:
        first = e.errors()[0]
        param = RENAMED.get(str(first["loc"][0]), str(first["loc"][0])) if first["loc"] else None
        raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None


def renamed(e: APIError) -> APIError:
    """A refusal of the chat path, in the Responses API's names."""
    message = e.message
    for chat_word, word in _RENAMED_WORDS.items():
        message = message.replace(chat_word, word)
    return APIError(e.status, message, RENAMED.get(e.param, e.param), e.code, e.headers)


def input_messages(items: str | list[dict] | None) -> list[dict]:
    """The input as chat messages: function calls an assistant message's tool_calls (calls made
    together in one message), their outputs role "tool" messages."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise APIError(400, f"input[{i}] must be an item (an object)", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"input[{i}].role must be one of {', '.join(_ROLES)}, got {str(role)[:64]!r}",
                               param="input")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise APIError(400, f"input[{i}]: items of type {str(kind)[:64]!r} are not supported (messages, "
                                "function_call and function_call_output are)", param="input")
    return messages


def _text(content: Any, where: str) -> str:
    """A message's content (a string or text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: content parts of type {str(kind)[:64]!r} are not supported: this model "
                                "reads text only (input_text, output_text)", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise APIError(400, f"input[{i}].{name} must be a string", param="input")
    return value


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """Flat function tools ({"type": "function", "name": ...}) as chat's nested ones. Strict
    unless told otherwise, as OpenAI's Responses API."""
    if tools is None:
        return None
    nested = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}]: tools of type {str(kind)[:64]!r} are not supported: only function "
                                "tools are (no built-in tools run here)", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        nested.append({"type": "function", "function": {**function, "strict": tool.get("strict", True) is not False}})
    return nested


def chat_tool_choice(choice: Any) -> Any:
    """tool_choice as chat's: {"type": "function", "name": X} nests the name."""
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, f"tool_choice of type {str(choice.get('type'))[:64]!r} is not supported: use "
                                "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}",
                           param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format: json_schema's name, schema and strict nest."""
    if not text:
        return None
    if text.keys() - {"format", "verbosity"}:
        raise APIError(400, f"text: unknown field {sorted(text.keys() - {'format', 'verbosity'})[0][:64]!r}",
                       param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise APIError(400, "text.verbosity is not supported (tollway accepts only \"medium\")", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text")
    if fmt.get("type") != "json_schema":
        return {"type": fmt.get("type")}
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                   if k in fmt}}
