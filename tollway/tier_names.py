"""OpenAI's `service_tier` names and tollway's lanes, both ways: the server reads them, and
tollway bench sends them (OpenAI refuses tollway's own names)."""
from __future__ import annotations

# OpenAI's names, plus tollway's own. OpenAI's "scale" buys reserved capacity at a latency
# target, which is what the fast lane sells.
TIER_OF = {"priority": "fast", "scale": "fast", "default": "standard", "auto": "standard", "flex": "batch",
           "fast": "fast", "standard": "standard", "batch": "batch"}
# What a response reports: the OpenAI name of the lane that served it.
WIRE_NAME = {"fast": "priority", "standard": "default", "batch": "flex"}
