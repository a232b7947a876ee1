"""--log-level: how much a serving process logs, the same for one server and for a fleet's
ingress and each of its replicas."""
from __future__ import annotations

import copy

from uvicorn.config import LOGGING_CONFIG

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def uvicorn_logging(level: str) -> dict:
    """uvicorn's settings at `level`: at info and below, a line per request (the access log),
    and a line per API call with where its time went (`tollway.access`, call_timing.py)."""
    access = level in ("info", "debug", "trace")
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["tollway.access"] = {"handlers": ["default"], "level": "INFO" if access else "WARNING",
                                           "propagate": False}
    return {"log_level": level, "access_log": access, "log_config": config}
