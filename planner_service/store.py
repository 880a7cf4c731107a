"""Durable step store: SQLite in WAL mode.

What it keeps per step: the submitted body (as received for JSON, canonical protobuf bytes for
protobuf) and its SHA-256 for idempotency, the forest counts, the requested or planned topology,
the plan state, and every rank's sealed plan slice. Sealed slices are written in the same
transaction as the PLANNED state, so a crash leaves either no plan or the whole plan; a restart
serves the very bytes stored before it.

The store is thread-safe: one connection guarded by a lock (SQLite serialises writers anyway, and
the service caches the hot reads, the sealed slices, in memory).
"""
from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from planner_service.errors import ConflictError, NotFoundError
from proto.harts.v1 import planner_pb2

__all__ = ["StepRecord", "Store"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    step_id         TEXT PRIMARY KEY,
    body_sha256     TEXT NOT NULL,
    body_format     TEXT NOT NULL,
    body            BLOB NOT NULL,
    trajectories    INTEGER NOT NULL,
    unique_tokens   INTEGER NOT NULL,
    expanded_tokens INTEGER NOT NULL,
    submitted_at    REAL NOT NULL,
    state           INTEGER NOT NULL,
    topology        BLOB,
    stats           BLOB,
    error           TEXT NOT NULL DEFAULT '',
    planned_at      REAL NOT NULL DEFAULT 0,
    world_size      INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS slices (
    step_id TEXT NOT NULL,
    rank    INTEGER NOT NULL,
    data    BLOB NOT NULL,
    PRIMARY KEY (step_id, rank)
) WITHOUT ROWID;
"""

_COLUMNS = (
    "step_id, body_sha256, body_format, trajectories, unique_tokens, expanded_tokens, submitted_at, "
    "state, topology, stats, error, planned_at, world_size"
)

SUBMITTED = planner_pb2.STEP_STATE_SUBMITTED
PLANNED = planner_pb2.STEP_STATE_PLANNED
FAILED = planner_pb2.STEP_STATE_FAILED


@dataclass(slots=True, kw_only=True)
class StepRecord:
    """One stored step (everything but the body and the slices)."""

    step_id: str
    """The batch_id of the submitted rollouts."""
    body_sha256: str
    """Hex SHA-256 of the stored body, prefixed by its format (idempotency key)."""
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


class Store:
    """SQLite persistence of steps and sealed plan slices.

    Args:
        path: database file (created with its folder); ":memory:" for a throwaway store.
        synchronous: SQLite `synchronous` pragma; FULL survives power loss, NORMAL process crashes.
    """

    def __init__(self, path: str | Path, *, synchronous: str = "FULL"):
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous: expected OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        # Bodies and slices are megabyte blobs: 64 KiB pages write them about twice as fast as
        # the default 4 KiB (applies when the file is created; WAL mode fixes it afterwards).
        self._db.execute("PRAGMA page_size=65536")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous.upper()}")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _row(self, row) -> StepRecord:
        names = [c.strip() for c in _COLUMNS.split(",")]
        return StepRecord(**dict(zip(names, row)))

    def insert_step(self, rec: StepRecord, body: bytes) -> tuple[StepRecord, bool]:
        """Store a new step, or recognise an idempotent retry.

        Returns:
            (the stored record, duplicate): duplicate is True when the step was already stored
            with the same body hash (nothing is written then).

        Raises:
            ConflictError: the step_id is stored with a different body.
        """
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                row = cur.execute(f"SELECT {_COLUMNS} FROM steps WHERE step_id = ?", (rec.step_id,)).fetchone()
                if row is not None:
                    cur.execute("COMMIT")
                    old = self._row(row)
                    if old.body_sha256 != rec.body_sha256:
                        raise ConflictError(
                            f"batch_id: {rec.step_id!r} is already stored with a different body; "
                            "use a new batch_id for new rollouts"
                        )
                    return old, True
                cur.execute(
                    "INSERT INTO steps (step_id, body_sha256, body_format, body, trajectories, unique_tokens, "
                    "expanded_tokens, submitted_at, state, topology) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (rec.step_id, rec.body_sha256, rec.body_format, body, rec.trajectories, rec.unique_tokens,
                     rec.expanded_tokens, rec.submitted_at, rec.state, rec.topology),
                )
                cur.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    cur.execute("ROLLBACK")
                raise
        return rec, False

    def get(self, step_id: str) -> StepRecord:
        """The step's record; NotFoundError when unknown."""
        with self._lock:
            row = self._db.execute(f"SELECT {_COLUMNS} FROM steps WHERE step_id = ?", (step_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"step_id: no step {step_id!r}")
        return self._row(row)

    def body(self, step_id: str) -> tuple[str, bytes]:
        """(format, body bytes) of a stored step."""
        with self._lock:
            row = self._db.execute("SELECT body_format, body FROM steps WHERE step_id = ?", (step_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"step_id: no step {step_id!r}")
        return row[0], bytes(row[1])

    def list(self, limit: int) -> list[StepRecord]:
        """At most `limit` steps, newest submission first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM steps ORDER BY rowid DESC LIMIT ?", (int(limit),)
            ).fetchall()
        return [self._row(r) for r in rows]

    def pending(self) -> list[StepRecord]:
        """Steps with a requested topology that were never planned (planning was interrupted)."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM steps WHERE state = ? AND topology IS NOT NULL ORDER BY rowid",
                (SUBMITTED,),
            ).fetchall()
        return [self._row(r) for r in rows]

    def count_unplanned(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM steps WHERE state = ?", (SUBMITTED,)).fetchone()[0])

    def request_plan(self, step_id: str, topology: bytes) -> None:
        """Record the topology a step is about to be planned for (so a restart resumes it)."""
        with self._lock:
            self._db.execute(
                "UPDATE steps SET topology = ?, state = ?, error = '' WHERE step_id = ? AND state != ?",
                (topology, SUBMITTED, step_id, PLANNED),
            )

    def save_plan(self, step_id: str, *, topology: bytes, stats: bytes, slices: list[bytes]) -> float:
        """Store the sealed slices and mark the step PLANNED, atomically. Returns planned_at."""
        planned_at = time.time()
        with self._lock:
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                cur.execute("DELETE FROM slices WHERE step_id = ?", (step_id,))
                cur.executemany(
                    "INSERT INTO slices (step_id, rank, data) VALUES (?, ?, ?)",
                    [(step_id, r, s) for r, s in enumerate(slices)],
                )
                cur.execute(
                    "UPDATE steps SET state = ?, topology = ?, stats = ?, error = '', planned_at = ?, world_size = ? "
                    "WHERE step_id = ?",
                    (PLANNED, topology, stats, planned_at, len(slices), step_id),
                )
                cur.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    cur.execute("ROLLBACK")
                raise
        return planned_at

    def save_failure(self, step_id: str, *, topology: bytes, error: str) -> None:
        """Mark the step FAILED with a client-safe reason."""
        with self._lock:
            self._db.execute(
                "UPDATE steps SET state = ?, topology = ?, error = ?, planned_at = ? WHERE step_id = ? AND state != ?",
                (FAILED, topology, error, time.time(), step_id, PLANNED),
            )

    def slice(self, step_id: str, rank: int) -> bytes | None:
        """Sealed slice bytes of one rank, None when absent."""
        with self._lock:
            row = self._db.execute(
                "SELECT data FROM slices WHERE step_id = ? AND rank = ?", (step_id, int(rank))
            ).fetchone()
        return None if row is None else bytes(row[0])
