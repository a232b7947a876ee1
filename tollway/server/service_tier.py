"""A request's `service_tier` as the lane it asks for, or a 400 naming it."""
from __future__ import annotations

from tollway.server.errors import APIError
from tollway.tier_names import TIER_OF


def tier_for(service_tier: str | None) -> str:
    if service_tier is None:
        return "standard"
    tier = TIER_OF.get(service_tier)
    if tier is None:
        raise APIError(400, f"unknown service_tier {service_tier!r}; use one of {', '.join(TIER_OF)}",
                       param="service_tier", code="invalid_value")
    return tier
