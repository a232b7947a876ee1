"""What each tier holds of the KV pool and of the sequence slots, against what the other tiers
have reserved (SchedulerConfig.reserved): the books that keep a lane's reservation free for it."""
from __future__ import annotations

from collections.abc import Iterable

from tollway.config import SchedulerConfig
from tollway.request import Request
from tollway.scheduler.blocks import BlockPool


class TierCapacity:
    def __init__(self, config: SchedulerConfig, pool: BlockPool):
        self.max_num_seqs = config.max_num_seqs
        self.pool = pool
        self._kv_reserved = {t: config.reserved("kv", t) for t in config.tiers}
        self._seq_reserved = {t: config.reserved("seq", t) for t in config.tiers}
        self._held = {t: 0 for t in config.tiers}  # KV blocks
        self._running = {t: 0 for t in config.tiers}  # sequences
        # The pool bounds a tier's longest request as max_model_len does: a lone request must
        # always fit once everything else is preempted, or it could never finish. Its last token
        # needs no KV, hence the + 1.
        self._max_len = {
            tier: min(config.context_limit(), (pool.num_blocks - sum(
                r for t, r in self._kv_reserved.items() if t != tier)) * pool.block_size + 1)
            for tier in config.tiers}

    def max_len(self, tier: str) -> int:
        """Longest request (prompt + output) a tier can run."""
        return self._max_len[tier]

    def fast_fits_to_the_end(self, request: Request, running: Iterable[Request]) -> bool:
        """Fast is never preempted, so fast requests never compete for KV among themselves: one
        is admitted only if every running fast request can still grow to its full length."""
        def worst(r: Request) -> int:
            # The last token is sampled but never fed back, so it needs no KV.
            return self.pool.blocks_for(min(len(r.prompt_token_ids) + r.params.max_tokens, self.max_len(r.tier)) - 1)
        committed = sum(worst(r) for r in running if r.tier == request.tier)
        return committed + worst(request) <= self.pool.num_blocks

    def hold(self, tier: str, blocks: int) -> None:
        """`tier` holds `blocks` more KV blocks (fewer where negative)."""
        self._held[tier] += blocks

    def held(self, tier: str) -> int:
        return self._held[tier]

    def reserve_against(self, tier: str) -> int:
        """Blocks that must stay free when `tier` allocates: other tiers' unused reservations."""
        return sum(max(0, r - self._held[t]) for t, r in self._kv_reserved.items() if t != tier)

    def start(self, tier: str) -> None:
        """A request of `tier` starts running."""
        self._running[tier] += 1

    def stop(self, tier: str) -> None:
        """A running request of `tier` stops (finished or preempted)."""
        self._running[tier] -= 1

    def running_in(self, tier: str) -> int:
        return self._running[tier]

    def free_slots(self, tier: str) -> int:
        """Sequence slots `tier` may still take: the cap, less every running request and the
        other tiers' unused reservations."""
        held_back = sum(max(0, r - self._running[t]) for t, r in self._seq_reserved.items() if t != tier)
        return self.max_num_seqs - sum(self._running.values()) - held_back
