"""What a replica reports to the router: its load per lane, read on its engine thread
between steps so the numbers agree with one another."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReplicaLoad:
    running: dict[str, int]  # per tier
    waiting: dict[str, int]  # per tier, including preempted requests
    free_blocks: int  # KV blocks free (evictable prefix-cache blocks count as free)
    num_blocks: int
    # Prompt tokens still to prefill plus output tokens still allowed (max_tokens) over every
    # unfinished request: the work queued on this replica, in tokens.
    outstanding_tokens: int
    fast_slots: int  # sequence slots reserved for the fast lane
    max_num_seqs: int

    @classmethod
    def of(cls, engine) -> ReplicaLoad:
        """Call on the engine thread (AsyncEngine.run)."""
        held, config = engine.occupancy(), engine.config.scheduler
        return cls(held.running, held.waiting, held.num_blocks - held.kv_blocks_used, held.num_blocks,
                   engine.outstanding_tokens(), config.reserved("seq", "fast"), config.max_num_seqs)

    @property
    def fast_busy(self) -> int:
        return self.running["fast"] + self.waiting["fast"]

    @property
    def spare_slots(self) -> int:
        """Sequence slots no lane is using or waiting for, past the fast lane's unused reserve:
        where batch work can run without delaying anyone."""
        if self.waiting["standard"] or self.waiting["fast"]:
            return 0
        unused_fast = max(0, self.fast_slots - self.running["fast"])
        return self.max_num_seqs - sum(self.running.values()) - self.waiting["batch"] - unused_fast
