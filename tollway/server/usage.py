"""GET /v1/usage: the ledger's totals per key, tier, tag or model."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends

from tollway.config import KeySpec
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
    window = []
    for value, name in ((start, "start"), (end, "end")):
        try:
            window.append(parse_time(value, name))
        except ValueError as e:
            raise APIError(400, str(e), param=name) from None
    rows = await asyncio.to_thread(svc.meter.ledger.usage, group_by, *window, key.name if key else None)
    return {"object": "list", "data": rows}
