"""One request's record: what was sent and when each of its tokens came back, as a real client
(bench) or the simulator saw it. Every statistic and report is computed from these."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Times are seconds on the bench's clock (perf_counter from the bench's start)."""

    index: int
    stage: str
    tier: str
    warmup: bool
    prompt_tokens: int | None  # as sent; usage's count replaces it when the server gives one
    max_tokens: int
    sent: float
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # every chunk that carried text
    end: float | None = None
    output_tokens: int | None = None
    cost: float | None = None  # the server's usage.cost in dollars (tollway reports it)
    engine_seconds: float | None = None  # the server's usage.engine_seconds (tollway)
    error: str | None = None  # its kind: http_429, timeout, connection, ...
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    def to_dict(self) -> dict:
        """As dataclasses.asdict, without its element-by-element deep copy: a simulated million
        requests' token times took minutes that way."""
        return {**vars(self), "chunk_times": list(self.chunk_times)}
