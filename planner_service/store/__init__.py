"""Durable step stores: the `Store` protocol, what both backends keep, and `open_store`.

    store = open_store("harts.db")                         # SQLiteStore: one file, WAL mode, one process
    store = open_store("postgresql://harts@db:5432/harts")  # PostgresStore: shared by replicas

Both keep per step the submitted body and its content digest, the forest counts, the topology,
the state and every rank's sealed slice (written with the PLANNED state, in one transaction),
compressed (`stored_form`); every storage error is a `StorageError` and a state of one fault
machine (`store.faults`). See docs/design/service.md ("Storage", "Durability").
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
