"""What a policy (policies.py) may read of the scheduler it belongs to: the few questions it
asks, and nothing of how the scheduler keeps its books."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from tollway.config import SchedulerConfig, TierSpec
from tollway.request import Request
from tollway.scheduler.step_model import StepShape, StepTimeModel


class SchedulerView(Protocol):
    config: SchedulerConfig
    tiers: dict[str, TierSpec]
    waiting: dict[str, deque[Request]]  # per tier, in queue order
    running: dict[str, Request]  # in admission order

    @property
    def step_model(self) -> StepTimeModel | None: ...

    def stepping(self) -> Iterable[Request]:
        """The running requests planned one by one."""

    def arrival(self, request: Request) -> int:
        """An unfinished request's place in arrival order."""

    def admitted(self, request: Request) -> int:
        """A running request's place in admission order, newest largest."""

    def turn_of(self, request: Request) -> tuple[int, ...]:
        """A running request's place in its run phase (Policy.turn of its last step and admission)."""

    def get(self, request_id: str) -> Request | None: ...

    def running_in(self, tier: str) -> int: ...

    def fastest(self, shape: StepShape, headroom: dict[str, float] | None = None) -> tuple[str, float]:
        """The kernel a step of this shape runs with, and its predicted seconds."""

    def decode_shape(self) -> StepShape:
        """One decode of every running request, as a step."""
