"""A request as the engine tracks it: prompt, sampling parameters, progress, timestamps."""
from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


class InvalidRequest(ValueError):
    """A request the engine cannot run. `param` names the field at fault by its OpenAI name,
    so the server's 400 can name it too."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


RETRY_AFTER_SECONDS = 1


class QueueFullError(ValueError):
    """A tier's waiting queue is at its bound: the request is refused, not queued."""

    def __init__(self, tier: str, bound: int):
        super().__init__(f"the {tier} queue is full ({bound} waiting); retry later")
        self.tier = tier
        self.retry_after = RETRY_AFTER_SECONDS


def check_prompt(prompt_token_ids: list[int], vocab_size: int, context: int) -> None:
    """Token ids the model has, and room left in the context for at least one generated token."""
    if any(not isinstance(t, int) or t < 0 for t in prompt_token_ids):
        raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab_size})", "prompt")
    past = max(prompt_token_ids, default=-1)
    if past >= vocab_size:  # a text prompt too, where the tokenizer has more tokens than the model
        raise InvalidRequest(f"the prompt has token id {past}, past this model's {vocab_size} tokens", "prompt")
    num_tokens = len(prompt_token_ids)
    if num_tokens == 0:
        raise InvalidRequest("prompt is empty", "prompt")
    if num_tokens >= context:
        raise InvalidRequest(f"prompt is {num_tokens} tokens, but the context is {context}", "prompt",
                             "context_length_exceeded")


@dataclass
class SamplingParams:
    """OpenAI/vLLM-style sampling parameters. temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    # top-n logprobs (and the token's own) of each prompt token after the first, from its prefill
    prompt_logprobs: int | None = None
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    # OpenAI's: logit -= presence_penalty * (count > 0) + frequency_penalty * count, count over the
    # tokens this request has generated; logit += logit_bias[token]. Greedy rows too.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's (and transformers'): the logit of every token in the prompt or the output so far is
    # divided by it where positive, multiplied where not. 1 disables. Greedy rows too.
    repetition_penalty: float = 1.0
    # vLLM's: a sampled row drops the tokens less likely than min_p times its most likely one
    # (after temperature). Argmax never changes, so greedy rows ignore it. 0 disables.
    min_p: float = 0.0
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    # Token sequences never generated (vLLM's bad_words, tokenized): a sequence's last token is
    # banned wherever the output ends with the rest of it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    skip_special_tokens: bool = True  # in the output text
    include_stop_str_in_output: bool = False  # the stop string that ended the text stays in it
    # An llguidance grammar (llguidance.LLMatcher.grammar_from_json_schema and the like): every token
    # generated follows it, and the request stops when it is complete. The server makes one from
    # response_format and tools.
    grammar: str | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequest, naming the field, for any bad value."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
             f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p!r}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
             f"logprobs must be between 0 and 20, got {self.logprobs!r}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
             f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be a list of non-empty strings"),
            (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (all(isinstance(t, int) and -100 <= b <= 100 for t, b in self.logit_bias.items()), "logit_bias",
             "logit_bias must map token ids to biases in [-100, 100]"),
            (0 < self.repetition_penalty < float("inf"), "repetition_penalty",
             f"repetition_penalty must be a finite number > 0 (1 disables), got {self.repetition_penalty!r}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
             "allowed_token_ids must not be empty"),
            (all(word for word in self.bad_words_token_ids), "bad_words", "bad_words must not be empty strings"),
        ]
        if vocab_size is not None:
            checks.append((all(0 <= t < vocab_size for t in self.stop_token_ids), "stop_token_ids",
                           f"stop_token_ids must be in [0, {vocab_size})"))
            checks.append((all(0 <= t < vocab_size for t in self.logit_bias), "logit_bias",
                           f"logit_bias token ids must be in [0, {vocab_size})"))
            checks.append((all(isinstance(t, int) and 0 <= t < vocab_size for t in self.allowed_token_ids or ()),
                           "allowed_token_ids", f"allowed_token_ids must be in [0, {vocab_size})"))
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes_repeats(self) -> bool:
        """Whether the sampler needs the tokens generated so far."""
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def penalizes_seen(self) -> bool:
        """Whether the sampler needs the tokens of the prompt and the output (repetition_penalty)."""
        return self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a row's argmax may differ from the raw logits' (so the greedy fast path, the LM
        head's pruned argmax, does not serve it). min_p never moves the argmax."""
        return (self.penalizes_repeats or self.penalizes_seen or bool(self.logit_bias) or self.grammar is not None
                or self.allowed_token_ids is not None)


@dataclass(frozen=True)
class Submission:
    """One request as checked at the edge (the server's validation, or Engine.add_request for a
    Python caller): its prompt's token ids within the vocabulary, the prompt within the context,
    its sampling values valid. Below the edge it is trusted; what only the scheduler knows (a
    lane's KV share, a full queue, an id in use) is checked there."""

    prompt_token_ids: list[int]
    params: SamplingParams

    @classmethod
    def check(cls, prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, context: int) -> Submission:
        """Raises InvalidRequest naming the field at fault."""
        params.validate(vocab_size)
        check_prompt(prompt_token_ids, vocab_size, context)
        return cls(prompt_token_ids, params)


class OutputFollower(Protocol):
    def push(self, token_id: int) -> str | None:
        """Take a committed token: why the request must finish after it ("stop": a stop string
        or its grammar complete; "length": the grammar was cut short to fit), if it must."""


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tier: str = "standard"
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    # Where params.prompt_logprobs asks: one entry per prompt token after the first, as its prefill
    # reaches it ({"token_id", "logprob", "rank", "top_logprobs": {id: logprob}})
    prompt_logprobs: list[dict] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_steps: int = 0  # steps that ran with this request in them
    steps_to_first_token: int | None = None
    # How often each token was generated, kept as tokens come where penalties count them
    output_counts: dict[int, int] | None = field(default=None, init=False, repr=False)
    # The distinct tokens of its prompt and output, kept where repetition_penalty counts them
    seen_token_ids: set[int] | None = field(default=None, init=False, repr=False)
    # What follows its output outside the scheduler, set by the engine: its text (stop strings)
    # and its grammar, asked at each committed token whether the request must finish.
    follower: OutputFollower | None = field(default=None, repr=False)
    grammar: object | None = field(default=None, repr=False)  # its matcher (model/grammar.py), for the runner
    tab: object | None = field(default=None, repr=False)  # its meter tab (meter/tab.py), where it is metered
    # Who hears of its outputs: called with each one the engine makes (AsyncEngine's delivery).
    listener: Callable[[object], None] | None = field(default=None, repr=False)
    last_planned: float | None = None  # when a plan last took it (the scheduler's clock), for the watchdog
    last_output_time: float | None = None  # when its latest output with tokens was made (the engine's)

    def __post_init__(self) -> None:
        if self.params.penalizes_repeats:
            self.output_counts = {}
        if self.params.penalizes_seen:
            self.seen_token_ids = set(self.prompt_token_ids)

    def add_output(self, token_ids: Iterable[int]) -> None:
        """Append generated tokens."""
        output, counts = self.output_token_ids, self.output_counts
        before = len(output)
        output.extend(token_ids)
        if counts is not None:
            for t in output[before:]:
                counts[t] = counts.get(t, 0) + 1
        if self.seen_token_ids is not None:
            self.seen_token_ids.update(output[before:])

    def banned_tokens(self) -> tuple[int, ...]:
        """The tokens it may not sample next: its stops, until it has min_tokens; and the last
        token of each bad word whose other tokens end its output."""
        params, output = self.params, self.output_token_ids
        if len(output) >= params.min_tokens and not params.bad_words_token_ids:
            return ()  # most requests, every step (a simulation asks millions of times)
        banned: tuple[int, ...] = ()
        if len(output) < params.min_tokens:
            eos = () if params.ignore_eos else self.eos_token_ids
            banned = (*eos, *params.stop_token_ids)
        for *before, last in params.bad_words_token_ids:
            if not before or (len(output) >= len(before) and output[len(output) - len(before):] == before):
                banned += (last,)
        return tuple(dict.fromkeys(banned))

    def stop_reason(self, token_id: int, max_len: int) -> str | None:
        """Why the request finishes with `token_id`, its latest output, or None. `max_len`: the
        longest its lane runs."""
        params = self.params
        outside = self.follower.push(token_id) if self.follower is not None else None
        if outside is not None:  # first: a stop string wins over length, as in OpenAI
            return outside
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.eos_token_ids):
            return "stop"
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_len:
            return "length"
        return None

    @property
    def scoring_prompt(self) -> bool:
        """Whether its prompt logprobs, where it asks for them, are still being scored."""
        return len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def prompt_to_score(self, start: int, end: int) -> tuple[int, ...]:
        """The prompt tokens whose logprobs the logits of positions start..end-1 give, where the
        request asks for prompt logprobs and has them up to `start`: the token after each
        position, up to the prompt's end."""
        if self.params.prompt_logprobs is None or start != len(self.prompt_logprobs):
            return ()
        return tuple(self.prompt_token_ids[start + 1:end + 1])

    @property
    def all_token_ids(self) -> TokenIds:
        """Prompt then output, as one sequence, without joining them."""
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """all_token_ids[start:end], straight from the two lists (each step asks, per sequence)."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        if start >= len(prompt):
            return tuple(output[start - len(prompt):end - len(prompt)])
        return tuple(prompt[start:end]) + tuple(output[:max(0, end - len(prompt))])

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED


class TokenIds(Sequence[int]):
    """A request's prompt and output as one read-only sequence over both lists: a slice costs
    its own length, never the request's (a step reads a request's tail, not its history)."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __getitem__(self, index):
        n = len(self.prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            if stop <= n:
                return self.prompt[start:stop]
            if start >= n:
                return self.output[start - n:stop - n]
            return self.prompt[start:] + self.output[:stop - n]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self.prompt[index] if index < n else self.output[index - n]
