"""How the scheduler carries running requests that it does not plan one by one: here, none.

The engine plans every running request in every step. The simulator plugs in a strategy that
carries plain decodes as groups (sim/coasting_groups.py), through these calls; each is made at
one point of Scheduler.plan or commit, and the scheduler's public surface is all a strategy
needs to keep its books.
"""
from __future__ import annotations

from collections.abc import Iterable

from tollway.config import SchedulerConfig
from tollway.request import Request
from tollway.scheduler.blocks import BlockPool
from tollway.scheduler.plan import Change, ScheduledSeq, StepPlan
from tollway.scheduler.step_budget import StepBudget
from tollway.scheduler.step_model import StepShape


class DecodeGroups:
    """Every running request planned one by one."""

    def attach(self, scheduler) -> None:
        """The scheduler this strategy carries groups for; called once, from its __init__."""
        self.scheduler = scheduler

    def block_pool(self, config: SchedulerConfig) -> BlockPool:
        return BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)

    def begin_plan(self, now: float) -> None:
        """A plan starts (its step id and clock set)."""

    def fast_decoding(self) -> bool:
        """Whether a fast request in a group is past its prefill."""
        return False

    def run_order(self, requests: list[Request], group: str | None, step: StepBudget) -> Iterable[Request]:
        """A run phase's requests to plan one by one, in order (`group`: the phase's name for
        its group); a group may join `step` whole on the way."""
        return requests

    def grouped_decodes(self, shape: StepShape) -> StepShape:
        """`shape` with the next decodes of the requests in groups."""
        return shape

    def before_victims(self) -> None:
        """Victims are about to be chosen among the requests planned one by one."""

    def make_plan(self, step_id: int, seqs: list[ScheduledSeq], kernel: str, preempted: list[str],
                  predicted: float | None, budget: float | None, capped_by: str | None) -> StepPlan:
        return StepPlan(step_id, seqs, kernel, preempted, predicted, budget, capped_by)

    def after_commit(self, step_id: int, changed: list[Change], now: float) -> None:
        """A step is committed; `changed` may grow."""

    def before_finish(self, request: Request) -> None:
        """`request` is about to be finished from outside a step (an abort)."""
