"""GET /health (the engine alive and no request stuck), /metrics (Prometheus), /v1/models and
/v1/models/{id}."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tollway.config import KeySpec
from tollway.server import errors
from tollway.server.errors import APIError
from tollway.server.service import Service, caller, service

router = APIRouter()


@router.get("/health")
async def health(svc: Service = Depends(service)) -> JSONResponse:
    if not svc.engine.alive:
        raise APIError(503, "the engine has stopped")
    stuck = svc.watchdog.check()
    if stuck:
        return JSONResponse(errors.error_body(503, f"stuck: {'; '.join(stuck)}", code="stalled") | {"stalled": stuck},
                            status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics")
async def prometheus(svc: Service = Depends(service)) -> Response:
    if svc.metrics is None:
        raise APIError(404, "metrics are off")
    return Response(svc.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(_: KeySpec | None = Depends(caller), svc: Service = Depends(service)) -> dict:
    return {"object": "list", "data": [_model(svc)]}


@router.get("/v1/models/{model_id:path}")  # :path: served names may hold a slash, as Hugging Face's do
async def model(model_id: str, _: KeySpec | None = Depends(caller), svc: Service = Depends(service)) -> dict:
    if model_id != svc.model_name:
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {svc.model_name!r}",
                       param="model", code="model_not_found")
    return _model(svc)


def _model(svc: Service) -> dict:
    """OpenAI's Model object, and the context length vLLM adds to it."""
    return {"id": svc.model_name, "object": "model", "created": 0, "owned_by": "tollway",
            "max_model_len": svc.max_model_len}
