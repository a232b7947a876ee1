"""The OpenAI request bodies tollway accepts (completions and chat), with vLLM's extensions
(top_k, min_tokens, ignore_eos). Values out of range are refused with the offending field named.

Nothing the client sends is dropped without a word: every field of OpenAI's create params is
either honoured or, set to anything but a value that asks for nothing, refused with a 400 naming
it (NOT_HONOURED). Fields OpenAI does not know either are accepted, as OpenAI's server accepts
them, and logged once per name.

Every list and string in a body is bounded, as OpenAI's are, so that no request can make the
server do unbounded work before it is refused (tokenizing megabytes, matching a thousand stop
strings against every token): each bound breached is a 400 naming its parameter."""
from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator, model_validator

MAX_N = 16
MAX_STOP = 4  # stop sequences, as OpenAI
MAX_STOP_CHARS = 256  # per stop sequence
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # token ids biased
MAX_METADATA = 16  # pairs, keys of 64 and values of 512 characters, as OpenAI
MAX_PROMPTS = 64  # prompts in one completions call
MAX_MESSAGES = 2048
# Characters of prompt or message text in one call: past any context tollway serves (a token is
# a few characters), and small enough to tokenize in well under a second.
MAX_TEXT_CHARS = 1_000_000
MAX_NAME_CHARS = 256  # model, user, service_tier

Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
Stop = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]

_FUNCTIONS = "functions and function_call are deprecated: use tools and tool_choice"
# OpenAI fields tollway does not honour: the values that ask for nothing (accepted), and why any
# other value is refused.
NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "best_of is not supported: ask for n choices and pick one"),
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "functions": ((None, []), _FUNCTIONS),
    "function_call": ((None, "none"), _FUNCTIONS),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported: the model does not reason"),
    "verbosity": ((None,), "verbosity is not supported"),
    "store": ((None, False), "stored completions are not supported"),
    "moderation": ((None,), "moderation is not supported"),
    "prompt_cache_options": ((None,), "prompt_cache_options is not supported: the prefix cache is automatic"),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache is in memory only"),
}

log = logging.getLogger(__name__)
_logged_unknown: set[str] = set()  # extra field names already logged: once each per process


def refuse_unless_default(value: Any, info: ValidationInfo) -> Any:
    """A field of NOT_HONOURED: its value if it asks for nothing, else a 400 naming it."""
    accepted, why = NOT_HONOURED[info.field_name]
    if value not in accepted:
        raise ValueError(f"{why} (tollway accepts only {' or '.join(map(repr, accepted))})")
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False
    include_obfuscation: Literal[False] | None = None  # tollway's chunks carry no obfuscation padding


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo only (validation.py)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | list[Stop] | None = Field(default=None)
    seed: int | None = None
    # identifiers of the end user and a cache hint: they change nothing in what is generated (the
    # prefix cache serves any repeated prefix without a key)
    user: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    service_tier: Name | None = None
    # becomes the request's tags in the ledger ("key=value")
    metadata: dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]] \
        | None = Field(default=None, max_length=MAX_METADATA)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    # token id (a string, as OpenAI's) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1)  # -1 and 0 both disable
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    # the prompt tokens' logprobs, each with this many of its position's top tokens (vLLM's)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, body: Any) -> Any:
        if isinstance(body, dict):
            for name in body.keys() - cls.model_fields.keys() - _logged_unknown:
                _logged_unknown.add(name)
                log.warning("request field %r is not an OpenAI field tollway knows: accepted and ignored", name[:64])
        return body

    # both bodies' NOT_HONOURED fields, wherever declared
    _not_honoured = field_validator(*NOT_HONOURED, check_fields=False)(refuse_unless_default)

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stop)}")
        return stop


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _bounded(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one call, got {len(prompt)}")
        parts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if sum(map(len, parts)) > MAX_TEXT_CHARS:
            raise ValueError(f"the prompt is longer than {MAX_TEXT_CHARS} characters (or token ids) in all")
        return prompt
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text":
                raise ValueError(f"content parts of type {str(part.get('type'))[:64]!r} are not supported: "
                                 "this model reads text only")
        return content


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (vLLM's)
    tools: list[Any] | None = None  # server/tools.py checks them
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # false: the first of the calls a model writes (grammar-made: one)
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: bool | None = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None

    @field_validator("messages")
    @classmethod
    def _bounded(cls, messages):
        size = sum(len(m.content) if isinstance(m.content, str) else len(str(m.content or "")) for m in messages)
        if size > MAX_TEXT_CHARS:
            raise ValueError(f"the messages hold more than {MAX_TEXT_CHARS} characters in all")
        return messages
