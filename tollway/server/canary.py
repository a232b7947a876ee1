"""The canary: a seeded share of eligible requests promoted from the standard lane to the fast
one, the rest kept as its control, so `tollway report --canary` can show what fast mode buys.

The split is a hash of the seed and the request id, not a random draw: it is the same on every
replica of a fleet (whose ingress names the call), and anyone with the seed can recompute it
from the ledger's ids.
"""
from __future__ import annotations

import hashlib

from tollway.config import CanaryConfig, KeySpec
from tollway.meter.ledger import CONTROL, PROMOTED


def promoted(seed: int, request_id: str, share: float) -> bool:
    """Whether the request falls in the promoted share: its hash, read as a number in [0, 1)."""
    digest = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < share


class Canary:
    def __init__(self, config: CanaryConfig):
        self.config = config

    @property
    def on(self) -> bool:
        return self.config.share > 0

    def eligible(self, key: KeySpec | None, tags: list[str], service_tier: str | None) -> bool:
        """Left to the server's choice ("auto" or none), from a key that may use the fast lane,
        within the keys and tags the canary is narrowed to. An un-entitled key's requests are
        not even control: control stands for what would have been promoted."""
        config = self.config
        if not self.on or service_tier not in (None, "auto"):
            return False
        if key is not None and "fast" not in key.tiers:
            return False
        if config.keys and (key is None or key.name not in config.keys):
            return False
        return not config.tags or any(t in config.tags for t in tags)

    def arm(self, request_id: str) -> str:
        """An eligible request's arm: PROMOTED or CONTROL."""
        return PROMOTED if promoted(self.config.seed, request_id, self.config.share) else CONTROL
