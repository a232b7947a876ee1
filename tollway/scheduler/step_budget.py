"""A step being planned against its limits: the token budget, the sequence cap, and a time
target that the step model's predictions, stretched by their recent overruns, must meet."""
from __future__ import annotations

from typing import NamedTuple

from tollway.scheduler.plan import ScheduledSeq
from tollway.scheduler.step_model import StepShape


class TimeTarget(NamedTuple):
    """The step should finish within `seconds` in `quantile` of steps; `lane` set the target."""

    seconds: float
    quantile: float
    lane: str


class StepBudget:
    """The plan being built, with its predicted time against the step's time target: how many
    tokens of a sequence still fit, and whether a shape does."""

    def __init__(self, sched, target: TimeTarget | None, fast_decoding: bool = False):
        """`target`: the step should finish within its seconds in that
        fraction of steps. Predictions are stretched by the model's recent overrun at that
        quantile, per kernel, so that measured steps, not predicted ones, meet it.
        `fast_decoding`: a fast request is past its prefill, so its TPOT is at stake; otherwise
        a fast prefill is about TTFT and goes in whole."""
        self.sched = sched
        self.seconds = target.seconds if target else None  # None: only the token budget and seq cap limit the step
        self.lane = target.lane if target else None
        self.capped = False  # the target left work out of this step
        self.fast_decoding = fast_decoding
        model = sched.step_model
        self.headroom = {k: model.headroom(k, target.quantile, near=target.seconds) for k in model.coefficients} if target else {}
        self.tokens_left = sched.config.max_num_batched_tokens
        self.seqs: list[ScheduledSeq] = []
        self.num_seqs = 0
        self.shape = StepShape("")

    def predict(self, shape: StepShape) -> float:
        return self.sched.fastest(shape, self.headroom)[1]

    def stretched(self, shape: StepShape) -> float:
        """`shape`'s predicted seconds stretched by the overrun the target plans for: the
        time it is expected to take."""
        kernel, seconds = self.sched.fastest(shape, self.headroom)
        return seconds * self.headroom.get(kernel, 1.0)

    def budget(self, kernel: str) -> float | None:
        """The target in predicted seconds for the step's kernel: what the plan was fitted to."""
        if self.seconds is None:
            return None
        return self.seconds / self.headroom.get(kernel, 1.0)

    def chunk(self, start: int, remaining: int, samples_at_end: bool, must: bool, at_least: int = 0) -> int:
        """Most of `remaining` tokens (from position `start`) that fit in this step; 0 if none.
        `must` (a fast request) gets at least one block's worth even past the time budget, and
        `at_least` tokens (given only to it), and all it can while no fast request decodes (its
        time to first token is what counts then); the step's first sequence gets a block's worth too."""
        n = min(remaining, self.tokens_left)
        if n <= 0 or self.num_seqs >= self.sched.config.max_num_seqs:
            return 0
        if self.seconds is None or (must and not self.fast_decoding):
            return n
        lo, hi = 0, n  # the largest fitting count: time grows with tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits(start, mid, int(mid == remaining and samples_at_end)):
                lo = mid
            else:
                hi = mid - 1
        self.capped |= lo < n
        # A fast request, and the first sequence of a step, get a block's worth past the
        # budget: fast is never starved, and a step that nothing fits would run empty forever
        # (waiting shrinks no step), while the work it turned away never ran.
        if must or not self.num_seqs:
            lo = max(lo, min(n, max(self.sched.pool.block_size, at_least)))
        return lo

    def fast_prefill_share(self, request, start: int, remaining: int, now: float) -> int:
        """Tokens of a fast prompt's prefill this step takes even past the TPOT target that
        fast decodes hold it to. What remains is cut into as many chunks as there are steps
        before its TTFT target, counting each step as the step model predicts it (a chunk
        costs its step's fixed cost again, so a chunked step runs past the TPOT target): a
        prompt that two steps cannot finish in time goes in whole."""
        fast = self.sched.tiers["fast"]
        if remaining <= 1 or not fast.ttft_target or not fast.tpot_target:
            return 0
        left = fast.ttft_target - (now - request.arrival_time)
        steps = int(left / fast.tpot_target)
        while steps > 1 and self.sched.step_model is not None and \
                steps * self.stretched(self.shape.plus(start, -(-remaining // steps), 1)) > left:
            steps -= 1
        return remaining if steps <= 1 else -(-remaining // steps)

    def fits(self, start: int, n: int, logit_rows: int) -> bool:
        """Whether this step, plus n tokens from `start`, is predicted to meet its time target."""
        return self.shape_fits(self.shape.plus(start, n, logit_rows))

    def shape_fits(self, shape: StepShape) -> bool:
        if self.seconds is None:
            return True
        return self.stretched(shape) <= self.seconds

    def add(self, seq: ScheduledSeq) -> None:
        self.seqs.append(seq)
        self.num_seqs += 1
        self.tokens_left -= seq.num_new
        self.shape = self.shape.plus(seq.start_pos, seq.num_new, seq.num_logit_rows)

    def add_decodes(self, count: int, pairs: int) -> None:
        """`count` single-token decodes reading `pairs` query-key pairs in all, taken as one."""
        self.num_seqs += count
        self.tokens_left -= count
        self.shape = self.shape.with_decodes(count, pairs)
