"""Coasting: the scheduler's bookkeeping for steady decodes, kept as sums instead of per step.

A simulated million requests is a quarter of a billion sequence-steps, and nearly all of them
are the same thing: a running request that decodes one token and is not near any decision.
Planning and committing each one costs the scheduler tens of microseconds in Python. So when
the scheduler is given a token source (the simulator gives one; the engine never does, since
a real runner needs every sequence spelled out), a request that decodes plainly "coasts": it
leaves the per-request lists, and its tier's CoastGroup carries it as a count and a sum of
positions. A step takes a whole group at once, after checking it exactly as the per-request
path would (the same time target, token budget, blocks and turn order); where any check could
come out differently for some member, the group is brought back up to date first and planned
request by request. The results are the same either way, which tests check.

A coaster's Request lags while it coasts: its tokens and counters are brought up to date
(with tokens from the source) when it stops, at its last step or when a check needs it. So do
its blocks: each step the pool counts the new blocks a group's members start as taken
(BlockPool.promise), and hands out their ids when they stop.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Container, Iterable
from typing import NamedTuple

from tollway.request import Request


class Coaster:
    """One coasting request: up to date as of step `anchor`, after which it ran in every step.
    In step t it feeds the token at position offset + t."""

    __slots__ = ("request", "group", "anchor", "computed", "offset")

    def __init__(self, request: Request, group: str, anchor: int):
        self.request, self.group, self.anchor = request, group, anchor
        self.computed = request.num_computed_tokens
        self.offset = self.computed - anchor - 1


class CoastStep(NamedTuple):
    """A group's share of one step: `count` decodes whose attention reads `pairs` query-key
    pairs in all (position + 1 each)."""

    group: str
    count: int
    pairs: int
    fast: bool  # the group is the fast lane's (metering charges it apart when fast caps a step)


class CoastGroup:
    """Coasters that one run phase of the policy takes together."""

    def __init__(self, block_size: int):
        self.count = 0
        self.offset_sum = 0
        # Bounds on the members' admission order (the turn order within a phase); kept loose
        # as members leave: a loose bound only sends a step down the per-request path.
        self.min_admitted = self.max_admitted = 0
        # A coaster needs a new block in the steps where its position is a multiple of the
        # block size: members counted per tier by step % block_size.
        self.block_size = block_size
        self.new_blocks: dict[str, list[int]] = {}

    def pairs_at(self, step: int) -> int:
        """Query-key pairs of the group's decodes in `step`."""
        return self.offset_sum + self.count * (step + 1)

    def needing_blocks(self, step: int) -> dict[str, int]:
        """tier -> members whose token in `step` starts a new block."""
        r = step % self.block_size
        return {tier: counts[r] for tier, counts in self.new_blocks.items() if counts[r]}

    def count_blocks(self, coaster: Coaster, sign: int) -> None:
        counts = self.new_blocks.get(coaster.request.tier)
        if counts is None:
            counts = self.new_blocks[coaster.request.tier] = [0] * self.block_size
        counts[-coaster.offset % self.block_size] += sign


class Coasting:
    def __init__(self, tokens: Callable[[int], Iterable[int]],
                 on_end: Callable[[Request, int, int, int], None] | None = None):
        """`tokens(k)`: k output tokens for a coaster catching up (the simulator's stand-ins).
        `on_end(request, first_step, last_step, offset)`: a coaster stopped, having run in
        steps first_step..last_step at position offset + step (for metering and token times)."""
        self.tokens = tokens
        self.on_end = on_end
        self.members: dict[str, Coaster] = {}
        self.groups: dict[str, CoastGroup] = {}
        self.block_size = 16  # the scheduler sets its pool's
        self._finishes: list[tuple[int, int, Coaster]] = []  # (the step of its last token, tie, coaster)
        self._dues: list[tuple[float, int, Coaster]] = []  # batch: when it falls due (then it steps)
        self._tie = itertools.count()

    def group(self, name: str) -> CoastGroup:
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = CoastGroup(self.block_size)
        return group

    def start(self, request: Request, group_name: str, anchor: int, admitted: int, last_step: int,
              due: float | None) -> None:
        """`request` coasts from the step after `anchor`; its last token comes in `last_step`.
        Its blocks must end where its KV does (the next block is needed at the next multiple
        of the block size)."""
        coaster = Coaster(request, group_name, anchor)
        self.members[request.request_id] = coaster
        group = self.group(group_name)
        if group.count == 0:
            group.min_admitted = group.max_admitted = admitted
        group.count += 1
        group.offset_sum += coaster.offset
        group.min_admitted, group.max_admitted = min(group.min_admitted, admitted), max(group.max_admitted, admitted)
        group.count_blocks(coaster, 1)
        tie = next(self._tie)
        heapq.heappush(self._finishes, (last_step, tie, coaster))
        if due is not None:
            heapq.heappush(self._dues, (due, tie, coaster))

    def stop(self, request_id: str) -> Coaster:
        coaster = self.members.pop(request_id)
        group = self.groups[coaster.group]
        group.count -= 1
        group.offset_sum -= coaster.offset
        group.count_blocks(coaster, -1)
        return coaster

    def finishing(self, step: int, groups: Container[str] | None = None) -> list[Coaster]:
        """Coasters whose last token came in `step` (or before: none should); only those of
        `groups` where given (the others stay for a later step)."""
        if groups is None:
            return self._pop_live(self._finishes, step)
        out, later = [], []
        while self._finishes and self._finishes[0][0] <= step:
            entry = heapq.heappop(self._finishes)
            coaster = entry[2]
            if self.members.get(coaster.request.request_id) is coaster:
                (out if coaster.group in groups else later).append(entry)
        for entry in later:
            heapq.heappush(self._finishes, entry)
        return [entry[2] for entry in out]

    def due(self, now: float) -> list[Coaster]:
        """Coasting batch requests that have fallen due: they go back to running as standard."""
        return self._pop_live(self._dues, now)

    def _pop_live(self, heap: list, until: float) -> list[Coaster]:
        out = []
        while heap and heap[0][0] <= until:
            _, _, coaster = heapq.heappop(heap)
            if self.members.get(coaster.request.request_id) is coaster:
                out.append(coaster)
        return out
