"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the status
OpenAI would use, for every way a request can go wrong, including FastAPI's own."""
from __future__ import annotations

import json
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}
_CODE_TYPES = {"insufficient_quota": "insufficient_quota"}  # OpenAI's type for a spent quota is its code


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _CODE_TYPES.get(code) or _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status, headers=e.headers)


def invalid_body(problems: Sequence[dict]) -> APIError:
    """A body pydantic refused (its first problem) as a 400 naming the field. A field no one
    knows gets OpenAI's own words for it."""
    first = problems[0] if problems else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if loc[:1] in (["query"], ["path"], ["header"]):  # where it came from: the param is what follows
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_value")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {'.'.join(loc)[:100]}", param=loc[0][:100])
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
    if "input" in first and not isinstance(first["input"], dict | list):
        message += f" (got {json.dumps(first['input'], default=str)[:100]})"
    return APIError(400, message, param=loc[0] if loc else None, code="invalid_value")


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(invalid_body(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)  # app.RequestIds' (this runs outside it)
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}"), status_code=500,
                            headers={"x-request-id": request_id} if request_id else None)
