"""GET /v1/usage: the ledger's totals per key, tier, tag or model; GET /v1/usage/canary: the
canary's promoted requests against its control (canary_report.py), as `tollway report --canary`."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from tollway.config import KeySpec
from tollway.meter.canary_report import compare
from tollway.meter.ledger import GROUPS, parse_time
from tollway.server.errors import APIError
from tollway.server.service import Service, caller, service

router = APIRouter()


@router.get("/v1/usage")
async def usage(group_by: str = "tier", start: str | None = None, end: str | None = None,
                key: KeySpec | None = Depends(caller), svc: Service = Depends(service)) -> dict:
    """Totals per key, tier, tag or model over [start, end) (unix seconds or ISO 8601).
    With API keys on, a key sees only its own requests."""
    if svc.meter is None:
        raise APIError(404, "metering is off")
    if group_by not in GROUPS:
        raise APIError(400, f"group_by must be one of {', '.join(GROUPS)}", param="group_by")
    rows = await asyncio.to_thread(svc.meter.ledger.usage, group_by, *_window(start, end), key.name if key else None)
    return {"object": "list", "data": rows}


@router.get("/v1/usage/canary")
async def canary(start: str | None = None, end: str | None = None, key: KeySpec | None = Depends(caller),
                 svc: Service = Depends(service)) -> dict:
    """The canary's comparison over [start, end). With API keys on, a key sees only its own requests."""
    if svc.meter is None:
        raise APIError(404, "metering is off")
    window = _window(start, end)
    rows = await asyncio.to_thread(svc.meter.ledger.canary_rows, *window, key.name if key else None)
    return {"object": "canary.comparison", "start": window[0], "end": window[1], "share": svc.canary.config.share,
            **await asyncio.to_thread(compare, rows)}


def _window(start: str | None, end: str | None) -> list[float | None]:
    window = []
    for value, name in ((start, "start"), (end, "end")):
        try:
            window.append(parse_time(value, name))
        except ValueError as e:
            raise APIError(400, str(e), param=name) from None
    return window
