"""Continuous batching over the block pool: queues, admission, preemption, step shaping -> StepPlan.

One token-budget model for prefill and decode alike (as in vLLM v1): every request knows how
many of its tokens have KV in the cache (num_computed_tokens), and each step gives it up to
num_tokens - num_computed_tokens more. A long prompt is thus cut into chunks that share steps
with running decodes instead of stalling them.

Three policies (policies.py: fcfs, priority, lanes) share this code, so they can be measured
on one engine; each answers what a step considers and in what order, whom a request may
preempt, and the time a step must meet (step_budget.py).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from tollway.config import SchedulerConfig
from tollway.request import InvalidRequest, QueueFullError, Request, RequestState
from tollway.scheduler.capacity import TierCapacity
from tollway.scheduler.decode_groups import DecodeGroups
from tollway.scheduler.kernel_choice import KernelChoice
from tollway.scheduler.plan import Change, ScheduledSeq, StepPlan, StepResult
from tollway.scheduler.policies import POLICY_TYPES
from tollway.scheduler.speculation import Acceptance, Drafter
from tollway.scheduler.step_budget import StepBudget
from tollway.scheduler.step_model import StepShape, StepTimeModel


class Scheduler:
    def __init__(self, config: SchedulerConfig, step_model: StepTimeModel | None = None,
                 clock: Callable[[], float] = time.monotonic, groups: DecodeGroups | None = None):
        """`step_model` shapes steps under the lanes policy (without one, only token budgets
        apply); `clock` stamps request times (the simulator passes its own, and `groups`, its
        way of carrying plain decodes)."""
        config.validate()
        if config.kernel == "auto" and config.int8_max_tokens is None:
            raise ValueError("kernel='auto' needs int8_max_tokens: measure it (the engine does at first start) or set it")
        self.config = config
        self.tiers = config.tiers
        self.policy = POLICY_TYPES[config.policy](self)
        self.step_model = step_model  # sets _kernels
        self.clock = clock
        self.groups = groups or DecodeGroups()
        self.groups.attach(self)
        self.pool = self.groups.block_pool(config)
        self.capacity = TierCapacity(config, self.pool)
        # Read-only views for metrics.
        self.waiting: dict[str, deque[Request]] = {t: deque() for t in self.tiers}
        self.running: dict[str, Request] = {}  # admission order, newest last
        self._stepping: dict[str, Request] = {}  # the running requests not in a group: planned one by one
        self._entries: dict[str, _Entry] = {}  # every unfinished request's scheduling state
        self.speculation = Acceptance()  # all drafts so far, for metrics
        self._counter = 0
        self._step_id = 0
        self._in_flight: dict[str, Request] | None = None  # the latest plan's, until committed
        self._in_flight_step = 0  # that plan's step id
        # A plan whose step stopped partway (suspend), with its step id, and the requests of it
        # that finished meanwhile: their blocks are freed once its step has ended writing them.
        self._suspended: tuple[int, dict[str, Request]] | None = None
        self._release_after_suspended: list[Request] = []

    # ---- requests in and out ------------------------------------------------------------

    def max_len(self, tier: str) -> int:  # longest request (prompt + output) a tier can run
        return self.capacity.max_len(tier)

    def add(self, request: Request) -> None:
        """Queue a request checked at the edge (its Submission); refused here only for what the
        scheduler alone knows: an unknown tier, an id in use, a prompt past its lane's share of
        the KV pool, a full queue."""
        rid = request.request_id
        num_prompt = len(request.prompt_token_ids)
        if request.tier not in self.tiers:
            raise ValueError(f"unknown tier {request.tier!r}; tiers are {', '.join(self.tiers)}")
        if rid in self._entries or any(r.request_id == rid for r in self._release_after_suspended):
            raise ValueError(f"request id {rid!r} is already in use")
        if num_prompt >= self.max_len(request.tier):
            raise InvalidRequest(
                f"prompt is {num_prompt} tokens, but the KV cache holds only {self.max_len(request.tier) - 1} "
                f"for the {request.tier} tier ({self.pool.num_blocks} blocks of {self.pool.block_size})", "prompt")
        queue = self.waiting[request.tier]
        if len(queue) >= self.tiers[request.tier].max_queue:
            raise QueueFullError(request.tier, self.tiers[request.tier].max_queue)
        request.state = RequestState.WAITING
        self._entries[rid] = _Entry(request, self._tick())
        queue.append(request)
        self.policy.queued(request)

    def finish(self, request_id: str, reason: str) -> Request | None:
        """Finish a waiting or running request from outside a step (an abort) and free its
        blocks. Returns it, or None if no unfinished request has this id."""
        request = self.get(request_id)
        if request is not None:
            self.groups.before_finish(request)
            self._finish(request, reason)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, "abort")

    def get(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are forgotten)."""
        entry = self._entries.get(request_id)
        return entry.request if entry is not None else None

    def has_unfinished(self) -> bool:
        return bool(self._entries)

    def request_ids(self) -> list[str]:
        """Every unfinished request, waiting or running."""
        return list(self._entries)

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self._entries)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def step_model(self) -> StepTimeModel | None:
        return self._step_model

    @step_model.setter
    def step_model(self, model: StepTimeModel | None) -> None:
        self._step_model = model
        self._kernels = KernelChoice(self.config, model)

    def kernel_for(self, shape: StepShape, headroom: dict[str, float] | None = None) -> str:
        return self.fastest(shape, headroom)[0]

    def fastest(self, shape: StepShape, headroom: dict[str, float] | None = None) -> tuple[str, float]:
        """The kernel a step of this shape runs with, and its predicted seconds (kernel_choice.py)."""
        return self._kernels.fastest(shape, headroom)

    def running_in(self, tier: str) -> int:
        return self.capacity.running_in(tier)

    # ---- what a policy reads (scheduler_view.py) ----------------------------------------------

    def stepping(self) -> Iterable[Request]:
        """The running requests planned one by one: all of them but those in groups."""
        return self._stepping.values()

    def arrival(self, request: Request) -> int:
        """An unfinished request's place in the order requests came in."""
        return self._entries[request.request_id].arrival

    def admitted(self, request: Request) -> int:
        """A running request's place in admission order, newest largest (again after a preemption)."""
        return self._entries[request.request_id].admitted

    def turn_of(self, request: Request) -> tuple[int, ...]:
        """A running request's place in its run phase: lanes runs the longest-skipped first,
        then by admission; fcfs by admission."""
        entry = self._entries[request.request_id]
        return self.policy.turn(entry.last_step, entry.admitted)

    def decode_shape(self) -> StepShape:
        """The step of one decode for every running request."""
        shape = StepShape("")
        for r in self._stepping.values():
            shape = shape.plus(r.num_tokens, 1, 1)
        return self.groups.grouped_decodes(shape)

    # ---- what a strategy of groups uses (decode_groups.py) -----------------------------------

    @property
    def step_id(self) -> int:
        """The latest plan's step id."""
        return self._step_id

    @property
    def committed_step(self) -> int:
        """The latest committed step's id."""
        return self._step_id - (self._in_flight is not None)

    def leave_stepping(self, request: Request) -> None:
        """A running request joins a group: no longer planned one by one."""
        del self._stepping[request.request_id]

    def rejoin_stepping(self, request: Request, last_step: int) -> None:
        """A request leaves its group, having run in every step up to `last_step`."""
        self._entries[request.request_id].last_step = last_step
        self._stepping[request.request_id] = request

    # ---- the step -----------------------------------------------------------------------

    def suspend(self) -> None:
        """The plan in flight stopped partway (its step paused between layers): until resume(),
        plans may be made and committed beside it. They take only fast requests that are not in
        it, and preempt none of its requests; one of its requests that finishes meanwhile (an
        abort) keeps its blocks until the suspended plan is committed, for its step still writes
        them."""
        if self._in_flight is None or self._suspended is not None:
            raise ValueError("only the plan in flight can be suspended, and one at a time")
        self._suspended, self._in_flight = (self._in_flight_step, self._in_flight), None

    @property
    def suspended_step(self) -> int | None:
        """The step id of the suspended plan, if one is."""
        return self._suspended[0] if self._suspended is not None else None

    def may_pause(self, plan: StepPlan) -> bool:
        """Whether the step may stop between layers for a fast arrival: not a step fast requests
        are in (it is shaped to their target already), and only under a policy with a fast lane."""
        fast_lane = self.policy.fast_lane
        return bool(self.config.pause_layers) and fast_lane("fast") and not plan.runs_fast(fast_lane)

    def resume(self) -> None:
        """The suspended plan is again the one in flight, to be committed next."""
        if self._suspended is None or self._in_flight:  # an empty plan beside it needs no commit
            raise ValueError("nothing is suspended, or a plan beside it is still in flight")
        (self._in_flight_step, self._in_flight), self._suspended = self._suspended, None

    def plan(self) -> StepPlan:
        self._step_id += 1
        self._in_flight = {}
        self._in_flight_step = self._step_id
        now = self.clock()
        self.groups.begin_plan(now)
        step = StepBudget(self, self.policy.time_target(now), self._fast_decoding() or self.groups.fast_decoding())
        preempted: list[str] = []
        for kind, requests, group in self.policy.phases(now):
            if self._suspended is not None:
                requests = [r for r in requests if self.policy.fast_lane(r.tier) and r.request_id not in self._suspended[1]]
            if kind == "run":
                for request in self.groups.run_order(requests, group, step):
                    if request.state is RequestState.RUNNING:  # else preempted earlier in this step
                        self._continue(request, step, preempted, now)
            # Admitting right after preempting would only hand the freed blocks to a newcomer
            # and thrash; vLLM makes the same call. Fast is the exception: it preempts to get in.
            elif kind == "admit fast" or not preempted:
                self._admit(requests, step, preempted, now, force=kind == "admit fast")
        for request in self._in_flight.values():
            request.last_planned = now
        kernel, predicted = self.fastest(step.shape, step.headroom)
        predicted = predicted if self.step_model and step.num_seqs else None
        return self.groups.make_plan(self._step_id, step.seqs, kernel, preempted, predicted, step.budget(kernel),
                                     step.lane if step.capped else None)

    def commit(self, plan: StepPlan, result: StepResult) -> list[Change]:
        """Apply a step's outcome; what changed for each request that got a token (and perhaps
        finished: every reason to finish is decided here, a stop string or a grammar by the
        request's follower)."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} committed with the plan of step {plan.step_id}")
        if self._in_flight is None or plan.step_id != self._in_flight_step:
            raise ValueError(f"step {plan.step_id} is not the uncommitted plan in flight")
        if self.step_model is not None and plan.num_seqs:
            self.step_model.observe(plan.shape, result.seconds - sum(result.own_seconds.values()))
        bs = self.pool.block_size
        now = self.clock()
        changed: list[Change] = []
        for seq in plan.seqs:
            request = self._in_flight[seq.request_id]
            if request.state is not RequestState.RUNNING:
                continue  # finished or aborted while the step ran
            request.num_steps += 1
            rid = request.request_id
            if seq.scored_ids:
                request.prompt_logprobs.extend(result.prompt_logprobs.get(rid, ()))
            tokens = result.tokens.get(rid, []) if seq.sample else []
            if seq.sample and (seq.num_draft or len(tokens) != 1):  # one token, no drafts: nothing to check
                seq.check(plan.step_id, tokens)
            if seq.num_draft:
                self._entries[rid].drafter.acceptance.add(seq.num_draft, len(tokens) - 1)
                self.speculation.add(seq.num_draft, len(tokens) - 1)
            # KV is valid up to the last token fed that the model agreed with.
            request.num_computed_tokens = seq.context_len - seq.num_draft + max(0, len(tokens) - 1)
            reason, first_new = None, len(request.output_token_ids)
            for token in tokens:
                request.add_output((token.token_id,))
                if token.logprob is not None:
                    request.output_logprobs.append({"token_id": token.token_id, "logprob": token.logprob,
                                                    "top_logprobs": token.top_logprobs})
                reason = request.stop_reason(token.token_id, self.max_len(request.tier))
                if reason is not None:
                    break  # accepted drafts past a stop are dropped
            if seq.start_pos // bs != request.num_computed_tokens // bs:
                self.pool.cache_full_blocks(rid, request.all_token_ids, request.num_computed_tokens)
            if not tokens:
                continue
            if request.first_token_time is None:
                request.first_token_time, request.steps_to_first_token = now, request.num_steps
            if reason is not None:
                self._finish(request, reason)
            changed.append(Change(request, request.output_token_ids[first_new:]))
        self._in_flight = None
        if self._suspended is None:
            for request in self._release_after_suspended:
                self._release(request)
            self._release_after_suspended.clear()
        self.groups.after_commit(plan.step_id, changed, now)
        return changed

    def _fast_decoding(self) -> bool:
        """Whether a fast request is past its prefill: its TPOT is then at stake."""
        return any(r.tier == "fast" and r.num_computed_tokens == r.num_tokens - 1 for r in self._stepping.values())

    def _victims(self, request: Request) -> list[Request]:
        """Running requests `request` may preempt for room, first choice first; only ones not
        yet in this step's plan."""
        self.groups.before_victims()
        suspended = self._suspended[1] if self._suspended is not None else {}
        others = [r for r in self._stepping.values()
                  if r.request_id not in self._in_flight and r.request_id not in suspended and r is not request]
        return self.policy.victims(request, others)

    # ---- mechanics ----------------------------------------------------------------------

    def _continue(self, request: Request, step: StepBudget, preempted: list[str], now: float) -> None:
        start = request.num_computed_tokens
        must = self.policy.fast_lane(request.tier)
        remaining = request.num_tokens - start
        n = step.chunk(start, remaining, True, must, step.fast_prefill_share(request, start, remaining, now) if must else 0)
        drafts = self._drafts(request, step) if must and n == 1 and start == request.num_tokens - 1 else []
        if n and self._make_room(request, start + n + len(drafts), preempted):
            step.add(self._schedule(request, n, drafts))

    def _drafts(self, request: Request, step: StepBudget) -> list[int]:
        """n-gram drafts for a fast decode, as many as pay off (see speculation.py)."""
        k_max = min(self.config.speculative_tokens, step.tokens_left - 1,
                    request.params.max_tokens - len(request.output_token_ids) - 1,
                    self.max_len(request.tier) - 1 - request.num_tokens)
        if k_max <= 0 or request.params.grammar is not None or request.params.bad_words_token_ids:  # one at a time
            return []
        entry = self._entries[request.request_id]
        entry.drafter = entry.drafter or Drafter()
        start = request.num_computed_tokens
        return entry.drafter.drafts(request.all_token_ids, k_max, lambda k: step.fits(start, 1 + k, 1 + k),
                                    lambda k: step.predict(step.shape.plus(start, 1 + k, 1 + k)) or 1.0,
                                    self.config.speculation_min_rate)

    def _admit(self, requests: Iterable[Request], step: StepBudget, preempted: list[str], now: float, force: bool) -> None:
        """Admit from `requests` in order until one does not fit. `force`: preempt for it."""
        for request in requests:
            rid = request.request_id
            if force and not self.capacity.fast_fits_to_the_end(request, self.running.values()):
                return
            while force and self.capacity.free_slots(request.tier) <= 0:
                if not self._preempt_for(request, preempted):
                    return
            if self.capacity.free_slots(request.tier) <= 0 or not self.policy.may_admit_decode(request):
                return
            # At least one token is always left to compute, so the step yields logits.
            entry = self._entries[rid]
            cached = self.pool.match_prefix(rid, request.all_token_ids, self._cacheable(request), entry.block_hashes)
            if request.params.prompt_logprobs is not None and request.scoring_prompt:
                del request.prompt_logprobs[cached:]  # the positions it runs again score their tokens again
            self.capacity.hold(request.tier, len(self.pool.table(rid)))
            remaining = request.num_tokens - cached
            n = step.chunk(cached, remaining, True, force,
                           step.fast_prefill_share(request, cached, remaining, now) if force else 0)
            if n == 0:
                self._release(request)
                return
            while not self._allocate(request, cached + n):
                if not (force and self._preempt_for(request, preempted)):
                    self._release(request)
                    return  # head of the line waits; nobody overtakes it
            self.waiting[request.tier].remove(request)
            self.policy.left_queue(request)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
                request.num_cached_prompt_tokens = cached
            request.num_computed_tokens = cached
            request.state = RequestState.RUNNING
            self.running[rid] = self._stepping[rid] = request
            entry.admitted = self._tick()
            self.capacity.start(request.tier)
            step.add(self._schedule(request, n))

    @staticmethod
    def _cacheable(request: Request) -> int:
        """The most of its tokens the prefix cache may serve: all but the last, which must run to
        give logits; and while its prompt logprobs are being scored, none past those it has, for
        a position the cache serves is not run and gives no logits."""
        if request.params.prompt_logprobs is not None and request.scoring_prompt:
            return len(request.prompt_logprobs)
        return request.num_tokens - 1

    def _schedule(self, request: Request, n: int, drafts: list[int] = ()) -> ScheduledSeq:
        start = request.num_computed_tokens
        self._in_flight[request.request_id] = request
        self._entries[request.request_id].last_step = self._step_id
        scored = request.prompt_to_score(start, start + n) if request.params.prompt_logprobs is not None else ()
        return ScheduledSeq(request.request_id, request.tier, request.token_slice(start, start + n) + tuple(drafts),
                            start, self.pool.table(request.request_id), start + n == request.num_tokens,
                            request.params, len(drafts), request.banned_tokens(), request.output_counts, request.grammar,
                            request.tab, scored, request.seen_token_ids)

    def _allocate(self, request: Request, num_tokens: int) -> bool:
        before = len(self.pool.table(request.request_id))
        if self.pool.blocks_for(num_tokens) <= before:
            return True  # most decodes: no new block, so no reservation to work out
        ok = self.pool.allocate(request.request_id, num_tokens, reserve=self.capacity.reserve_against(request.tier))
        self.capacity.hold(request.tier, len(self.pool.table(request.request_id)) - before)
        return ok

    def _release(self, request: Request) -> None:
        self.capacity.hold(request.tier, -len(self.pool.table(request.request_id)))
        self.pool.free(request.request_id)

    def _make_room(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Give `request` blocks for num_tokens, preempting others until they fit. False if it
        could not grow this step: it preempted itself, or (fast, never preempted) it waits."""
        while not self._allocate(request, num_tokens):
            if self._preempt_for(request, preempted):
                continue
            if not self.policy.preemptible(request):
                return False
            self._preempt(request, preempted)
            return False
        return True

    def _preempt_for(self, request: Request, preempted: list[str]) -> bool:
        victims = self._victims(request)
        if not victims:
            return False
        self._preempt(victims[0], preempted)
        return True

    def _preempt(self, victim: Request, preempted: list[str]) -> None:
        """Preempt by recompute: drop its KV; its tokens (prompt and output) are kept, and it
        rejoins the front of its queue, to be prefilled again from whatever is still cached."""
        rid = victim.request_id
        del self.running[rid]
        self._stepping.pop(rid, None)
        self.capacity.stop(victim.tier)
        self._release(victim)
        victim.state = RequestState.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting[victim.tier].appendleft(victim)
        self.policy.queued(victim)
        preempted.append(rid)

    def _finish(self, request: Request, reason: str) -> None:
        rid = request.request_id
        if request.state is RequestState.RUNNING:
            del self.running[rid]
            self._stepping.pop(rid, None)
            self.capacity.stop(request.tier)
        else:
            self.waiting[request.tier].remove(request)
            self.policy.left_queue(request)
        if self._suspended is not None and rid in self._suspended[1]:
            self._release_after_suspended.append(request)
        else:
            self._release(request)
        del self._entries[rid]
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.finished_time = self.clock()

    def _tick(self) -> int:
        self._counter += 1
        return self._counter


class _Entry:
    """What the scheduler keeps on one unfinished request beside the request itself."""

    __slots__ = ("request", "arrival", "admitted", "last_step", "block_hashes", "drafter")

    def __init__(self, request: Request, arrival: int):
        self.request = request
        self.arrival = arrival  # arrival counter: the order requests came in
        self.admitted = 0  # admission counter, newest largest (set again after a preemption)
        self.last_step = 0  # the step it last ran in: skipped ones go first
        self.block_hashes: list[bytes] = []  # kept across preemptions: hash once
        self.drafter: Drafter | None = None  # once it drafts
