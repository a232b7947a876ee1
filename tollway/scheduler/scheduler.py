"""Continuous batching over the block pool: queues, admission, preemption -> StepPlan.

One token-budget model for prefill and decode alike (as in vLLM v1): every request knows how
many of its tokens have KV in the cache (num_computed_tokens), and each step gives it up to
num_tokens - num_computed_tokens more. A long prompt is thus cut into chunks that share steps
with running decodes instead of stalling them.
"""
from __future__ import annotations

import time
from collections import deque

from tollway.config import SchedulerConfig
from tollway.request import Request, RequestState
from tollway.scheduler.blocks import BlockPool
from tollway.scheduler.plan import ScheduledSeq, StepPlan, StepResult


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        config.validate()
        if config.kernel == "auto" and config.int8_max_tokens is None:
            raise ValueError("kernel='auto' needs int8_max_tokens: measure it (the engine does at first start) or set it")
        self.config = config
        self.pool = BlockPool(config.num_blocks, config.block_size, config.enable_prefix_caching)
        # The pool bounds a request's length as max_model_len does: a lone request must always
        # fit once everything else is preempted, or it could never finish. Its last token needs
        # no KV, hence the + 1.
        self.max_len = min(config.max_model_len, self.pool.capacity_tokens + 1)
        # Read-only views for metrics. Queues are per tier so tier policies can slot in; for now
        # admission is FCFS across all of them.
        self.waiting: dict[str, deque[Request]] = {}
        self.running: dict[str, Request] = {}  # admission order, newest last
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._arrival: dict[str, int] = {}
        self._block_hashes: dict[str, list[bytes]] = {}  # kept across preemptions: hash once
        self._num_arrived = 0
        self._step_id = 0
        self._in_flight: dict[str, Request] | None = None  # the latest plan's, until committed

    # ---- requests in and out ------------------------------------------------------------

    def add(self, request: Request) -> None:
        rid = request.request_id
        num_prompt = len(request.prompt_token_ids)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if num_prompt == 0:
            raise ValueError("prompt is empty")
        if num_prompt >= self.config.max_model_len:
            raise ValueError(f"prompt is {num_prompt} tokens, but the context is {self.config.max_model_len}")
        if num_prompt >= self.max_len:
            raise ValueError(
                f"prompt is {num_prompt} tokens, but the KV cache holds only {self.pool.capacity_tokens} "
                f"({self.pool.num_blocks} blocks of {self.pool.block_size})"
            )
        request.params.validate()
        request.state = RequestState.WAITING
        self._requests[rid] = request
        self._arrival[rid] = self._num_arrived
        self._num_arrived += 1
        self._block_hashes[rid] = []
        self.waiting.setdefault(request.tier, deque()).append(request)

    def finish(self, request_id: str, reason: str) -> Request | None:
        """Finish a waiting or running request (e.g. the engine matched a stop string) and free
        its blocks. Returns it, or None if no unfinished request has this id."""
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, reason)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish(request_id, "abort")

    def get(self, request_id: str) -> Request | None:
        """An unfinished request by id (finished ones are forgotten)."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- the step -----------------------------------------------------------------------

    def plan(self) -> StepPlan:
        self._step_id += 1
        self._in_flight = {}
        budget = self.config.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted: list[str] = []

        for request in list(self.running.values()):
            if budget == 0 or request.state is not RequestState.RUNNING:
                break  # out of tokens, or preempted by an older request (as are all after it)
            n = min(budget, request.num_tokens - request.num_computed_tokens)
            if not self._make_room(request, request.num_computed_tokens + n, preempted):
                break  # it preempted itself, and every request newer than it went before
            seqs.append(self._schedule(request, n))
            budget -= n

        # Admitting right after preempting would only hand the freed blocks to a newcomer and
        # thrash; vLLM makes the same call.
        if not preempted:
            now = time.monotonic()
            while budget and len(self.running) < self.config.max_num_seqs:
                queue = self._next_queue()
                if queue is None:
                    break
                request = queue[0]
                rid = request.request_id
                # At least one token is always left to compute, so the step yields logits.
                cached = self.pool.match_prefix(rid, request.all_token_ids, request.num_tokens - 1,
                                                self._block_hashes[rid])
                n = min(budget, request.num_tokens - cached)
                if not self.pool.allocate(rid, cached + n):
                    self.pool.free(rid)
                    break  # FCFS: nobody overtakes the head of the queue
                queue.popleft()
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                    request.num_cached_prompt_tokens = cached
                request.num_computed_tokens = cached
                request.state = RequestState.RUNNING
                self.running[rid] = request
                seqs.append(self._schedule(request, n))
                budget -= n

        num_tokens = sum(s.num_new for s in seqs)
        return StepPlan(self._step_id, seqs, self.config.kernel_for(num_tokens), preempted)

    def commit(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Apply a step's outcome. Returns the requests that got a token or finished."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} committed with the plan of step {plan.step_id}")
        if plan.step_id != self._step_id or self._in_flight is None:
            raise ValueError(f"step {plan.step_id} is not the latest uncommitted plan")
        bs = self.pool.block_size
        now = time.monotonic()
        changed: list[Request] = []
        for seq in plan.seqs:
            request = self._in_flight[seq.request_id]
            if request.state is not RequestState.RUNNING:
                continue  # finished or aborted while the step ran
            rid = request.request_id
            request.num_computed_tokens = seq.context_len
            if seq.start_pos // bs != seq.context_len // bs:
                self.pool.cache_full_blocks(rid, request.all_token_ids, seq.context_len)
            if not seq.sample:
                continue
            token = result.tokens.get(rid)
            if token is None:
                raise ValueError(f"step {plan.step_id} result has no sampled token for {rid}")
            request.output_token_ids.append(token.token_id)
            if token.logprob is not None:
                request.output_logprobs.append(
                    {"token_id": token.token_id, "logprob": token.logprob, "top_logprobs": token.top_logprobs}
                )
            if request.first_token_time is None:
                request.first_token_time = now
            reason = self._stop_reason(request, token.token_id)
            if reason is not None:
                self._finish(request, reason)
            changed.append(request)
        self._in_flight = None
        return changed

    # ---- internals ----------------------------------------------------------------------

    def _schedule(self, request: Request, n: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        self._in_flight[request.request_id] = request
        return ScheduledSeq(
            request_id=request.request_id,
            tier=request.tier,
            token_ids=_token_slice(request, start, start + n),
            start_pos=start,
            block_table=self.pool.table(request.request_id),
            sample=start + n == request.num_tokens,
            params=request.params,
        )

    def _make_room(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Give `request` blocks for num_tokens, preempting the newest-admitted running requests
        until they fit. False if `request` itself had to go."""
        while not self.pool.allocate(request.request_id, num_tokens):
            victim = self._preempt_newest()
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt_newest(self) -> Request:
        """Preempt by recompute: drop its KV; its tokens (prompt and output) are kept, and it
        rejoins the front of its queue, to be prefilled again from whatever is still cached."""
        rid, victim = self.running.popitem()
        self.pool.free(rid)
        victim.state = RequestState.WAITING
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting[victim.tier].appendleft(victim)
        return victim

    def _next_queue(self) -> deque[Request] | None:
        heads = [q for q in self.waiting.values() if q]
        if not heads:
            return None
        return min(heads, key=lambda q: self._arrival[q[0].request_id])

    def _stop_reason(self, request: Request, token_id: int) -> str | None:
        params = request.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in request.eos_token_ids):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        rid = request.request_id
        if request.state is RequestState.RUNNING:
            del self.running[rid]
        else:
            self.waiting[request.tier].remove(request)
        self.pool.free(rid)
        del self._requests[rid]
        del self._arrival[rid]
        del self._block_hashes[rid]
        request.state = RequestState.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()


def _token_slice(request: Request, start: int, end: int) -> tuple[int, ...]:
    """request.all_token_ids[start:end] without concatenating the whole list every step."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt = len(prompt)
    if start >= num_prompt:
        return tuple(output[start - num_prompt:end - num_prompt])
    return tuple(prompt[start:end]) + tuple(output[:max(0, end - num_prompt)])
