"""A request's `service_tier`, or vLLM's `priority`, as the lane it asks for, or a 400 naming it."""
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


def priority_tier(priority: int) -> str:
    """vLLM's priority (lower is served sooner) as a lane: below 0 fast, 0 standard, above 0 batch."""
    return "fast" if priority < 0 else "batch" if priority > 0 else "standard"


def asked_tier(service_tier: str | None, priority: int | None) -> tuple[str, str | int | None, str]:
    """The lane a call asks for, what it asked in the asking field's own value, and that field's
    name (a key's refusal names it). A priority, where one is sent, decides: a 400 if
    service_tier names another lane ("auto" leaves the choice to priority)."""
    if priority is None:
        return tier_for(service_tier), service_tier, "service_tier"
    tier = priority_tier(priority)
    if service_tier not in (None, "auto") and tier_for(service_tier) != tier:
        raise APIError(400, f"priority {priority} asks for the {tier} lane but service_tier {service_tier!r} for the "
                            f"{tier_for(service_tier)} lane; send one of them, or both naming the same lane",
                       param="priority", code="invalid_value")
    return (tier, service_tier, "service_tier") if priority == 0 else (tier, priority, "priority")
