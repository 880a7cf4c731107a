"""Step ids (a submission's batch_id): what the service accepts, checked in one place.

A step id is echoed in URLs (one path segment), errors and gRPC trailers, so it is bounded and
printable; `check_step_id` is what the core runs on every id it is given or stores.
See docs/design/service.md.
"""
from __future__ import annotations

from planner_service.errors import ValidationError

__all__ = ["MAX_STEP_ID_CHARS", "check_step_id", "check_rank"]

MAX_STEP_ID_CHARS = 512
"""Longest step id (batch_id): it is echoed in URLs, errors and gRPC trailers (8 KiB at most)."""


def check_step_id(step_id: str, field: str) -> None:
    """Raise ValidationError naming `field` unless `step_id` can be a step id: 1 to 512
    characters, one URL path segment (no '/', not '.' or '..'), no control characters (NUL
    included), not only whitespace. The project's client reaches every id that passes."""
    if len(step_id) > MAX_STEP_ID_CHARS:
        raise ValidationError(field, f"expected at most {MAX_STEP_ID_CHARS} characters, got {len(step_id)}")
    if not step_id.strip():
        raise ValidationError(field, f"expected an id with a visible character, got {step_id!r}")
    if step_id in (".", ".."):
        raise ValidationError(field, f"expected an id other than '.' and '..' (URL path segments that name "
                                     f"no step), got {step_id!r}")
    if "/" in step_id:
        raise ValidationError(field, f"expected no '/' (a step id is one URL path segment), got {step_id!r}")
    bad = next((c for c in step_id if ord(c) < 32 or ord(c) == 127), None)
    if bad is not None:
        raise ValidationError(field, f"expected no control characters, got {bad!r} at character {step_id.index(bad)}")


def check_rank(rank: int) -> None:
    """Raise ValidationError unless `rank` can name a trainer rank (>= 0; the step's world size
    bounds it once the step is read)."""
    if rank < 0:
        raise ValidationError("rank", f"expected >= 0, got {rank}")
