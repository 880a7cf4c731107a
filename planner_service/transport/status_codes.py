"""The one table that maps project errors to HTTP status codes and gRPC status codes.

Both transports answer a `HartsError` with `status_of(err)` and its message; any other exception
is INTERNAL, its text kept in the service log. 503s tell the client when to retry.
See docs/design/service.md.
"""
from __future__ import annotations

from planner_service.errors import (AuthError, ConflictError, HartsError, IntegrityError, LimitError, NotFoundError,
                                    NotReadyError, PlanningError, StorageError, Unavailable, ValidationError)

__all__ = ["STATUS", "INTERNAL", "RETRY_AFTER_SECONDS", "status_of"]

#: error type -> (HTTP status, gRPC status code name). Most specific first.
STATUS: list[tuple[type[HartsError], int, str]] = [
    (IntegrityError, 400, "DATA_LOSS"),
    (ValidationError, 422, "INVALID_ARGUMENT"),
    (LimitError, 413, "RESOURCE_EXHAUSTED"),
    (PlanningError, 400, "FAILED_PRECONDITION"),
    (ConflictError, 409, "ALREADY_EXISTS"),
    (NotFoundError, 404, "NOT_FOUND"),
    (NotReadyError, 404, "DEADLINE_EXCEEDED"),
    (AuthError, 401, "UNAUTHENTICATED"),
    (StorageError, 503, "UNAVAILABLE"),
    (Unavailable, 503, "UNAVAILABLE"),
    (HartsError, 500, "INTERNAL"),
]

#: HTTP status and gRPC code of any other exception: its text never reaches the client.
INTERNAL = (500, "INTERNAL")

#: Seconds a client should wait before retrying a 503 (sent as `Retry-After`).
RETRY_AFTER_SECONDS = 1


def status_of(err: HartsError) -> tuple[int, str]:
    """(HTTP status, gRPC code name) of a project error."""
    for cls, http, grpc_code in STATUS:
        if isinstance(err, cls):
            return http, grpc_code
    return INTERNAL
