"""What one turn of the engine did, handed whole to whoever watches steps (metrics, the meter,
the dashboard's record, the simulator's engine run), so that none of them reads the engine."""
from __future__ import annotations

from dataclasses import dataclass

from tollway.outputs import RequestOutput
from tollway.scheduler.occupancy import Occupancy
from tollway.scheduler.plan import StepPlan, StepResult
from tollway.scheduler.step_model import StepTimeModel


@dataclass(frozen=True)
class StepReport:
    plan: StepPlan | None  # None where no step ran to its end: one paused, or none was due
    result: StepResult | None
    outputs: list[RequestOutput]  # new tokens and text, and the final output of each request that ended
    occupancy: Occupancy  # what the scheduler holds after it
    preempted_tiers: tuple[str, ...] = ()  # the lane of each request the step preempted
    step_model: StepTimeModel | None = None  # the model the step was planned with (it learns from each step)
    paused: bool = False  # a step stopped between layers for a fast arrival (it runs on in slices)

    @property
    def ran(self) -> bool:
        """A step with sequences ran to its end: the plan and result are both here."""
        return self.result is not None and self.plan is not None and bool(self.plan.seqs)
