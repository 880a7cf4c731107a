"""HTTP error answers: every error body is `{"error": {"code", "message", "field"}}`.

`HANDLERS` (registered by `create_app`) answer a project error with its status from the one table
(`status_codes.STATUS`; 503s carry `Retry-After`), FastAPI's own validation errors as 422 naming
the field, a client that went away with nothing (499 in the metrics), and anything else as a 500
whose text stays in the log. `ERRORS` documents them in OpenAPI (docs/design/service.md).
"""
from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from planner_service.errors import AuthError, HartsError, StorageError, Unavailable
from planner_service.transport.http_models import ErrorBody, ErrorDetail
from planner_service.transport.status_codes import INTERNAL, RETRY_AFTER_SECONDS, status_of

log = logging.getLogger(__name__)

__all__ = ["error_response", "ERRORS", "responses", "HANDLERS"]


def error_response(status: int, code: str, message: str, field: str | None = None, headers=None) -> JSONResponse:
    """The service's JSON error answer."""
    body = ErrorBody(error=ErrorDetail(code=code, message=message, field=field))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


ERRORS = {
    400: {"model": ErrorBody, "description": "Planning impossible for these settings (FAILED_PRECONDITION), or a "
          "body that is not what the client digested (DATA_LOSS: altered in transit, nothing stored)"},
    401: {"model": ErrorBody, "description": "Missing or wrong bearer token"},
    404: {"model": ErrorBody, "description": "Unknown step or rank, or plan not ready after the wait"},
    409: {"model": ErrorBody, "description": "batch_id stored with other content, or step planned for another topology"},
    408: {"model": ErrorBody, "description": "Request headers or body not received in time (`harts serve "
          "--header-timeout / --body-timeout`); the connection is closed"},
    413: {"model": ErrorBody, "description": "Request or batch over a configured limit"},
    422: {"model": ErrorBody, "description": "Invalid input; `field` names the first offending field"},
    503: {"model": ErrorBody, "description": "The database cannot be written (the message says why; nothing was "
          "stored) or the server is at its connection limit; retry after `Retry-After` seconds",
          "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}},
}


def responses(*codes: int) -> dict:
    """The OpenAPI `responses` of an operation that may answer these error statuses."""
    return {c: ERRORS[c] for c in codes}


async def _harts_error(request: Request, exc: HartsError):
    status, code = status_of(exc)
    headers = None
    if isinstance(exc, AuthError):
        headers = {"WWW-Authenticate": "Bearer"}
    elif status == 503:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
    if status >= 500 and not isinstance(exc, (StorageError, Unavailable)):  # the core logs a storage fault once
        log.error("%s %s: %s", request.method, request.url.path, exc.message)
    return error_response(status, code, exc.message, getattr(exc, "field", None) or None, headers)


async def _client_gone(request: Request, exc: ClientDisconnect):
    # nobody is left to answer: the response is dropped; 499 (client closed) is what metrics see
    log.debug("%s %s: the client disconnected", request.method, request.url.path)
    return Response(status_code=499)


async def _request_invalid(request: Request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    field = ".".join(str(p) for p in first.get("loc", ()))
    msg = first.get("msg", "invalid")
    if first.get("type") == "extra_forbidden":  # a query parameter the operation does not have
        msg = f"expected only the parameters documented at /docs, got unknown parameter {field.rpartition('.')[2]!r}"
    return error_response(422, "INVALID_ARGUMENT", f"{field}: {msg}", field or None)


async def _http_error(request: Request, exc: StarletteHTTPException):
    code = {404: "NOT_FOUND", 405: "UNIMPLEMENTED"}.get(exc.status_code, "INVALID_ARGUMENT")
    return error_response(exc.status_code, code, str(exc.detail), None, getattr(exc, "headers", None))


async def _internal(request: Request, exc: Exception):
    log.exception("%s %s failed", request.method, request.url.path)
    return error_response(INTERNAL[0], INTERNAL[1], "internal error; the service log has the details")


HANDLERS = ((HartsError, _harts_error), (ClientDisconnect, _client_gone), (RequestValidationError, _request_invalid),
             (StarletteHTTPException, _http_error), (Exception, _internal))
