"""The OpenAI request bodies tollway accepts (completions and chat), with vLLM's extensions.
Values out of range are refused with the offending field named.

Nothing the client sends is dropped without a word: every field of OpenAI's create params and
of vLLM's request extras is either honoured or, set to anything but a value that asks for
nothing, refused with a 400 naming it (NOT_HONOURED). A field neither knows is refused as
OpenAI refuses it: 400 "Unrecognized request argument supplied: <name>", param the field.

Every list and string in a body is bounded, as OpenAI's are, so that no request can make the
server do unbounded work before it is refused (tokenizing megabytes, matching a thousand stop
strings against every token): each bound breached is a 400 naming its parameter."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, field_validator

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
MAX_REQUEST_ID_CHARS = 100  # it becomes a tag of up to 128 characters
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # past any vocabulary
MAX_BAD_WORDS = 64
MAX_CHOICES = 256  # guided_choice
MAX_GRAMMAR_CHARS = 100_000  # guided_regex, guided_grammar

Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
Stop = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]

_FUNCTIONS = "functions and function_call are deprecated: use tools and tool_choice"
# Fields tollway does not honour, OpenAI's and vLLM's: the values that ask for nothing
# (accepted), and why any other value is refused.
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
    # vLLM's
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1.0), "length_penalty weighs beams, and beam search is not supported"),
    "spaces_between_special_tokens": ((None, True), "special tokens left in the text (skip_special_tokens "
                                      "false) are decoded as the tokenizer decodes them"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported: logprobs name "
                                   "tokens by their text"),
    "return_token_ids": ((None, False), "return_token_ids is not supported"),
    "logits_processors": ((None, []), "logits_processors are not supported: a request runs no code of its own"),
    "vllm_xargs": ((None, {}), "vllm_xargs is not supported: there are no custom logits processors to pass it to"),
    "kv_transfer_params": ((None,), "kv_transfer_params is not supported: prefill and decode are not disaggregated"),
    "cache_salt": ((None,), "cache_salt is not supported: the prefix cache is shared by every request"),
    "mm_processor_kwargs": ((None, {}), "mm_processor_kwargs is not supported: this server reads text only"),
    "prompt_embeds": ((None,), "prompt_embeds is not supported: send text or token ids"),
    "guided_decoding_backend": ((None, "auto", "guidance", "llguidance"), "every grammar is followed by llguidance"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported: JSON output is compact"),
    "structural_tag": ((None,), "structural_tag is not supported"),
    "chat_template": ((None,), "a request's own chat_template is not supported (as in vLLM without "
                      "--trust-request-chat-template): start the server with --chat-template"),
}
# Chat only: completions honour echo.
NOT_HONOURED_IN_CHAT: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((None, False), "echo is not supported in chat: the reply does not repeat the last message"),
}


def refusing(table: dict[str, tuple[tuple[Any, ...], str]]):
    """A validator for the fields of `table`: a value that asks for nothing, or a 400 naming it."""
    def refuse_unless_default(value: Any, info: ValidationInfo) -> Any:
        accepted, why = table[info.field_name]
        if value not in accepted:
            raise ValueError(f"{why} (tollway accepts only {' or '.join(map(repr, accepted))})")
        return value
    return refuse_unless_default


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: Literal[False] | None = None  # tollway's chunks carry no obfuscation padding
    continuous_usage_stats: Literal[False] | None = None  # vLLM's: usage comes with the last chunk only


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")  # errors.py words it as OpenAI does

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
    response_format: dict[str, Any] | None = None  # completions too, as vLLM's
    # vLLM's extensions (SamplingParams checks their values, naming them)
    top_k: int | None = Field(default=None, ge=-1)  # -1 and 0 both disable
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    # the prompt tokens' logprobs, each with this many of its position's top tokens (vLLM's)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    allowed_token_ids: list[int] | None = Field(default=None, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]] | None = \
        Field(default=None, max_length=MAX_BAD_WORDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last this many; -1: the context
    add_special_tokens: bool | None = None  # None: true for a prompt, false for a chat (its template writes BOS)
    priority: int | None = None  # a lane: service_tier.priority_tier
    request_id: Annotated[str, StringConstraints(max_length=MAX_REQUEST_ID_CHARS)] | None = None  # a ledger tag
    # grammars (structured_output.py): at most one of these and response_format
    guided_json: dict[str, Any] | str | None = None
    guided_regex: Annotated[str, StringConstraints(max_length=MAX_GRAMMAR_CHARS)] | None = None
    guided_choice: list[Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]] | None = \
        Field(default=None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: Annotated[str, StringConstraints(max_length=MAX_GRAMMAR_CHARS)] | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's, refused unless they ask for nothing (NOT_HONOURED)
    use_beam_search: Any = None
    length_penalty: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None
    kv_transfer_params: Any = None
    cache_salt: Any = None
    mm_processor_kwargs: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structural_tag: Any = None

    # both bodies' NOT_HONOURED fields, wherever declared
    _not_honoured = field_validator(*NOT_HONOURED, check_fields=False)(refusing(NOT_HONOURED))

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
    prompt_embeds: Any = None


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
    # vLLM's: how the template is rendered (validation.py), and documents for a RAG template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_MESSAGES)
    chat_template: Any = None
    echo: Any = None
    include_reasoning: bool | None = None  # vLLM's: the model does not reason, so either value asks for nothing
    tools: list[Any] | None = None  # server/tools.py checks them
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # false: the first of the calls a model writes (grammar-made: one)
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

    _not_honoured_in_chat = field_validator(*NOT_HONOURED_IN_CHAT)(refusing(NOT_HONOURED_IN_CHAT))

    @field_validator("messages")
    @classmethod
    def _bounded(cls, messages):
        size = sum(len(m.content) if isinstance(m.content, str) else len(str(m.content or "")) for m in messages)
        if size > MAX_TEXT_CHARS:
            raise ValueError(f"the messages hold more than {MAX_TEXT_CHARS} characters in all")
        return messages
