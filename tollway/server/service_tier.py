"""OpenAI's `service_tier` on the wire <-> tollway's lanes."""
from __future__ import annotations

from tollway.server.errors import APIError

# OpenAI's names, plus tollway's own. OpenAI's "scale" buys reserved capacity at a latency
# target, which is what the fast lane sells.
TIER_OF = {"priority": "fast", "scale": "fast", "default": "standard", "auto": "standard", "flex": "batch",
           "fast": "fast", "standard": "standard", "batch": "batch"}
# What a response reports: the OpenAI name of the lane that served it.
WIRE_NAME = {"fast": "priority", "standard": "default", "batch": "flex"}


def tier_for(service_tier: str | None) -> str:
    if service_tier is None:
        return "standard"
    tier = TIER_OF.get(service_tier)
    if tier is None:
        raise APIError(400, f"unknown service_tier {service_tier!r}; use one of {', '.join(TIER_OF)}",
                       param="service_tier", code="invalid_value")
    return tier
