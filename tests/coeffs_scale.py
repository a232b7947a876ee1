"""A fake step-time model for the policy tests, and fast-lane targets of the same scale.

COEFFS is roughly the CPU before the native engine: a lone int8 step ~50 ms, a fp32 step
~70 ms. Today's default fast targets (30 ms a token) are sized for a faster engine, so the
tests that run on this model give the fast lane the targets of its own scale."""
from __future__ import annotations

from tollway.config import TierSpec

COEFFS = {"int8": [0.040, 0.0030, 0.0040, 0.00002, 0.004], "fp32": [0.060, 0.0020, 0.0120, 0.00002, 0.004]}
FAST_AT_THIS_SCALE = {"tpot_target": 0.12, "ttft_target": 0.8}


def at_this_scale(tiers: dict[str, TierSpec]) -> dict[str, TierSpec]:
    """`tiers` with the fast lane's targets set to COEFFS' scale, in place; returns them."""
    for name, value in FAST_AT_THIS_SCALE.items():
        setattr(tiers["fast"], name, value)
    return tiers
