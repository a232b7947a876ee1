"""StepPlan and StepResult: the whole contract between the scheduler and the runner; and
Change, what committing a StepResult did to one request."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from tollway.request import Request, SamplingParams
from tollway.scheduler.step_model import StepShape


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step: compute KV for `token_ids` at positions start_pos..,
    then sample the next token if `sample` (the chunk reaches the end of the known tokens).

    When speculating, the last `num_draft` of token_ids are guesses, not yet the request's:
    the runner samples at each of the last num_draft + 1 positions and keeps the guesses up to
    the first one the model disagrees with, plus the token it sampled there.

    A tuple, immutable as the runner needs, and cheap to make: one is made per running
    sequence per step, a hundred million times in a large simulation."""

    request_id: str
    tier: str
    token_ids: tuple[int, ...]
    start_pos: int  # tokens already in the KV cache before this step
    block_table: tuple[int, ...]
    sample: bool
    params: SamplingParams
    num_draft: int = 0
    banned_token_ids: tuple[int, ...] = ()  # not to be sampled this step (min_tokens, bad words)
    # How often the request generated each token before this step, where its penalties count
    # them: the request's own, not a copy (it changes only when the step that holds it commits).
    output_counts: dict[int, int] | None = None
    grammar: object | None = None  # the request's (Request.grammar), for the runner's masks
    tab: object | None = None  # the request's meter tab (Request.tab), charged its share of the step
    # Prompt logprobs: the prompt tokens that follow the chunk's first len(scored_ids) positions,
    # whose logits the step scores them by (Request.prompt_to_score); empty for most.
    scored_ids: tuple[int, ...] = ()
    # Its prompt's and output's distinct tokens before this step, where repetition_penalty counts
    # them (the request's own, like output_counts).
    seen_token_ids: set[int] | None = None

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft:]

    @property
    def num_logit_rows(self) -> int:
        """Positions whose logits the step needs: the LM head's rows."""
        return self.num_draft + 1 if self.sample else 0

    @property
    def num_new(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        return self.num_new == 1 and self.start_pos > 0

    @property
    def is_generation(self) -> bool:
        """Past its prompt: one new token to sample, with or without drafts to verify."""
        return self.sample and self.start_pos > 0 and self.num_new == self.num_draft + 1

    def check(self, step_id: int, tokens: list[SampledToken]) -> None:
        """That a step's result for this sequence is its accepted drafts, then one token."""
        if not 1 <= len(tokens) <= self.num_draft + 1:
            raise ValueError(f"step {step_id} result has {len(tokens)} sampled tokens for {self.request_id}, "
                             f"expected 1..{self.num_draft + 1}")
        if tuple(t.token_id for t in tokens[:-1]) != self.drafts[:len(tokens) - 1]:
            raise ValueError(f"step {step_id} result for {self.request_id} keeps tokens that are not its drafts")

    def __str__(self) -> str:
        if self.num_draft:
            kind = f"decode + {self.num_draft} drafts"
        else:
            kind = "decode" if self.is_decode else f"prefill {self.start_pos}..{self.context_len}"
        return f"{self.request_id}[{self.tier}] {kind}"


@dataclass
class StepPlan:
    step_id: int
    seqs: list[ScheduledSeq]
    kernel: str  # "int8" | "bf16" | "fp32": which linear-layer kernel the runner uses
    preempted: list[str] = field(default_factory=list)
    predicted_seconds: float | None = None  # the step model's forecast, when there is one
    budget_seconds: float | None = None  # the time the step was shaped to fit, if any
    capped_by: str | None = None  # the lane whose time target left work out of this step

    @cached_property
    def shape(self) -> StepShape:
        """What the step model sees of this step (once the plan is final)."""
        return StepShape.of(self)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)

    @property
    def num_decode(self) -> int:
        return sum(1 for s in self.seqs if s.is_decode or s.num_draft)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs if not (s.is_decode or s.num_draft))

    @property
    def context_tokens(self) -> int:
        return sum(s.context_len for s in self.seqs)

    def runs_fast(self, fast_lane) -> bool:
        """Whether a request of a fast lane (`fast_lane(tier)`) is in the step."""
        return any(fast_lane(s.tier) for s in self.seqs)

    def __str__(self) -> str:
        parts = [f"step {self.step_id}: {self.num_decode} decode"]
        prefills = [s for s in self.seqs if not (s.is_decode or s.num_draft)]
        if prefills:
            parts.append(f"+ {len(prefills)} prefill ({self.num_prefill_tokens} tok)")
        parts.append(f"over {self.context_tokens} ctx, kernel {self.kernel}")
        if self.predicted_seconds is not None:
            budget = f" of {self.budget_seconds * 1e3:.0f} ms" if self.budget_seconds else ""
            budget += f", capped by {self.capped_by}" if self.capped_by else ""
            parts.append(f"predicted {self.predicted_seconds * 1e3:.0f} ms{budget}")
        drafts = sum(s.num_draft for s in self.seqs)
        if drafts:
            parts.append(f"({drafts} draft tokens)")
        if self.preempted:
            parts.append(f"; preempted {', '.join(self.preempted)}")
        return " ".join(parts)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass
class StepResult:
    step_id: int
    # Only for sequences with sample=True: the accepted drafts (if any), then the sampled token.
    tokens: dict[str, list[SampledToken]]
    seconds: float
    # Of `seconds`, what was one request's work alone (its grammar's mask): charged to it, not shared.
    own_seconds: dict[str, float] = field(default_factory=dict)
    # For sequences with scored_ids: an entry per scored token (Request.prompt_logprobs').
    prompt_logprobs: dict[str, list[dict]] = field(default_factory=dict)


class Change(NamedTuple):
    """What a commit did to one request: the tokens it appended (none for a coaster the
    simulator caught up; see sim/coasting_groups.py), and whether it finished (on the
    request: finished, finish_reason)."""

    request: Request
    new_token_ids: list[int]
