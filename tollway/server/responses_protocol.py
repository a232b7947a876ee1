"""The body of POST /v1/responses (OpenAI's Responses API), bounded as the chat body is
(protocol.py). Unlike chat, a field OpenAI's Responses API does not have is a 400 naming it,
as OpenAI's own answer is; a Responses field tollway cannot honour is refused unless its value
asks for nothing (NOT_HONOURED)."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator

from tollway.server.protocol import MAX_MESSAGES, MAX_METADATA, MAX_TEXT_CHARS, Name

# Responses fields tollway does not honour: the values that ask for nothing, and why any other
# value is refused.
NOT_HONOURED: dict[str, tuple[tuple[Any, ...], str]] = {
    "reasoning": ((None,), "reasoning is not supported: the model does not reason"),
    "background": ((None, False), "background responses are not supported: stream instead"),
    "background_options": ((None,), "background responses are not supported"),
    "conversation": ((None,), "conversations are not supported: continue with previous_response_id"),
    "prompt": ((None,), "prompt templates are not supported: send input and instructions"),
    "truncation": ((None, "disabled"), "truncation \"auto\" is not supported: input past the context is refused"),
    "max_tool_calls": ((None,), "max_tool_calls is not supported"),
    "context_management": ((None,), "context_management is not supported"),
    "moderation": ((None,), "moderation is not supported"),
    "image": ((None,), "image output is not supported"),
    "access_programs": ((None,), "access_programs is not supported"),
    "prompt_cache_options": ((None,), "prompt_cache_options is not supported: the prefix cache is automatic"),
    "prompt_cache_retention": ((None, "in_memory"), "the prefix cache is in memory only"),
}


LOGPROBS = "message.output_text.logprobs"  # what `include` may ask for: the output text's logprobs


class ResponseStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: Literal[False] | None = None  # tollway's events carry no obfuscation padding


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Name | None = None
    # a string (one user message) or a list of items: messages, function_call, function_call_output
    input: str | list[Any] | None = None
    instructions: Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict[str, Any] | None = None  # its format: text, json_object or json_schema
    tools: list[Any] | None = None  # function tools, in the Responses API's flat shape
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    service_tier: Name | None = None
    previous_response_id: Name | None = None
    store: bool = True
    metadata: dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]] \
        | None = Field(default=None, max_length=MAX_METADATA)
    user: Name | None = None
    safety_identifier: Name | None = None
    prompt_cache_key: Name | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    reasoning: Any = None
    background: bool | None = None
    background_options: Any = None
    include: list[Any] | None = None  # LOGPROBS only
    conversation: Any = None
    prompt: Any = None
    truncation: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None

    @field_validator(*NOT_HONOURED)
    @classmethod
    def _refuse_unless_default(cls, value: Any, info: ValidationInfo) -> Any:
        accepted, why = NOT_HONOURED[info.field_name]
        if value not in accepted:
            raise ValueError(f"{why} (tollway accepts only {' or '.join(map(repr, accepted))})")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[Any] | None) -> list[Any] | None:
        for name in value or ():
            if name != LOGPROBS:
                raise ValueError(f"{str(name)[:64]!r} cannot be included: only {LOGPROBS!r} can (no built-in tools, "
                                 "images or reasoning run here)")
        return value

    @field_validator("input")
    @classmethod
    def _bounded(cls, value):
        if isinstance(value, list) and len(value) > MAX_MESSAGES:
            raise ValueError(f"at most {MAX_MESSAGES} items, got {len(value)}")
        if len(value if isinstance(value, str) else str(value or "")) > MAX_TEXT_CHARS:
            raise ValueError(f"the input holds more than {MAX_TEXT_CHARS} characters in all")
        return value
