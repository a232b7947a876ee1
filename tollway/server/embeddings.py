"""POST /v1/embeddings, refused in OpenAI's shape. tollway serves generative models: an embedding
is a pooled hidden state that its model was trained to produce, and a decoder's mean-pooled
states are not one (they cluster by length and wording, not meaning), so returning them would
hand clients vectors that look right and retrieve badly."""
from __future__ import annotations

from fastapi import APIRouter, Depends

from tollway.config import KeySpec
from tollway.server.errors import APIError
from tollway.server.service import Service, caller, service

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(_: KeySpec | None = Depends(caller), svc: Service = Depends(service)) -> None:
    raise APIError(400, f"`{svc.model_name}` is a generative model: this server does not serve embeddings "
                        "(serve an embedding model with an embeddings server for that)",
                   param="model", code="model_not_supported")
