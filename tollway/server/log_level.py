"""--log-level: how much a serving process logs, the same for one server and for a fleet's
ingress and each of its replicas."""
from __future__ import annotations

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def uvicorn_logging(level: str) -> dict:
    """uvicorn's settings at `level`: at info and below, a line per request (the access log)."""
    return {"log_level": level, "access_log": level in ("info", "debug", "trace")}
