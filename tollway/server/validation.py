"""The one check of an API call: a completions or chat body becomes what the engine runs for it
(a CheckedCall: a Submission per prompt and choice), or an APIError that names the OpenAI
parameter at fault.

The rules themselves are the engine's (SamplingParams.validate, check_prompt in request.py), so
a request refused here is refused for the same reason and in the same words as one added from
Python, and the layers below take what passes on trust. What only the scheduler can know (a
prompt past a lane's KV share, a full queue) comes back from the add, named the same way
(generation.py)."""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from tollway.request import InvalidRequest, SamplingParams, Submission, check_prompt
from tollway.server.errors import APIError
from tollway.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tollway.server.responses_protocol import ResponsesRequest
from tollway.server.structured_output import response_grammar
from tollway.server.tools import ToolCalling, conversation, tool_calling
from tollway.text.tokenizer import Tokenizer

MAX_TAGS = 16
# What each endpoint a Batch API line may name takes as its body.
BATCH_BODIES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                            "/v1/chat/completions": ChatCompletionRequest,
                                            "/v1/responses": ResponsesRequest}


@dataclass(frozen=True)
class CheckedCall:
    """An API call checked against the model: every prompt times every choice's params."""

    kind: str  # "completion" | "chat"
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice, the same for every prompt
    tags: list[str]
    echo: bool  # completions only: the prompt's text leads each choice's
    tools: ToolCalling | None = None  # chat only: how its output is read as a tool call

    @property
    def num_requests(self) -> int:
        return len(self.prompts) * len(self.params)

    @property
    def submissions(self) -> list[Submission]:
        """The engine requests, prompt by prompt, each prompt's choices in order: parts checked
        here already, so put together without checking again."""
        return [Submission(prompt, params) for prompt in self.prompts for params in self.params]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def most_output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params) * len(self.prompts)


def validate(req: CompletionRequest | ChatCompletionRequest, model_name: str, tokenizer: Tokenizer,
             vocab_size: int, max_model_len: int, tags_header: str | None = None) -> CheckedCall:
    """`req` as the engine's inputs; raises APIError naming the parameter at fault."""
    chat = isinstance(req, ChatCompletionRequest)
    tags = request_tags(req, tags_header)
    if req.model is not None and req.model != model_name:
        raise APIError(404, f"The model `{req.model}` does not exist; this server serves `{model_name}`.",
                       param="model", code="model_not_found")
    prompts = token_prompts(req, tokenizer)
    longest = max(len(p) for p in prompts)
    try:
        for prompt in prompts:
            check_prompt(prompt, vocab_size, max_model_len)
    except InvalidRequest as e:
        raise invalid(e, chat) from None
    asked = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    max_tokens = asked or (max_model_len - longest if chat else 16)
    if longest + max_tokens > max_model_len:
        raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt ({longest}) plus "
                            f"max_tokens ({max_tokens}) is more", param="max_tokens", code="context_length_exceeded")
    logprobs = (req.top_logprobs or 0 if req.logprobs else None) if chat else req.logprobs
    calling, grammar = tool_calling(req, tokenizer.renders_tools) if chat else (None, None)
    if chat and grammar is None:
        grammar = response_grammar(req.response_format)
    params = [sampling_params(req, max_tokens, logprobs, i, vocab_size, grammar) for i in range(req.n)]
    return CheckedCall("chat" if chat else "completion", prompts, params, tags, not chat and req.echo, calling)


def invalid(e: InvalidRequest, chat: bool) -> APIError:
    """The engine's refusal as a 400; a chat's prompt is its messages."""
    param = "messages" if chat and e.param == "prompt" else e.param
    return APIError(400, str(e), param=param, code=e.code)


def batch_line(url: str, body: dict) -> CompletionRequest | ChatCompletionRequest | ResponsesRequest:
    """One Batch API line's body, parsed as POST `url` would parse it."""
    model = BATCH_BODIES.get(url)
    if model is None:
        raise APIError(400, f"unsupported url {url!r}; use one of {', '.join(BATCH_BODIES)}", param="url")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}",
                       param=str(first["loc"][0]) if first["loc"] else None) from None
    if req.stream:
        raise APIError(400, "stream is not supported in a batch", param="stream")
    return req


def request_tags(req: SamplingFields, header: str | None) -> list[str]:
    """A request's tags: its `metadata` pairs as "key=value", then the comma-separated
    x-tollway-tags header."""
    tags = [f"{k}={v}" for k, v in (req.metadata or {}).items()]
    tags += [t.strip() for t in (header or "").split(",") if t.strip()]
    tags = list(dict.fromkeys(tags))
    if len(tags) > MAX_TAGS or any(len(t) > 128 for t in tags):
        raise APIError(400, f"at most {MAX_TAGS} tags of up to 128 characters each (metadata and x-tollway-tags)",
                       param="metadata")
    return tags


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, n_index: int, vocab_size: int,
                    grammar: str | None = None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k),
        # n > 1 with a seed: each choice its own reproducible stream
        seed=None if req.seed is None else req.seed + n_index, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
        min_tokens=req.min_tokens, frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0, logit_bias=token_biases(req.logit_bias), grammar=grammar,
    )
    try:
        params.validate(vocab_size)
    except InvalidRequest as e:
        raise invalid(e, False) from None
    return params


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, keyed by token id strings, keyed by token ids."""
    try:
        return {int(token): bias for token, bias in (logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None


def token_prompts(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    try:
        return _token_prompts(req, tokenizer)
    except UnicodeEncodeError as e:  # JSON's "\ud800" escapes parse to lone surrogates, which no UTF-8 holds
        field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise APIError(400, f"the {field} is not valid Unicode text: {e.reason} ({e.object[e.start:e.end]!a})",
                       param=field) from None


def _token_prompts(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    if isinstance(req, ChatCompletionRequest):
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for m in messages:  # OpenAI's content parts: keep the text ones
            if isinstance(m.get("content"), list):
                m["content"] = "".join(part.get("text", "") for part in m["content"] if part.get("type") == "text")
        messages = conversation(messages, req.tools, tokenizer.renders_tools)
        try:
            text = tokenizer.apply_chat_template(messages, template_kwargs=req.chat_template_kwargs,
                                                 tools=req.tools if tokenizer.renders_tools else None)
        except Exception as e:  # noqa: BLE001 -- a template that rejects these messages (jinja raise_exception)
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return [tokenizer.encode(text, add_special_tokens=False)]
    prompt = req.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [tokenizer.encode(p) for p in prompt]
    return [list(p) for p in prompt]
