"""The simulator's scheduler: the engine's Scheduler, with plain decodes coasting (coasting.py).

Every hook of the core (scheduler.py) it fills in keeps the plans exactly those of planning
every sequence one by one: a coasting group is taken whole only where each member would have
been planned as one decode in its turn, and is woken (brought up to date, then planned one by
one) wherever a check could come out differently. tests/test_coasting.py compares the two.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

from tollway.config import SchedulerConfig
from tollway.request import Request, RequestState
from tollway.scheduler.blocks import BlockPool
from tollway.scheduler.plan import Change, StepPlan
from tollway.scheduler.scheduler import Scheduler
from tollway.scheduler.step_budget import StepBudget
from tollway.scheduler.step_model import StepShape, StepTimeModel
from tollway.sim.coasting import Coaster, Coasting, CoastStep


@dataclass
class CoastingPlan(StepPlan):
    """A plan with coasting decodes, by group: only the simulated runner reads them."""

    coasting: tuple[CoastStep, ...] = ()

    @cached_property
    def shape(self) -> StepShape:
        shape = StepShape.of(self)
        for group in self.coasting:
            shape = shape.with_decodes(group.count, group.pairs)
        return shape

    @property
    def num_seqs(self) -> int:
        return len(self.seqs) + sum(g.count for g in self.coasting)

    @property
    def num_tokens(self) -> int:
        return super().num_tokens + sum(g.count for g in self.coasting)

    @property
    def num_decode(self) -> int:
        return super().num_decode + sum(g.count for g in self.coasting)

    @property
    def context_tokens(self) -> int:
        return super().context_tokens + sum(g.pairs for g in self.coasting)

    def groups(self) -> list[tuple[int, int, bool]]:
        """(count, query-key pairs, fast) per group, as attribution.shares takes them."""
        return [(g.count, g.pairs, g.fast) for g in self.coasting]


class PromisingBlockPool(BlockPool):
    """A block pool that can count blocks as taken before handing out their ids: coasting
    decodes take their blocks as a number per step, and their ids when they stop coasting."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._promised = 0

    @property
    def num_free(self) -> int:
        return super().num_free - self._promised

    def promise(self, count: int) -> None:
        """Count `count` blocks as taken now (a negative count gives them back). The caller
        checks num_free first."""
        self._promised += count

    def allocate(self, owner: str, num_tokens: int, reserve: int = 0, promised: int = 0) -> bool:
        """BlockPool.allocate, where `promised` of the blocks were promised already."""
        self._promised -= promised
        if super().allocate(owner, num_tokens, reserve):
            return True
        self._promised += promised
        return False


class CoastingScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, coasting: Coasting, step_model: StepTimeModel | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """Only for a policy that coasts (Policy.coasts)."""
        super().__init__(config, step_model, clock)
        if not self.policy.coasts:
            raise ValueError(f"the {config.policy} policy does not coast")
        self.pool = PromisingBlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._coasting = coasting
        coasting.block_size = config.block_size
        self._stepping = {}  # the running requests that do not coast
        self._groups_taken: list[str] = []  # coasting groups in the plan being made
        self._plan_groups: list[CoastStep] = []  # and their shares of it
        self._woken: dict[str, list[Request]] = {}  # coasters woken to be preemptible, by group, this plan

    def _begin_plan(self, now: float) -> None:
        self._groups_taken, self._plan_groups, self._woken = [], [], {}
        for coaster in self._coasting.due(now):
            self._wake(coaster, self._step_id - 1)

    def _fast_decoding(self) -> bool:
        return bool(self.policy.fast_lane("fast") and self._coasting.group("fast").count) or super()._fast_decoding()

    def _make_plan(self, step: StepBudget, kernel: str, preempted: list[str], predicted: float | None) -> CoastingPlan:
        return CoastingPlan(self._step_id, step.seqs, kernel, preempted, predicted, step.budget(kernel),
                            step.lane if step.capped else None, tuple(self._plan_groups))

    def _before_finish(self, request: Request) -> None:
        coaster = self._coasting.members.get(request.request_id)
        if coaster is not None:  # up to the last committed step
            self._wake(coaster, self._step_id - (self._in_flight is not None))

    def _grouped_decodes(self, shape: StepShape) -> StepShape:
        for group in self._coasting.groups.values():
            # a coaster's next decode starts at its position in this step + 1
            shape = shape.with_decodes(group.count, group.pairs_at(self._step_id) + group.count)
        return shape

    def _after_commit(self, step_id: int, changed: list[Change], now: float) -> None:
        """Coasters whose last token came in this step finish (and join `changed`); requests
        that got a token and now decode plainly start coasting."""
        starting = [c.request for c in changed if c.request.state is RequestState.RUNNING and self._may_coast(c.request, now)]
        for coaster in self._coasting.finishing(step_id):
            self._wake(coaster, step_id)
            self._finish(coaster.request, "length")
            changed.append(Change(coaster.request, []))
        for request in starting:
            rid = request.request_id
            left = min(request.params.max_tokens - len(request.output_token_ids),
                       self.max_len(request.tier) - request.num_tokens)  # tokens to come; the last stops it
            del self._stepping[rid]
            self._coasting.start(request, self.policy.coast_group(request), step_id, self._entries[rid].admitted, step_id + left,
                                 self.policy.due(request))

    def _may_coast(self, request: Request, now: float) -> bool:
        """Whether every step until its last token would plan it as one plain decode, as far as
        the request itself goes: no stop but its length, no banned tokens, nothing to report
        per token, no drafts, not a batch request that has fallen due."""
        params = request.params
        if request.num_computed_tokens != request.num_tokens - 1 or not request.output_token_ids:
            return False
        if params.stop or params.stop_token_ids or not params.ignore_eos or params.logprobs is not None:
            return False
        if len(request.output_token_ids) < params.min_tokens:
            return False
        if self.policy.fast_lane(request.tier) and self.config.speculative_tokens:
            return False
        if len(self.pool.table(request.request_id)) != self.pool.blocks_for(request.num_computed_tokens):
            return False  # blocks past its KV (rejected drafts): new blocks would not come every block_size
        return not self.policy.is_due(request, now)

    def _wake(self, coaster: Coaster, last_step: int) -> Request:
        """Bring a coaster up to date as of `last_step` (the last step it ran in) and plan it
        one by one from here."""
        request = coaster.request
        rid = request.request_id
        self._coasting.stop(rid)
        # Its blocks were promised step by step (_take_coasting), through the latest plan if
        # that took its group: hand out those it ran into, give back any it did not.
        blocks_for, had = self.pool.blocks_for, len(self.pool.table(rid))
        promised_to = self._step_id if coaster.group in self._groups_taken else self._step_id - 1
        promised = blocks_for(coaster.offset + promised_to + 1) - had
        used = blocks_for(coaster.offset + last_step + 1) - had
        if promised > used:
            self.pool.promise(used - promised)
            self._held[request.tier] -= promised - used
        if used:
            self.pool.allocate(rid, coaster.offset + last_step + 1, promised=used)
        steps = last_step - coaster.anchor
        if steps > 0:
            request.add_output(self._coasting.tokens(steps))
            request.num_computed_tokens = coaster.computed + steps
            bs = self.pool.block_size
            if coaster.computed // bs != request.num_computed_tokens // bs:
                self.pool.cache_full_blocks(rid, request.all_token_ids, request.num_computed_tokens)
            self._entries[rid].last_step = last_step
            if self._coasting.on_end:
                self._coasting.on_end(request, coaster.anchor + 1, last_step, coaster.offset)
        self._stepping[rid] = request
        return request

    def _wake_group(self, name: str) -> list[Request]:
        return [self._wake(c, self._step_id - 1) for c in list(self._coasting.members.values()) if c.group == name]

    def _run_order(self, requests: list[Request], group: str | None, step: StepBudget) -> Iterable[Request]:
        """A run phase's requests to plan one by one, in order; where the phase's coasting group
        falls in that order, the group is taken whole if every check would pass for each member,
        else woken and planned with the rest."""
        coasters = self._coasting.groups.get(group) if group else None
        if coasters is None:
            yield from requests
            return
        if group in self._woken:  # woken earlier in this step (to be preempted, or not)
            requests = sorted(requests + self._woken.pop(group), key=self.turn_of)
        if coasters.count:
            last = self._step_id - 1  # every coaster ran in the last step
            lo, hi = self._turn(last, coasters.min_admitted), self._turn(last, coasters.max_admitted)
            before = [r for r in requests if self.turn_of(r) < lo]
            after = [r for r in requests if self.turn_of(r) > hi]
            if len(before) + len(after) == len(requests):  # no stepping request's turn falls among the group's
                yield from before
                if coasters.count and self._take_coasting(group, coasters, step):
                    yield from after
                    return
                requests = after
            requests = sorted(self._wake_group(group) + self._woken.pop(group, []) + requests, key=self.turn_of)
        yield from requests

    def _take_coasting(self, name: str, coasters, step: StepBudget) -> bool:
        """Add a coasting group to the step if each member would be planned as one decode in
        turn: the token budget, the sequence cap and the time target allow them all (time grows
        with every feature, so the whole group fitting means each did in turn), and the blocks
        the members' next tokens need are there without preempting anyone."""
        t, n = self._step_id, coasters.count
        pairs = coasters.pairs_at(t)
        if step.tokens_left < n or step.num_seqs + n > self.config.max_num_seqs:
            return False
        if step.seconds is not None:
            if not self.step_model.monotone:
                return False  # time would not grow with work: the group's sum proves nothing
            must = self.policy.fast_lane(name)  # fast always runs; a miss caps the step
            if not step.shape_fits(step.shape.with_decodes(n, pairs)):
                if not must:
                    return False
                step.capped = True
        needing = coasters.needing_blocks(t)
        if needing:
            need = sum(needing.values())
            if need > self.pool.num_free - max(map(self._reserve_against, self.tiers)):
                return False
            self.pool.promise(need)  # block ids are handed out when each coaster wakes
            for tier, count in needing.items():
                self._held[tier] += count
        step.add_decodes(n, pairs)
        self._plan_groups.append(CoastStep(name, n, pairs, name == "fast"))
        self._groups_taken.append(name)
        return True

    def _before_victims(self) -> None:
        """Coasting groups not in this step become preemption candidates, planned one by one
        when their phase comes."""
        for name, group in self._coasting.groups.items():
            if group.count and name not in self._groups_taken:
                self._woken.setdefault(name, []).extend(self._wake_group(name))
