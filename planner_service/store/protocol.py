"""`Store`: what the core asks of a step store; `SQLiteStore` and `PostgresStore` implement it.

Every method that touches the database raises `StorageError` for a storage fault and puts the
store in its fault state (`store.faults.FaultState`: READY, SHORT_OF_SPACE, FAULTED, LOST);
`fault` is the reason, and `probe` is how the state goes back to READY (docs/design/service.md).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Protocol, runtime_checkable

from planner_service.store.records import StepRecord

__all__ = ["Store"]


@runtime_checkable
class Store(Protocol):
    """A durable store of steps: records, bodies and sealed plan slices."""

    path: str
    """The database, as logs and errors name it (a URL without its password)."""
    shared: bool
    """Other processes (replicas) write the same database."""
    min_free_bytes: int
    """Disk space writes leave free (0: the store does not manage the disk)."""

    @property
    def fault(self) -> str | None:
        """Why the storage is unusable now; None when READY."""

    @property
    def short_of_space(self) -> bool:
        """The fault is only the disk's reserve: deleting and compacting go on."""

    # ---- health and lifecycle

    def probe(self) -> str | None:
        """Check that the database can be written; set or clear the fault; return it."""

    def free_bytes(self) -> int | None:
        """Free bytes on the database's disk (None: unknown, not this process's disk)."""

    def watch_files(self) -> None:
        """Start watching the database's files, where the store has files of its own."""

    def listen(self, fn: Callable[[str, str], None]) -> None:
        """Call `fn(event, step_id)` for step changes other writers commit (`records.STEP_EVENTS`,
        and "reconnected" when some may have been missed)."""

    def plan_lock(self, step_id: str, *, wait: bool = True) -> AbstractContextManager[bool]:
        """Hold the step's planning lock across processes; yields whether it was acquired."""

    def close(self) -> None:
        """Release the database (a final checkpoint where there is one)."""

    # ---- steps

    def insert_step(self, rec: StepRecord, body: bytes) -> StepRecord | None:
        """Store a new step with its body; the stored record when its step_id is taken (None: stored)."""

    def get(self, step_id: str) -> StepRecord:
        """The step's record; NotFoundError when unknown."""

    def body(self, step_id: str) -> tuple[str, bytes]:
        """(format, body bytes) of a stored step; NotFoundError when unknown."""

    def list(self, limit: int) -> list[StepRecord]:
        """At most `limit` steps, newest submission first."""

    def pending(self) -> list[StepRecord]:
        """Steps with a requested topology that were never planned."""

    def count_unplanned(self) -> int:
        """Steps submitted and neither planned nor failed."""

    def request_plan(self, step_id: str, topology: bytes) -> None:
        """Record the topology a step is about to be planned for (a restart resumes it)."""

    def save_plan(self, step_id: str, *, topology: bytes, stats: bytes, slices: list[bytes]) -> float:
        """Store the sealed slices and mark the step PLANNED in one transaction; returns planned_at."""

    def save_failure(self, step_id: str, *, topology: bytes, error: str) -> None:
        """Mark the step FAILED with a client-safe reason."""

    def slice(self, step_id: str, rank: int) -> bytes | None:
        """Sealed slice bytes of one rank, None when absent."""

    # ---- retention

    def delete(self, step_id: str) -> bool:
        """Delete a step with its body and slices; False when there was none."""

    def expired(self, *, keep: int = 0, before: float = 0.0, limit: int = 1000) -> list[str]:
        """Step ids a retention policy drops (keep the newest `keep`; drop those submitted before
        `before`), oldest first."""

    def compact(self, *, vacuum: bool = False) -> int:
        """Give free space back to the file system; returns the bytes freed."""
