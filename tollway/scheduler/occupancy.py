"""What the scheduler holds at one moment: requests running and waiting per tier, KV blocks in
use. The engine thread takes one after every change of engine state (a step, an add, an abort)
and publishes it whole, so readers on other threads (metrics, the dashboard, the watchdog) see
current and mutually consistent numbers without waiting for the next step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Occupancy:
    running: dict[str, int]  # per tier
    waiting: dict[str, int]  # per tier, including preempted requests
    kv_blocks_used: int  # in use by a request (evictable prefix-cache blocks count as free)
    num_blocks: int

    @classmethod
    def of(cls, scheduler) -> Occupancy:
        """Call on the thread that owns the scheduler."""
        pool = scheduler.pool
        return cls({t: scheduler.running_in(t) for t in scheduler.tiers},
                   {t: len(q) for t, q in scheduler.waiting.items()}, pool.num_used, pool.num_blocks)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.num_blocks

    @property
    def idle(self) -> bool:
        return not any(self.running.values()) and not any(self.waiting.values())
