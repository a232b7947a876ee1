"""What the engine hands back for a request after a step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    tier: str
    prompt_token_ids: list[int]
    text: str = ""  # all text released so far (stop strings cut off)
    token_ids: list[int] = field(default_factory=list)  # all generated ids so far
    new_text: str = ""  # released by the latest step; for streaming
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_prompt_tokens: int = 0
    # monotonic seconds: when the request arrived, was first scheduled, got its first token,
    # and when this output was made
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time: float = 0.0
