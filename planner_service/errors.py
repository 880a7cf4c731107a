"""Project error types: what ingest, the planner, the stores and the core raise.

A `HartsError`'s message is safe to show a client. The HTTP and gRPC adapters translate these
with one table (`planner_service.transport.status_codes.STATUS`) and never let any other
exception text reach a client (docs/design/service.md, "Shape").
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
