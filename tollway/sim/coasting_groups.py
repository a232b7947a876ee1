"""The simulator's way of carrying plain decodes: as coasting groups (coasting.py), a strategy
the engine's Scheduler takes (scheduler/decode_groups.py).

Each of its calls keeps the plans exactly those of planning every sequence one by one: a coasting group is taken whole only where each member would have
been planned as one decode in its turn, and is woken (brought up to date, then planned one by
one) wherever a check could come out differently. tests/test_coasting.py compares the two.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from tollway.config import SchedulerConfig
from tollway.request import Request, RequestState
from tollway.scheduler.blocks import BlockPool
from tollway.scheduler.decode_groups import DecodeGroups
from tollway.scheduler.plan import Change, ScheduledSeq, StepPlan
from tollway.scheduler.step_budget import StepBudget
from tollway.scheduler.step_model import StepShape
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

    def runs_fast(self, fast_lane) -> bool:
        return super().runs_fast(fast_lane) or any(g.fast for g in self.coasting)

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


class CoastingGroups(DecodeGroups):
    """Only for a policy that coasts (Policy.coasts).

    A step may be suspended (paused between layers for a fast arrival) while fast steps run
    beside it. Its groups are in it and in none of those: they stay as they are until it is
    committed, and are then woken as of it, for the steps beside it broke their run of every
    step."""

    def __init__(self, coasting: Coasting):
        self.coasting = coasting
        self._groups_taken: list[str] = []  # coasting groups in the plan being made
        self._plan_groups: list[CoastStep] = []  # and their shares of it
        self._woken: dict[str, list[Request]] = {}  # coasters woken to be preemptible, by group, this plan

    def attach(self, scheduler) -> None:
        if not scheduler.policy.coasts:
            raise ValueError(f"the {scheduler.config.policy} policy does not coast")
        super().attach(scheduler)
        self.coasting.block_size = scheduler.config.block_size

    def block_pool(self, config: SchedulerConfig) -> BlockPool:
        return PromisingBlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)

    def begin_plan(self, now: float) -> None:
        self._groups_taken, self._plan_groups, self._woken = [], [], {}
        if self.scheduler.suspended_step is not None:
            return  # a step beside it takes only fast requests: batch ones fall due after it
        for coaster in self.coasting.due(now):
            self._wake(coaster, self.scheduler.step_id - 1)

    def fast_decoding(self) -> bool:
        return bool(self.scheduler.policy.fast_lane("fast") and self.coasting.group("fast").count)

    def make_plan(self, step_id: int, seqs: list[ScheduledSeq], kernel: str, preempted: list[str],
                  predicted: float | None, budget: float | None, capped_by: str | None) -> CoastingPlan:
        return CoastingPlan(step_id, seqs, kernel, preempted, predicted, budget, capped_by, tuple(self._plan_groups))

    def before_finish(self, request: Request) -> None:
        coaster = self.coasting.members.get(request.request_id)
        if coaster is not None:  # up to the last committed step
            self._wake(coaster, self.scheduler.committed_step)

    def grouped_decodes(self, shape: StepShape) -> StepShape:
        for group in self.coasting.groups.values():
            # a coaster's next decode starts at its position in this step + 1
            shape = shape.with_decodes(group.count, group.pairs_at(self.scheduler.step_id) + group.count)
        return shape

    def after_commit(self, step_id: int, changed: list[Change], now: float) -> None:
        """Coasters whose last token came in this step finish (and join `changed`); requests
        that got a token and now decode plainly start coasting."""
        s = self.scheduler
        resumed = step_id != s.step_id  # a suspended step, committed after the fast steps beside it
        starting = [] if resumed else [
            c.request for c in changed if c.request.state is RequestState.RUNNING and self._may_coast(c.request, now)]
        held = {name for name in self.coasting.groups if self._held(name)}
        for coaster in self.coasting.finishing(step_id, set(self.coasting.groups) - held if held else None):
            self._wake(coaster, step_id)
            s.finish(coaster.request.request_id, "length")
            changed.append(Change(coaster.request, []))
        if resumed:  # its groups ran in it and not beside it: each member steps on from here
            for coaster in [c for c in self.coasting.members.values() if not s.policy.fast_lane(c.group)]:
                self._wake(coaster, step_id, promised_to=step_id)
        for request in starting:
            left = min(request.params.max_tokens - len(request.output_token_ids),
                       s.max_len(request.tier) - request.num_tokens)  # tokens to come; the last stops it
            s.leave_stepping(request)
            self.coasting.start(request, s.policy.coast_group(request), step_id, s.admitted(request), step_id + left,
                                s.policy.due(request))

    def _may_coast(self, request: Request, now: float) -> bool:
        """Whether every step until its last token would plan it as one plain decode, as far as
        the request itself goes: no stop but its length, no banned tokens, nothing to report
        per token, no drafts, not a batch request that has fallen due."""
        s, params = self.scheduler, request.params
        if request.num_computed_tokens != request.num_tokens - 1 or not request.output_token_ids:
            return False
        if params.stop or params.stop_token_ids or not params.ignore_eos or params.logprobs is not None:
            return False
        if len(request.output_token_ids) < params.min_tokens:
            return False
        if s.policy.fast_lane(request.tier) and s.config.speculative_tokens:
            return False
        if len(s.pool.table(request.request_id)) != s.pool.blocks_for(request.num_computed_tokens):
            return False  # blocks past its KV (rejected drafts): new blocks would not come every block_size
        return not s.policy.is_due(request, now)

    def _held(self, group: str) -> bool:
        """Whether a suspended step holds the group: it is in that step, and in none beside it."""
        return self.scheduler.suspended_step is not None and not self.scheduler.policy.fast_lane(group)

    def _wake(self, coaster: Coaster, last_step: int, promised_to: int | None = None) -> Request:
        """Bring a coaster up to date as of `last_step` (the last step it ran in) and plan it
        one by one from here. `promised_to`: the last step whose blocks it was promised
        (default: the latest plan's, where that took its group, else the one before)."""
        s, request = self.scheduler, coaster.request
        rid = request.request_id
        self.coasting.stop(rid)
        # Its blocks were promised step by step (_take_coasting), through the latest plan if
        # that took its group: hand out those it ran into, give back any it did not.
        pool = s.pool
        blocks_for, had = pool.blocks_for, len(pool.table(rid))
        if promised_to is None:
            promised_to = s.step_id if coaster.group in self._groups_taken else s.step_id - 1
        promised = blocks_for(coaster.offset + promised_to + 1) - had
        used = blocks_for(coaster.offset + last_step + 1) - had
        if promised > used:
            pool.promise(used - promised)
            s.capacity.hold(request.tier, used - promised)
        if used:
            pool.allocate(rid, coaster.offset + last_step + 1, promised=used)
        steps = last_step - coaster.anchor
        if steps > 0:
            request.add_output(self.coasting.tokens(steps))
            request.num_computed_tokens = coaster.computed + steps
            bs = pool.block_size
            if coaster.computed // bs != request.num_computed_tokens // bs:
                pool.cache_full_blocks(rid, request.all_token_ids, request.num_computed_tokens)
            if self.coasting.on_end:
                self.coasting.on_end(request, coaster.anchor + 1, last_step, coaster.offset)
        s.rejoin_stepping(request, max(last_step, coaster.anchor))
        return request

    def _wake_group(self, name: str) -> list[Request]:
        return [self._wake(c, self.scheduler.step_id - 1) for c in list(self.coasting.members.values()) if c.group == name]

    def run_order(self, requests: list[Request], group: str | None, step: StepBudget) -> Iterable[Request]:
        """Where the phase's coasting group falls in its order, the group is taken whole if
        every check would pass for each member, else woken and planned with the rest."""
        s = self.scheduler
        coasters = self.coasting.groups.get(group) if group else None
        if coasters is None or self._held(group):
            yield from requests
            return
        if group in self._woken:  # woken earlier in this step (to be preempted, or not)
            requests = sorted(requests + self._woken.pop(group), key=s.turn_of)
        if coasters.count:
            last = s.step_id - 1  # every coaster ran in the last step
            lo, hi = s.policy.turn(last, coasters.min_admitted), s.policy.turn(last, coasters.max_admitted)
            before = [r for r in requests if s.turn_of(r) < lo]
            after = [r for r in requests if s.turn_of(r) > hi]
            if len(before) + len(after) == len(requests):  # no stepping request's turn falls among the group's
                yield from before
                if coasters.count and self._take_coasting(group, coasters, step):
                    yield from after
                    return
                requests = after
            requests = sorted(self._wake_group(group) + self._woken.pop(group, []) + requests, key=s.turn_of)
        yield from requests

    def _take_coasting(self, name: str, coasters, step: StepBudget) -> bool:
        """Add a coasting group to the step if each member would be planned as one decode in
        turn: the token budget, the sequence cap and the time target allow them all (time grows
        with every feature, so the whole group fitting means each did in turn), and the blocks
        the members' next tokens need are there without preempting anyone."""
        s = self.scheduler
        t, n = s.step_id, coasters.count
        pairs = coasters.pairs_at(t)
        if step.tokens_left < n or step.num_seqs + n > s.config.max_num_seqs:
            return False
        if step.seconds is not None:
            if not s.step_model.monotone:
                return False  # time would not grow with work: the group's sum proves nothing
            must = s.policy.fast_lane(name)  # fast always runs; a miss caps the step
            if not step.shape_fits(step.shape.with_decodes(n, pairs)):
                if not must:
                    return False
                step.capped = True
        needing = coasters.needing_blocks(t)
        if needing:
            need = sum(needing.values())
            if need > s.pool.num_free - max(map(s.capacity.reserve_against, s.tiers)):
                return False
            s.pool.promise(need)  # block ids are handed out when each coaster wakes
            for tier, count in needing.items():
                s.capacity.hold(tier, count)
        step.add_decodes(n, pairs)
        self._plan_groups.append(CoastStep(name, n, pairs, name == "fast"))
        self._groups_taken.append(name)
        return True

    def before_victims(self) -> None:
        """Coasting groups not in this step become preemption candidates, planned one by one
        when their phase comes."""
        for name, group in self.coasting.groups.items():
            if group.count and name not in self._groups_taken and not self._held(name):
                self._woken.setdefault(name, []).extend(self._wake_group(name))
