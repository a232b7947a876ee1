"""What engine time costs and what tokens are billed: the machine's price per hour, and per tier
the price per million input and output tokens (TierSpec)."""
from __future__ import annotations

from dataclasses import dataclass

from tollway.config import TierSpec


@dataclass(frozen=True)
class PriceCard:
    price_per_hour: float
    tiers: dict[str, TierSpec]

    @property
    def price_per_second(self) -> float:
        return self.price_per_hour / 3600.0

    def billed(self, tier: str, prompt_tokens: int, completion_tokens: int) -> float:
        spec = self.tiers[tier]
        return (prompt_tokens * spec.price_input_per_m + completion_tokens * spec.price_output_per_m) / 1e6
