"""Durable step stores: the `Store` protocol, what both backends keep, and `open_store`, which
picks one by its URL.

Two backends implement `store.protocol.Store`:

- `store.sqlite.SQLiteStore`: an embedded SQLite file in WAL mode (the default; one process).
- `store.postgres.PostgresStore`: a PostgreSQL database (`postgresql://...`) that any number of
  `harts serve` replicas share. A step is planned once across them (`plan_lock`), and each
  replica hears what the others store (`listen`) to wake its long-polls and drop stale caches.

Per step both keep the submitted body and the batch's content digest for idempotency, the forest
counts, the requested or planned topology, the plan state, and every rank's sealed plan slice,
written in the same transaction as the PLANNED state. Bodies and slices are kept compressed
(`stored_form`): the bytes a trainer receives are the sealed bytes, exactly.

Storage faults: every database or file-system error becomes a `StorageError` (HTTP 503 / gRPC
UNAVAILABLE) naming the database and the reason, and moves the store through one state machine
(`store.faults`: READY, SHORT_OF_SPACE, FAULTED, LOST); `fault` is the reason until `probe`
succeeds, and `on_fault` hears of every change.
"""
from __future__ import annotations

from typing import Callable

from planner_service.store.protocol import Store
from planner_service.store.records import (COLUMNS, FAILED, NAMES, PLANNED, STEP_EVENTS, SUBMITTED, StepRecord,
                                           is_postgres_url)

__all__ = ["Store", "StepRecord", "open_store", "is_postgres_url", "SUBMITTED", "PLANNED", "FAILED", "COLUMNS",
           "NAMES", "STEP_EVENTS"]


def open_store(db: str, *, synchronous: str = "FULL", min_free_bytes: int = 0,
               on_fault: Callable[[str | None], None] | None = None, accept_data_loss: bool = False) -> Store:
    """The store for `db`: a PostgreSQL URL, or a SQLite file path (":memory:": throwaway).

    Args:
        synchronous: SQLite `synchronous` pragma (PostgreSQL commits durably, as configured there).
        min_free_bytes: SQLite: disk space writes leave free (PostgreSQL manages its own disk).
        on_fault: told of every change of the fault state (the reason, or None when healthy again),
            with the store's lock held: it must not call the store.
        accept_data_loss: SQLite: serve a database that lacks acknowledged writes as it is
            (`store.acked`) instead of staying faulted.
    """
    # each backend imported on use (optional, chosen by the URL): a SQLite service never loads psycopg and libpq
    if is_postgres_url(db):
        from planner_service.store.postgres import PostgresStore

        return PostgresStore(db, on_fault=on_fault)
    from planner_service.store.sqlite import SQLiteStore

    return SQLiteStore(db, synchronous=synchronous, min_free_bytes=min_free_bytes, on_fault=on_fault,
                       accept_data_loss=accept_data_loss)
