"""/dashboard, the operators' live view of the lanes and the bill, and /dashboard/data, the
JSON it polls: LiveStats' snapshot plus every budget's burn.

Both need an admin key when keys are on, and nothing when the server is open, like every
route. A browser cannot add an Authorization header to a page load, so the key may also come
as ?key=; the page then sends it back as a Bearer header on its polls. A key in a URL lands in
browser history and proxy logs: give the dashboard its own admin key (tollway serve
--admin-key) rather than one that can spend. The page is one static file with no outside
resources; its Content-Security-Policy lets it load nothing, and fetch nothing but this server.
Behind a fleet's ingress the same page polls the ingress, which merges every replica's data
(tollway/fleet/dashboard.py) from their /dashboard/data?samples=1.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import re
import time
from importlib.resources import files

from fastapi import APIRouter, Depends, Header, Query
from fastapi.responses import HTMLResponse, JSONResponse

from tollway.meter.canary_report import compare
from tollway.model.machine_profiler import hardware_name, kernel_choice
from tollway.server.canary import Canary
from tollway.server.keys import Gatekeeper
from tollway.server.live_stats import LiveStats

PAGE = (files(__package__) / "dashboard.html").read_text()
CANARY_WINDOW = 3600.0  # seconds of the ledger the canary panel compares
CANARY_REFRESH = 15.0  # seconds between its recomputations: a bootstrap is too dear for every poll


def _inline_hash(tag: str) -> str:
    """The CSP source that admits the page's one inline <script> or <style> and nothing else."""
    body = re.search(rf"<{tag}>(.*?)</{tag}>", PAGE, re.S).group(1)
    return f"'sha256-{base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()}'"


_PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_inline_hash('script')}; "
                               f"style-src {_inline_hash('style')}; connect-src 'self'; img-src data:; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",  # the URL may hold the key
    "Cache-Control": "no-store",
}


def dashboard_router(stats: LiveStats, gatekeeper: Gatekeeper, model_name: str, meter=None,
                     canary: Canary | None = None) -> APIRouter:
    router = APIRouter(include_in_schema=False)
    latest_canary = {"at": 0.0, "body": None}

    def canary_comparison(now: float) -> dict | None:
        """The canary's last hour, recomputed at most every CANARY_REFRESH seconds; None when it is off."""
        if meter is None or canary is None or not canary.on:
            return None
        if now - latest_canary["at"] >= CANARY_REFRESH:
            body = compare(meter.ledger.canary_rows(now - CANARY_WINDOW))
            latest_canary.update(at=now, body={"window": CANARY_WINDOW, "share": canary.config.share, **body})
        return latest_canary["body"]

    def admin(authorization: str | None = Header(default=None), key: str | None = Query(default=None)) -> None:
        gatekeeper.authenticate_admin(authorization or (f"Bearer {key}" if key else None))

    @router.get("/dashboard", dependencies=[Depends(admin)])
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE, headers=_PAGE_HEADERS)

    @router.get("/dashboard/data", dependencies=[Depends(admin)])
    async def data(samples: bool = False) -> JSONResponse:
        budgets = await asyncio.to_thread(meter.budgets.burn) if meter is not None else []  # may read the ledger
        now = time.time()
        body = {"model": model_name, "now": now,
                "price_per_hour": meter.price_card.price_per_hour if meter is not None else None,
                **stats.snapshot(samples), "budgets": budgets,
                "canary": await asyncio.to_thread(canary_comparison, now)}
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/steps", dependencies=[Depends(admin)])
    async def steps() -> JSONResponse:
        """The steps kept (LiveStats.steps) and the kernel choice a simulation of them needs:
        what `tollway profile --from URL` fits this machine's profile to, under real traffic."""
        engine = stats.engine.engine
        int8_max_tokens, dense_kernel = kernel_choice(engine.scheduler.config)
        total, steps = await asyncio.to_thread(stats.steps)
        # total: steps run since start, of which these are the last (a client that counts steps
        # between two reads takes its own from the end)
        body = {"model": model_name, "hardware": hardware_name(engine.device), "int8_max_tokens": int8_max_tokens,
                "dense_kernel": dense_kernel, "pause_layers": engine.scheduler.config.pause_layers,
                "total": total, "steps": steps, "calls": stats.calls()}
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    return router
