"""Project error types and the one table that maps them to HTTP and gRPC status codes.

Core code (ingest, planner, store) raises these; the HTTP and gRPC adapters translate them with
`STATUS` and never let any other exception text reach a client.
"""
from __future__ import annotations


class HartsError(Exception):
    """Base class: `message` is safe to show to a client."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ValidationError(HartsError, ValueError):
    """Bad input. `field` is the path of the first offending field, e.g. `trajectories[3].loss_mask`."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class IntegrityError(ValidationError):
    """The request's bytes are not those the client digested (`body_sha256`): altered in transit.
    Nothing was stored; the client sends the request again."""


class LimitError(HartsError, ValueError):
    """Input larger than a configured limit (request bytes, tokens, trajectories). `field`, when not
    empty, is the document field at which the count crossed the limit."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


class ConflictError(HartsError):
    """The batch_id is already stored with a different body."""


class NotFoundError(HartsError):
    """Unknown step, or a rank outside the step's topology."""


class NotReadyError(HartsError):
    """The step exists but its plan is not ready (yet); long-polling clients ask again."""


class PlanningError(HartsError, ValueError):
    """Planner settings that cannot be satisfied (B < C, M < B, a path longer than B without windows...)."""


class AuthError(HartsError):
    """Missing or wrong bearer token."""


class StorageError(HartsError):
    """The database cannot be read or written (disk full, read-only or deleted file, I/O error).

    Transient from the client's point of view: nothing was stored, readiness is off (unless only
    this write did not fit), and the service retries by itself; the message names the database and
    the reason. `need`: bytes a write that did not fit on the disk wants (0: another fault).
    """

    def __init__(self, message: str, *, need: int = 0):
        super().__init__(message)
        self.need = need


class Unavailable(HartsError):
    """The service cannot answer now (it is stopping); the client retries, on another replica
    if it knows one."""


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
