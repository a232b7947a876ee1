"""OpenAI's Files and Batches endpoints, the batch lane's front door:
/v1/files (upload with purpose=batch, list, retrieve, content, delete) and
/v1/batches (create, retrieve, list, cancel). A key sees only the files and batches it made:
another's are a 404, as if they did not exist."""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, File, Form, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, Field

from tollway.config import KeySpec
from tollway.server.batch_store import BatchStore, new_id
from tollway.server.errors import APIError
from tollway.server.keys import owner_of
from tollway.server.service import Service, caller, service
from tollway.server.validation import BATCH_BODIES

MAX_FILE_BYTES = 100 * 2**20
MAX_LINES = 50_000  # as OpenAI
MAX_FILES_PAGE = 10_000  # OpenAI's most and default files per page


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


router = APIRouter()


async def batch_owner(key: KeySpec | None = Depends(caller)) -> str:
    """The caller's owner_of, once its key may use the batch lane."""
    if key is not None and "batch" not in key.tiers:
        raise APIError(403, "this API key may not use the batch lane", code="tier_not_allowed")
    return owner_of(key)


@router.post("/v1/files")
async def upload(file: UploadFile = File(...), purpose: str = Form(...), owner: str = Depends(batch_owner),
                 svc: Service = Depends(service)) -> dict:
    if purpose != "batch":
        raise APIError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
    data = await file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise APIError(413, f"files are limited to {MAX_FILE_BYTES // 2**20} MiB", param="file")
    return svc.batch_store.add_file(file.filename or "upload.jsonl", purpose, data, owner)


@router.get("/v1/files")
async def list_files(purpose: str | None = None, after: str | None = None, limit: int = MAX_FILES_PAGE,
                     order: str = "desc", owner: str = Depends(batch_owner), svc: Service = Depends(service)) -> dict:
    """A page, as OpenAI's: newest first unless order=asc; the next starts after last_id."""
    if not 1 <= limit <= MAX_FILES_PAGE:
        raise APIError(400, f"limit must be between 1 and {MAX_FILES_PAGE}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, "order must be 'asc' or 'desc'", param="order")
    cursor = _file(svc.batch_store, after, owner, "after") if after is not None else None
    page = svc.batch_store.files(owner, purpose, cursor, limit + 1, order == "desc")
    has_more, page = len(page) > limit, page[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, owner: str = Depends(batch_owner), svc: Service = Depends(service)) -> dict:
    return _file(svc.batch_store, file_id, owner)


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, owner: str = Depends(batch_owner),
                       svc: Service = Depends(service)) -> Response:
    _file(svc.batch_store, file_id, owner)
    return Response(svc.batch_store.file_content(file_id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, owner: str = Depends(batch_owner), svc: Service = Depends(service)) -> dict:
    _file(svc.batch_store, file_id, owner)
    svc.batch_store.delete_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/batches")
async def create(req: BatchCreate, owner: str = Depends(batch_owner), svc: Service = Depends(service)) -> dict:
    if req.endpoint not in BATCH_BODIES:
        raise APIError(400, f"endpoint must be one of {', '.join(BATCH_BODIES)}", param="endpoint")
    if req.completion_window != "24h":
        raise APIError(400, "completion_window must be '24h'", param="completion_window")
    _file(svc.batch_store, req.input_file_id, owner, "input_file_id")
    lines, errors = _parse_lines(svc.batch_store.file_content(req.input_file_id), req.endpoint)
    now = int(time.time())
    batch = {
        "id": new_id("batch"), "object": "batch", "endpoint": req.endpoint, "errors": None,
        "input_file_id": req.input_file_id, "completion_window": "24h", "status": "validating",
        "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
        "expires_at": now + 24 * 3600, "finalizing_at": None, "completed_at": None, "failed_at": None,
        "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": req.metadata,
    }
    if errors:  # as OpenAI: the batch exists, and failed validation with these errors
        batch.update(status="failed", failed_at=now, errors={"object": "list", "data": errors[:100]})
        batch["request_counts"]["total"] = 0
        return svc.batch_store.create_batch(batch, [], owner)
    svc.batch_store.create_batch(batch, lines, owner)
    svc.batch_runner.start(batch["id"])
    return svc.batch_store.batch(batch["id"])


@router.get("/v1/batches")
async def list_batches(limit: int = 20, after: str | None = None, owner: str = Depends(batch_owner),
                       svc: Service = Depends(service)) -> dict:
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", param="limit")
    batches = svc.batch_store.batches(owner)
    if after is not None:
        ids = [b["id"] for b in batches]
        batches = batches[ids.index(after) + 1:] if after in ids else []
    page = batches[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(batches) > limit}


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, owner: str = Depends(batch_owner), svc: Service = Depends(service)) -> dict:
    return _batch(svc.batch_store, batch_id, owner)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel(batch_id: str, owner: str = Depends(batch_owner), svc: Service = Depends(service)) -> dict:
    batch = _batch(svc.batch_store, batch_id, owner)
    if batch["status"] not in ("validating", "in_progress"):
        raise APIError(409, f"cannot cancel a batch that is {batch['status']}")
    return await svc.batch_runner.cancel(batch_id)


def _file(store: BatchStore, file_id: str, owner: str, param: str = "file_id") -> dict:
    found = store.file(file_id, owner)
    if found is None:
        raise APIError(404, f"no file with id {file_id!r}", param=param)
    return found


def _batch(store: BatchStore, batch_id: str, owner: str) -> dict:
    found = store.batch(batch_id, owner)
    if found is None:
        raise APIError(404, f"no batch with id {batch_id!r}", param="batch_id")
    return found


def _parse_lines(data: bytes, endpoint: str) -> tuple[list[tuple[str, str, dict]], list[dict]]:
    """OpenAI's input lines, {custom_id, method, url, body}; the problems, one per bad line."""
    lines, errors, seen = [], [], set()

    def bad(n: int, code: str, message: str) -> None:
        errors.append({"code": code, "message": message, "param": None, "line": n})

    try:
        text = data.decode()
    except UnicodeDecodeError:
        return [], [{"code": "invalid_file", "message": "the file is not UTF-8 text", "param": None, "line": None}]
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except json.JSONDecodeError as e:
            bad(n, "invalid_json_line", f"line {n} is not valid JSON: {e.msg}")
            continue
        if not isinstance(item, dict):
            bad(n, "invalid_request", f"line {n} must be a JSON object")
            continue
        custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            bad(n, "missing_required_parameter", f"line {n} needs a custom_id string")
        elif custom_id in seen:
            bad(n, "duplicate_custom_id", f"line {n}: custom_id {custom_id!r} is used more than once")
        elif item.get("method", "POST") != "POST":
            bad(n, "invalid_method", f"line {n}: method must be POST")
        elif url != endpoint:
            bad(n, "mismatched_url", f"line {n}: url {url!r} is not the batch's endpoint {endpoint}")
        elif not isinstance(body, dict):
            bad(n, "invalid_request", f"line {n} needs a body object")
        else:
            seen.add(custom_id)
            lines.append((custom_id, url, body))
    if not lines and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests", "param": None, "line": None})
    if len(lines) > MAX_LINES:
        errors.append({"code": "too_many_requests", "message": f"at most {MAX_LINES} requests per batch",
                       "param": None, "line": None})
    return lines, errors
