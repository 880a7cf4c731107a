"""What both step stores keep: the states, the step columns and `StepRecord` (docs/design/service.md)."""
from __future__ import annotations

from dataclasses import dataclass

from proto.harts.v1 import planner_pb2

__all__ = ["StepRecord", "is_postgres_url", "SUBMITTED", "PLANNED", "FAILED", "COLUMNS", "NAMES", "STEP_EVENTS"]

SUBMITTED = planner_pb2.STEP_STATE_SUBMITTED
PLANNED = planner_pb2.STEP_STATE_PLANNED
FAILED = planner_pb2.STEP_STATE_FAILED

COLUMNS = (
    "step_id, body_sha256, body_format, trajectories, unique_tokens, expanded_tokens, submitted_at, "
    "state, topology, stats, error, planned_at, world_size"
)
NAMES = [c.strip() for c in COLUMNS.split(",")]

STEP_EVENTS = ("submitted", "planned", "failed", "deleted")
"""What `listen` callbacks are told happened to a step."""


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One stored step (everything but the body and the slices)."""

    step_id: str
    """The batch_id of the submitted rollouts."""
    body_sha256: str
    """Idempotency key: `content-v2:<hex>`, the batch's content digest (`planner_service.digest`);
    rows of earlier versions hold `content-v1:` (no policy_version), `json:` or `proto:` (a
    SHA-256 of the body bytes) and are compared by re-ingesting their body."""
    body_format: str
    """'json' or 'proto'."""
    trajectories: int
    unique_tokens: int
    expanded_tokens: int
    submitted_at: float
    """Unix seconds."""
    state: int
    """planner_pb2.StepState value."""
    topology: bytes | None = None
    """planner_pb2.Topology bytes: requested (SUBMITTED), planned (PLANNED) or attempted (FAILED)."""
    stats: bytes | None = None
    """plan_pb2.PlanStats bytes once planned."""
    error: str = ""
    """Why planning failed (client-safe text)."""
    planned_at: float = 0.0
    world_size: int = 0
    """Number of stored slices once planned."""

    @classmethod
    def from_row(cls, row) -> "StepRecord":
        """A record from a row of `COLUMNS`."""
        rec = cls(**dict(zip(NAMES, row)))
        for name in ("topology", "stats"):
            value = getattr(rec, name)
            if value is not None and not isinstance(value, bytes):
                setattr(rec, name, bytes(value))  # PostgreSQL's memoryview
        return rec


def is_postgres_url(db: str) -> bool:
    """True for a PostgreSQL connection URL (`postgresql://` or `postgres://`)."""
    return db.startswith(("postgresql://", "postgres://"))
