"""Durable step stores: what both backends keep, and `open_store`, which picks one by its URL.

Two backends with one interface (the methods of `SQLiteStore`):

- `store_sqlite.SQLiteStore`: an embedded SQLite file in WAL mode (the default; one process).
- `store_postgres.PostgresStore`: a PostgreSQL database (`postgresql://...`) that any number of
  `harts serve` replicas share. A step is planned once across them (`plan_lock`), and each
  replica hears what the others store (`listen`) to wake its long-polls and drop stale caches.

Per step both keep the submitted body and the batch's content digest for idempotency, the forest
counts, the requested or planned topology, the plan state, and every rank's sealed plan slice,
written in the same transaction as the PLANNED state. Bodies and slices are kept compressed
(`stored_form`): the bytes a trainer receives are the sealed bytes, exactly.

Storage faults: every database or file-system error becomes a `StorageError` (HTTP 503 / gRPC
UNAVAILABLE) naming the database and the reason, and puts the store in its *fault* state
(`fault` is the reason) until `probe` succeeds; `on_fault` hears of every change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from proto.harts.v1 import planner_pb2

__all__ = ["StepRecord", "open_store", "is_postgres_url", "SUBMITTED", "PLANNED", "FAILED", "COLUMNS", "NAMES",
           "STEP_EVENTS"]

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


def open_store(db: str, *, synchronous: str = "FULL", min_free_bytes: int = 0,
               on_fault: Callable[[str | None], None] | None = None):
    """The store for `db`: a PostgreSQL URL, or a SQLite file path (":memory:": throwaway).

    Args:
        synchronous: SQLite `synchronous` pragma (PostgreSQL commits durably, as configured there).
        min_free_bytes: SQLite: disk space writes leave free (PostgreSQL manages its own disk).
        on_fault: told of every change of the fault state (the reason, or None when healthy again),
            with the store's lock held: it must not call the store.
    """
    if is_postgres_url(db):
        from planner_service.store_postgres import PostgresStore

        return PostgresStore(db, on_fault=on_fault)
    from planner_service.store_sqlite import SQLiteStore

    return SQLiteStore(db, synchronous=synchronous, min_free_bytes=min_free_bytes, on_fault=on_fault)
