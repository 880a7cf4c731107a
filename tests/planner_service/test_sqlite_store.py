"""SQLiteStore durability in-process: every acknowledged write is in the database file, a deleted
database is written back from the open connection, and a start on a database that lacks
acknowledged writes is faulted until accepted (`store.acked`)."""
from __future__ import annotations

import shutil
import sqlite3
import time
from pathlib import Path

import pytest

from planner_service.errors import StorageError
from planner_service.store.records import SUBMITTED, StepRecord
from planner_service.store.sqlite import SQLiteStore


def _record(step_id: str) -> StepRecord:
    return StepRecord(step_id=step_id, body_sha256="content-v2:x", body_format="json", trajectories=1,
                      unique_tokens=3, expanded_tokens=3, submitted_at=time.time(), state=SUBMITTED)


def _insert(store: SQLiteStore, *step_ids: str) -> None:
    for step_id in step_ids:
        assert store.insert_step(_record(step_id), f'{{"batch_id": "{step_id}"}}'.encode()) is None


def _in_the_file(db: Path) -> set[str]:
    """Step ids the database file holds by itself (its WAL ignored)."""
    ro = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
    try:
        return {r[0] for r in ro.execute("SELECT step_id FROM steps")}
    finally:
        ro.close()


def _until(check, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_every_acknowledged_write_is_in_the_database_file(tmp_path):
    """A WAL deleted (then the process killed) before a checkpoint took every write since the last
    one: each write is copied into the database file before it is acknowledged."""
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    try:
        _insert(store, "a", "b")
        assert _in_the_file(db) == {"a", "b"}
        store.request_plan("a", b"topology")
        store.save_failure("a", topology=b"topology", error="no room")
        assert store.delete("b")
        assert _in_the_file(db) == {"a"}
        ro = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
        assert ro.execute("SELECT error FROM steps WHERE step_id = 'a'").fetchone()[0] == "no room"
        assert ro.execute("SELECT value FROM meta WHERE key = 'writes'").fetchone()[0] == 5  # and each was counted
        ro.close()
    finally:
        store.close()


@pytest.mark.parametrize("files", [("",), ("", "-wal", "-shm")], ids=["database", "database-and-wal"])
def test_a_deleted_database_is_written_back_from_the_open_connection(tmp_path, files):
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    try:
        _insert(store, "a", "b", "c")
        store.watch_files()
        for suffix in files:
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        _until(db.exists)  # the watch writes it back within a tenth of a second or so
        assert store.probe() is None
        # a second process on the file, as after a kill -9 of this one: every acknowledged write
        after = SQLiteStore(db)
        try:
            assert after.fault is None and {r.step_id for r in after.list(10)} == {"a", "b", "c"}
        finally:
            after.close()
        _insert(store, "d")  # and the store goes on writing to the file at `path`
        assert store.fault is None and "d" in _in_the_file(db)
    finally:
        store.close()


def test_a_start_on_a_database_that_lacks_acknowledged_writes_is_not_healthy_until_accepted(tmp_path):
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    _insert(store, "a")
    store.close()
    shutil.copy(db, tmp_path / "older.db")
    store = SQLiteStore(db)
    _insert(store, "b")
    store.close()
    shutil.copy(tmp_path / "older.db", db)  # restored from an older copy while the service was down

    store = SQLiteStore(db)
    try:
        assert store.fault is not None and "lacks acknowledged writes" in store.fault
        assert "holds 1 of the 2 write(s)" in store.fault and "--accept-data-loss" in store.fault
        assert store.probe() == store.fault  # for good, not cleared by a probe
        with pytest.raises(StorageError):
            _insert(store, "c")
        assert [r.step_id for r in store.list(10)] == ["a"]  # reads go on
    finally:
        store.close()
    store = SQLiteStore(db, accept_data_loss=True)
    try:
        assert store.fault is None
        _insert(store, "c")
    finally:
        store.close()
    store = SQLiteStore(db)  # accepted once: the mark follows this database from now on
    try:
        assert store.fault is None and {r.step_id for r in store.list(10)} == {"a", "c"}
    finally:
        store.close()

    db.unlink()  # deleted while the service was down: a new, empty database is not the one acknowledged
    store = SQLiteStore(db)
    try:
        assert store.fault is not None and "not the database the service acknowledged" in store.fault
    finally:
        store.close()


def test_a_database_of_an_earlier_version_without_a_mark_opens_healthy(tmp_path):
    db = tmp_path / "s.db"
    store = SQLiteStore(db)
    _insert(store, "a")
    store.close()
    Path(f"{db}.acked").unlink()
    with sqlite3.connect(db) as raw:
        raw.execute("DELETE FROM meta")
    store = SQLiteStore(db)
    try:
        assert store.fault is None and Path(f"{db}.acked").exists()
        _insert(store, "b")
    finally:
        store.close()
