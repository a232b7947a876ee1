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
from tollway.server.errors import APIError, invalid_body
from tollway.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from tollway.server.responses_protocol import ResponsesRequest
from tollway.server.structured_output import request_grammar
from tollway.server.tool_parsers import CONSTRAINED, native_syntax
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
    echo: bool  # completions only: the prompt's text (and, with logprobs, its logprobs) leads each choice's
    tools: ToolCalling | None = None  # chat only: how its output is read as a tool call
    prompt_logprobs: int | None = None  # vLLM's field, as asked: each response gives them in its shape
    echo_only: bool = False  # max_tokens 0 with echo: each choice is its prompt alone

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
             vocab_size: int, max_model_len: int, tags_header: str | None = None,
             tool_call_parser: str | None = None) -> CheckedCall:
    """`req` as the engine's inputs; raises APIError naming the parameter at fault.
    `tool_call_parser`: the syntax the model's tool calls are read in (tool_parsers.py; None: the
    one its chat template teaches, if any)."""
    chat = isinstance(req, ChatCompletionRequest)
    tags = request_tags(req, tags_header)
    check_model(req.model, model_name)
    prompts = token_prompts(req, tokenizer, max_model_len)
    longest = max(len(p) for p in prompts)
    try:
        for prompt in prompts:
            check_prompt(prompt, vocab_size, max_model_len)
    except InvalidRequest as e:
        raise invalid(e, chat) from None
    asked = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
    echo_only = asked == 0
    if echo_only and (chat or not req.echo):
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo: the prompt alone, to score it)",
                       param="max_tokens")
    # OpenAI's legacy max_tokens 0 with echo, as vLLM serves it: one token is generated and not shown
    max_tokens = 1 if echo_only else asked or (max_model_len - longest if chat else 16)
    if longest + max_tokens > max_model_len:
        raise APIError(400, f"this model's context is {max_model_len} tokens; the prompt ({longest}) plus "
                            f"max_tokens ({max_tokens}) is more", param="max_tokens", code="context_length_exceeded")
    logprobs = (req.top_logprobs or 0 if req.logprobs else None) if chat else req.logprobs
    calling, grammar = tool_calling(req, tokenizer.renders_tools, tool_call_syntax(tokenizer, tool_call_parser)) \
        if chat else (None, None)
    constraint, field = request_grammar(req)
    if constraint is not None and grammar is not None:
        raise APIError(400, f"tools and {field} both constrain the output; send one of them", param=field)
    grammar = grammar or constraint
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: they come in the whole response only
        raise APIError(400, "prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    echo = not chat and req.echo
    # what the engine scores: the larger of vLLM's prompt_logprobs and, with echo, logprobs
    scored = [n for n in (req.prompt_logprobs, logprobs if echo else None) if n is not None]
    prompt_logprobs = max(scored) if scored else None
    bad_words = bad_words_token_ids(req.bad_words or [], tokenizer)
    params = [sampling_params(req, max_tokens, logprobs, i, vocab_size, grammar, prompt_logprobs, bad_words)
              for i in range(req.n)]
    return CheckedCall("chat" if chat else "completion", prompts, params, tags, echo, calling, req.prompt_logprobs,
                       echo_only)


def check_model(model: str | None, model_name: str) -> None:
    """A 404 naming `model` unless it is the one served (or not given)."""
    if model is not None and model != model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{model_name}`.",
                       param="model", code="model_not_found")


def tool_call_syntax(tokenizer: Tokenizer, configured: str | None) -> str:
    """The syntax a chat's tool calls are read in: the configured one, else the chat template's."""
    template = tokenizer.chat_template.text if tokenizer.chat_template is not None else None
    return configured or native_syntax(template) or CONSTRAINED


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
        raise invalid_body(e.errors()) from None
    if req.stream:
        raise APIError(400, "stream is not supported in a batch", param="stream")
    return req


def request_tags(req: SamplingFields, header: str | None) -> list[str]:
    """A request's tags: its `metadata` pairs as "key=value", its vLLM request_id as
    "request_id=...", then the comma-separated x-tollway-tags header."""
    tags = [f"{k}={v}" for k, v in (req.metadata or {}).items()]
    tags += [f"request_id={req.request_id}"] if req.request_id is not None else []
    tags += [t.strip() for t in (header or "").split(",") if t.strip()]
    tags = list(dict.fromkeys(tags))
    if len(tags) > MAX_TAGS or any(len(t) > 128 for t in tags):
        raise APIError(400, f"at most {MAX_TAGS} tags of up to 128 characters each (metadata and x-tollway-tags)",
                       param="metadata")
    return tags


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, n_index: int, vocab_size: int,
                    grammar: str | None = None, prompt_logprobs: int | None = None,
                    bad_words: list[list[int]] | None = None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(0, req.top_k or 0),
        # n > 1 with a seed: each choice its own reproducible stream
        seed=None if req.seed is None else req.seed + n_index, stop=stop,
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
        min_tokens=req.min_tokens, frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0, logit_bias=token_biases(req.logit_bias), grammar=grammar,
        prompt_logprobs=prompt_logprobs,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0, allowed_token_ids=req.allowed_token_ids, bad_words_token_ids=bad_words or [],
        skip_special_tokens=req.skip_special_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
    )
    try:
        params.validate(vocab_size)
    except InvalidRequest as e:
        raise invalid(e, False) from None
    return params


def bad_words_token_ids(words: list[str], tokenizer: Tokenizer) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as it starts the text, and, where it
    tokenizes differently after a space, as it follows a word."""
    found: list[list[int]] = []
    for word in words:
        try:
            alone = tokenizer.encode(word, add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        except UnicodeEncodeError as e:
            raise APIError(400, f"bad_words has a word that is not valid Unicode text: {e.reason}",
                           param="bad_words") from None
        if not alone:
            raise APIError(400, f"bad_words has a word with no tokens: {word!r}", param="bad_words")
        found += [alone] + ([spaced] if spaced and spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    return found


def token_biases(logit_bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias, keyed by token id strings, keyed by token ids."""
    try:
        return {int(token): bias for token, bias in (logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None


def token_prompts(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer,
                  max_model_len: int) -> list[list[int]]:
    """The prompts' tokens, each cut to its last truncate_prompt_tokens where that is given (-1:
    the context, `max_model_len`)."""
    try:
        prompts = _token_prompts(req, tokenizer)
    except UnicodeEncodeError as e:  # JSON's "\ud800" escapes parse to lone surrogates, which no UTF-8 holds
        field = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise APIError(400, f"the {field} is not valid Unicode text: {e.reason} ({e.object[e.start:e.end]!a})",
                       param=field) from None
    keep = max_model_len if req.truncate_prompt_tokens == -1 else req.truncate_prompt_tokens
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    return [p[-keep:] for p in prompts] if keep else prompts


def _token_prompts(req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    if isinstance(req, ChatCompletionRequest):
        if req.continue_final_message and "add_generation_prompt" in req.model_fields_set and req.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        kwargs = {**(req.chat_template_kwargs or {}), **({"documents": req.documents} if req.documents else {})}
        text = chat_text(req.messages, req.tools, kwargs, tokenizer, req.add_generation_prompt,
                         req.continue_final_message)
        return [tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))]
    prompt, special = req.prompt, req.add_special_tokens is not False
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, add_special_tokens=special)]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    if isinstance(prompt[0], str):
        return [tokenizer.encode(p, add_special_tokens=special) for p in prompt]
    return [list(p) for p in prompt]


def chat_text(messages: list[ChatMessage], tools: list | None, template_kwargs: dict | None, tokenizer: Tokenizer,
              add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The prompt text of a chat's messages, in the model's chat template; with
    continue_final_message, left open after the final (assistant's) message for the model to go on."""
    turns = [m.model_dump(exclude_none=True) for m in messages]
    for m in turns:  # OpenAI's content parts: keep the text ones
        if isinstance(m.get("content"), list):
            m["content"] = "".join(part.get("text", "") for part in m["content"] if part.get("type") == "text")
    turns = conversation(turns, tools, tokenizer.renders_tools)
    if continue_final_message and turns[-1]["role"] != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")
    try:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt and not continue_final_message,
                                             template_kwargs, tools=tools if tokenizer.renders_tools else None)
    except Exception as e:  # noqa: BLE001 -- a template that rejects these messages (jinja raise_exception)
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return left_open(text, turns[-1].get("content") or "") if continue_final_message else text


def left_open(rendered: str, final: str) -> str:
    """`rendered` cut right after the final message's text, so that the model continues it
    (transformers' continue_final_message: where the template trimmed the message, after its
    trimmed text)."""
    at = rendered.rfind(final.strip())
    if not final.strip() or at < 0:
        raise APIError(400, "continue_final_message: the chat template does not write the final message's text "
                            "as sent, so it cannot be continued", param="continue_final_message")
    kept = final.lstrip()
    return rendered[:at + (len(kept) if rendered[at:at + len(kept)] == kept else len(final.strip()))]
