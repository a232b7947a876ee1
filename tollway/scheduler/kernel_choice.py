"""The linear-layer kernel a step runs with, chosen by the step model's predictions."""
from __future__ import annotations

from tollway.config import SchedulerConfig
from tollway.scheduler.step_model import StepShape, StepTimeModel


class KernelChoice:
    def __init__(self, config: SchedulerConfig, model: StepTimeModel | None):
        self.config, self.model = config, model
        # With kernel="auto", the kernels a step may pick between, ruled by the model: all, and
        # all but int8 (past the crossover; see fastest). Worked out once: fastest runs for
        # every sequence a step considers.
        auto = [k for k in sorted(config.kernels_to_load()) if model and k in model.coefficients] \
            if config.kernel == "auto" else []
        self._candidates = (auto, [k for k in auto if k != "int8"])

    def fastest(self, shape: StepShape, headroom: dict[str, float] | None = None) -> tuple[str, float]:
        """The kernel a step of this shape runs with, and its predicted seconds (0 without a
        step model). With kernel="auto" and a step model, the loaded kernel predicted fastest
        (stretched by `headroom` when shaping to a target), so adding work never makes a step
        look faster; else the measured crossover. int8 is a candidate only up to the
        crossover: past it the model has never seen int8 steps, and its extrapolation is not
        to be trusted."""
        config, model = self.config, self.model
        if model is None:
            return config.kernel_for(shape.tokens), 0.0
        known = self._candidates[shape.tokens > config.int8_max_tokens] if self._candidates[0] else []
        if len(known) < 2:
            kernel = known[0] if known else config.kernel_for(shape.tokens)
            return kernel, model.predict(shape, kernel)
        headroom = headroom or {}
        predicted = {k: model.predict(shape, k) for k in known}
        kernel = min(known, key=lambda k: predicted[k] * headroom.get(k, 1.0))
        return kernel, predicted[kernel]
