"""The OpenAI request bodies tollway accepts (completions and chat), with vLLM's extensions
(top_k, min_tokens, ignore_eos). Unknown fields are ignored, as OpenAI does; values out of
range are refused with the offending field named.

Every list and string in a body is bounded, as OpenAI's are, so that no request can make the
server do unbounded work before it is refused (tokenizing megabytes, matching a thousand stop
strings against every token): each bound breached is a 400 naming its parameter."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

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


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Name | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop | list[Stop] | None = Field(default=None)
    seed: int | None = None
    user: Name | None = None
    service_tier: Name | None = None
    # becomes the request's tags in the ledger ("key=value")
    metadata: dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]] \
        | None = Field(default=None, max_length=MAX_METADATA)
    # Accepted for compatibility and bounded; not applied to sampling.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1)  # -1 and 0 both disable
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (vLLM's)

    @field_validator("messages")
    @classmethod
    def _bounded(cls, messages):
        size = sum(len(m.content) if isinstance(m.content, str) else len(str(m.content or "")) for m in messages)
        if size > MAX_TEXT_CHARS:
            raise ValueError(f"the messages hold more than {MAX_TEXT_CHARS} characters in all")
        return messages
