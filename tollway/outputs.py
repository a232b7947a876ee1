"""What the engine hands back for a request after a step.

Each output carries what the step added (new_text, new_token_ids, new_logprobs) and the
count so far; the whole text, ids and logprobs come on the final output only, so that
following a request costs time in what it adds, not in its length."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    tier: str
    prompt_token_ids: list[int]
    new_text: str = ""  # released by the latest step (stop strings cut off)
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict] = field(default_factory=list)  # one per new token, when asked for
    num_output_tokens: int = 0  # generated so far
    # Where the request asked (SamplingParams.prompt_logprobs), on its first output with a token and
    # on its final one: None for the first prompt token, then Request.prompt_logprobs' entries.
    prompt_logprobs: list[dict | None] | None = None
    # The whole request, on the final output (finished) only:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_prompt_tokens: int = 0
    # monotonic seconds: when the request arrived, was first scheduled, got its first token,
    # when this output was made, and when the one before it with tokens was (None: none was)
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time: float = 0.0
    previous_token_time: float | None = None
    num_steps: int = 0  # steps that ran with the request in them so far
    steps_to_first_token: int | None = None
