"""SQLite step store (WAL mode): the embedded default, one process (`planner_service.store`).

    store = SQLiteStore("harts.db", min_free_bytes=64 << 20, on_fault=readiness.storage_changed)
    store.watch_files(); ...; store.close()          # watcher of the files; final checkpoint

Every acknowledged write is checkpointed into the database file and counted in the database and
in its mark (`store.acked`); a deleted database is copied back with SQLite's backup API, else the
store is LOST; a full disk makes it SHORT_OF_SPACE, where deleting and compacting still go on.
Thread-safe: one connection under a lock; the files themselves are `store.sqlite_files`.
See docs/design/service.md ("Durability").
"""
from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from planner_service.errors import NotFoundError, StorageError
from planner_service.store.acked import AckedMark
from planner_service.store.faults import FaultState
from planner_service.store.records import COLUMNS as _COLUMNS
from planner_service.store.records import NAMES as _NAMES
from planner_service.store.records import PLANNED, SUBMITTED, FAILED, StepRecord
from planner_service.store.sqlite_files import (FAULTS, connect, connect_for_reading, convert_to_incremental,
                                                describe, disk_free, file_bytes, free_pages, fsync_dir, ident_of,
                                                is_fault)
from planner_service.store.stored_form import pack_body, pack_slice, unpack

log = logging.getLogger(__name__)

__all__ = ["SQLiteStore"]

_WATCH_S = 0.1
"""Seconds between two looks at the database and WAL files (`watch_files`)."""

class SQLiteStore:
    """SQLite persistence of steps and sealed plan slices.

    Opening never raises for a storage fault: the store starts faulted (docs/design/service.md)
    and `probe` opens it once the file can be opened and written.

    Args:
        path: database file (created with its folder); ":memory:" for a throwaway store.
        synchronous: SQLite `synchronous` pragma; FULL survives power loss, NORMAL process crashes.
        min_free_bytes: disk space a write must leave free (0: none; SQLite's own "disk full" then
            faults the store).
        on_fault: called with the new fault reason (None: healthy again) on every change, with the
            store's lock held: it must not call the store.
        accept_data_loss: open a database that lacks acknowledged writes (see `store.acked`) and
            serve it as it is, instead of staying faulted.
    """

    shared = False
    """Only this process writes the database (PostgreSQL stores are shared by replicas)."""

    def __init__(self, path: str | Path, *, synchronous: str = "FULL", min_free_bytes: int = 0,
                 on_fault: Callable[[str | None], None] | None = None, accept_data_loss: bool = False):
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"synchronous: expected OFF, NORMAL, FULL or EXTRA, got {synchronous!r}")
        if min_free_bytes < 0:
            raise ValueError(f"min_free_bytes: expected >= 0, got {min_free_bytes}")
        self.path = str(path)
        self.min_free_bytes = int(min_free_bytes)
        self._synchronous = synchronous.upper()
        self._faults = FaultState(is_fault=is_fault, describe=lambda exc, doing: describe(exc, doing, self.path))
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._ident: tuple[int, int] | None = None
        self._wal_ident: tuple[int, int] | None = None
        self._inline_bodies = False
        self._vacuum_hint = False
        self._mark = AckedMark(self.path) if self.path != ":memory:" else None
        self._database_id = ""
        self._writes = 0
        self._watch: threading.Thread | None = None
        self._watch_stop = threading.Event()
        try:
            self._db = self._connect()
        except BaseException as exc:
            if not is_fault(exc):
                raise
            self._faults.set(describe(exc, "opening", self.path))
            self._db = self._connect_for_reading()
        self._check_acknowledged(accept_data_loss)
        if self._db is not None and self.fault is None:
            space = self._space_fault()
            self._faults.set(space, space=space is not None)
        self._faults.on_change = on_fault  # from now on: opening tells nobody

    @property
    def fault(self) -> str | None:
        """Why the storage is unusable now; None when healthy."""
        return self._faults.reason

    @property
    def short_of_space(self) -> bool:
        """The fault is only that the disk is fuller than `min_free_bytes` allows: deleting and
        compacting, which free space, go on."""
        return self._faults.short_of_space

    # ---- connection and faults

    def _connect(self) -> sqlite3.Connection:
        opened = connect(self.path, self._synchronous)
        db = opened.db
        try:
            self._inline_bodies, self._database_id, self._writes = opened[1:]
            if self.path != ":memory:":
                st = os.stat(self.path)
                ident = (st.st_dev, st.st_ino)
                if self._ident is not None and ident != self._ident:
                    raise OSError(f"{self.path} is another file than the one opened before")
                self._ident = ident
                self._wal_ident = ident_of(self.path + "-wal")
        except BaseException:
            db.close()
            raise
        return db

    def _connect_for_reading(self) -> sqlite3.Connection | None:
        opened = connect_for_reading(self.path)
        if opened is None:
            return None
        self._inline_bodies, self._database_id, self._writes = opened[1:]
        return opened.db

    def _check_acknowledged(self, accept: bool) -> None:
        """At open: LOST when the database lacks writes the mark says were acknowledged
        (`accept`: log it and serve the database as it is); then mark what it holds."""
        if self._mark is None or self._db is None:
            return
        lost = self._mark.lost(self._database_id, self._writes)
        if lost is not None and not accept:
            self._faults.lose(f"storage: {self.path} lacks acknowledged writes: {lost}. It was deleted, replaced or "
                              "restored from an older copy while the service was down or killed. Put the right file "
                              "back, or start once with `harts serve --accept-data-loss` to serve it as it is")
            self._faults.set(self._faults.lost)
            return
        if lost is not None:
            log.warning("serving %s as it is (--accept-data-loss): %s", self.path, lost)
        if self.fault is None:
            self._mark.write(self._database_id, self._writes)

    def free_bytes(self) -> int | None:
        """Free bytes on the database's file system (None for ":memory:" or when unknown)."""
        return disk_free(self.path)

    def _space_fault(self) -> str | None:
        free = self.free_bytes()
        if free is None or free >= self.min_free_bytes or not self.min_free_bytes:
            return None
        return (f"storage: the disk holding {self.path} is full: {free} bytes free, less than the "
                f"{self.min_free_bytes} writes must leave (`harts serve --min-free-mb`); free some space")

    def _check_space(self, need: int, what: str) -> None:
        """Refuse a write of about `need` bytes that would leave less than min_free_bytes free."""
        if not self.min_free_bytes:
            return
        free = self.free_bytes()
        if free is None or free - need >= self.min_free_bytes:
            return
        fault = self._space_fault()
        if fault is not None:
            self._faults.set(fault, space=True)
        raise StorageError(f"storage: the disk holding {self.path} is too full for {what}: it needs about {need} "
                           f"bytes, {free} are free and {self.min_free_bytes} stay free (`harts serve --min-free-mb`)",
                           need=need)

    def _check_file(self) -> None:
        """Fault when the database or its WAL cannot be written (made read-only or immutable: WAL
        appends may still pass, the checkpoint and the next start would not); copy a deleted
        database back from the open connection; fault for good when that fails or the file at
        `path` is another one (later writes would be lost)."""
        if self._faults.lost is None and self.path != ":memory:" and self._ident is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) != self._ident:
                    self._faults.lose(f"storage: the database file {self.path} was replaced by another file while "
                                      "the service ran; writes are refused; restart the service to use the new file "
                                      "(with --accept-data-loss: it lacks the writes acknowledged here)")
            except FileNotFoundError:
                self._restore_deleted()
            except OSError as exc:
                raise self._faults.fail(describe(exc, "checking", self.path)) from None
        self._faults.check_lost()
        if self.path != ":memory:":
            self._check_wal()
            for name in (self.path, self.path + "-wal"):
                if os.path.exists(name) and not os.access(name, os.W_OK):
                    raise self._faults.fail(f"storage: {name} is not writable (read-only or immutable)")

    def _restore_deleted(self) -> None:
        """The database file was deleted under the open connection: copy the database the
        connection still reads to a new file (SQLite's backup API), close the connection, remove
        what is left of the deleted database's WAL, rename the copy to `path` and reopen it.
        LOST when that fails (before the close, the open connection keeps serving reads)."""
        tmp = self.path + ".restoring"
        try:
            copy = sqlite3.connect(tmp, isolation_level=None)
            try:
                self._db.backup(copy)
            finally:
                copy.close()
        except BaseException as exc:
            with suppress(OSError):
                os.unlink(tmp)  # a partial copy must not take the space the next start needs
            if not is_fault(exc):
                raise
            self._faults.lose(f"storage: the database file {self.path} was deleted while the service ran and could "
                              f"not be written back ({exc}); writes are refused (they would be lost); stop the service "
                              "and put the file back")
            return
        self._db.close()
        self._db = None
        try:
            for leftover in (self.path + "-wal", self.path + "-shm"):  # the deleted database's
                with suppress(FileNotFoundError):
                    os.unlink(leftover)
            os.rename(tmp, self.path)
            fsync_dir(self.path)
            self._ident = self._wal_ident = None
            self._db = self._connect()
        except BaseException as exc:
            if not is_fault(exc):
                raise
            where = self.path if os.path.exists(self.path) else tmp
            self._faults.lose(f"storage: the database file {self.path} was deleted while the service ran; it was "
                              f"copied to {where} but cannot be opened there for writing ({exc}); writes are refused; "
                              f"stop the service, make sure the copy is at {self.path}, and start it again")
            self._db = self._connect_for_reading()
            return
        log.warning("the database file %s was deleted while the service ran: wrote the open database back "
                    "(%d acknowledged writes) and serving on", self.path, self._writes)

    def _check_wal(self) -> None:
        """A WAL deleted or replaced under the open connection: checkpoint the one still open into
        the database (a safeguard: every acknowledged write is there already) and start a new one."""
        if self._wal_ident is None or self._db is None or ident_of(self.path + "-wal") == self._wal_ident:
            return
        log.warning("the WAL of %s was deleted or replaced while the service ran: checkpointing the open WAL "
                    "into the database and starting a new one", self.path)
        try:
            busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if busy:
                raise sqlite3.OperationalError("the checkpoint of the deleted WAL could not finish")
            self._db.close()
            self._db = None
            self._db = self._connect()
        except BaseException as exc:
            if not is_fault(exc):
                raise
            self._faults.lose(f"storage: the WAL of {self.path} was deleted while the service ran and could not be "
                              f"checkpointed ({exc}); writes are refused; restart the service")
            raise self._faults.fail(self._faults.lost) from None

    @contextmanager
    def _op(self, doing: str, *, write: bool, frees: bool = False) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock; storage errors become StorageError and set the fault.
        `frees`: a write that frees disk space (deleting, compacting) goes on while the disk is
        only short of space."""
        with self._lock:
            if self._db is None:
                raise StorageError(self.fault or f"storage: {self.path} is not open")
            if write:
                self._check_file()
                self._faults.check_write(frees=frees)
            with self._faults.translating(doing):
                try:
                    yield self._db
                except BaseException:
                    if self._db.in_transaction:
                        try:
                            self._db.execute("ROLLBACK")
                        except sqlite3.Error:
                            pass
                    raise

    def probe(self) -> str | None:
        """Check that the database can be written, reopening it if needed.

        Healthy: the file checks, the free space and a read, nothing written. Faulted: one
        committed row. Clears or sets the fault. Returns the fault (None: healthy).
        """
        with self._lock:
            try:
                self._check_file()
            except StorageError:
                return self.fault
            space = self._space_fault()
            if space is not None:
                self._faults.set(space, space=True)
                return space
            try:
                if self.fault is None and self._db is not None:
                    self._db.execute("SELECT 1 FROM meta LIMIT 1").fetchall()
                    return None
                if self._db is None:
                    self._db = self._connect()
                self._probe_write(self._db)
            except BaseException as exc:
                if not is_fault(exc):
                    raise
                reason = describe(exc, "writing to", self.path)
                if self._db is not None:
                    # a connection opened read-only, or left unusable by an I/O error: try a new one
                    try:
                        fresh = self._connect()
                    except BaseException as exc2:
                        if not is_fault(exc2):
                            raise
                    else:
                        try:
                            self._probe_write(fresh)
                        except BaseException as exc2:
                            fresh.close()
                            if not is_fault(exc2):
                                raise
                        else:
                            self._db.close()
                            self._db = fresh
                            self._faults.set(None)
                            return None
                self._faults.set(reason)
                return reason
            self._faults.set(None)
            return None

    @staticmethod
    def _probe_write(db: sqlite3.Connection) -> None:
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('probe', ?)", (time.time(),))

    def watch_files(self) -> None:
        """Look at the database and WAL files every `_WATCH_S` seconds from a daemon thread (until
        `close`), so that a deleted database is copied back at once, not at the next write or
        probe (a killed process would otherwise take the acknowledged writes with it)."""
        if self.path == ":memory:" or self._watch is not None:
            return

        def run() -> None:
            while not self._watch_stop.wait(_WATCH_S):
                with self._lock:
                    if self._db is None or self._faults.lost is not None:
                        continue
                    try:
                        self._check_file()
                    except StorageError:
                        pass  # the fault is set and logged
                    except Exception:
                        log.exception("watching %s failed; the probe and every write still check it", self.path)
                        return

        self._watch = threading.Thread(target=run, name="harts-db-watch", daemon=True)
        self._watch.start()

    def close(self) -> None:
        """Stop watching, checkpoint the WAL into the database and close it (SQLite then deletes
        the WAL and its index)."""
        self._watch_stop.set()
        if self._watch is not None:
            self._watch.join(timeout=10)
        with self._lock:
            if self._db is not None and self._faults.lost is None and self.path != ":memory:":
                try:
                    self._check_file()
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                except (StorageError, *FAULTS) as exc:
                    log.warning("closing %s without a final checkpoint: %s", self.path, exc)
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._mark is not None:
                self._mark.close()

    def _commit(self, db: sqlite3.Connection) -> None:
        """Commit a write the caller acknowledges: count it in the database, copy it from the WAL
        into the database file (a deleted WAL then loses nothing), then count it in the mark."""
        db.execute("UPDATE meta SET value = value + 1 WHERE key = 'writes'")
        db.execute("COMMIT")
        self._writes += 1
        busy, frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if busy or copied < frames:
            log.warning("%s: the checkpoint after a write copied %d of %d WAL frames", self.path, copied, frames)
        if self._mark is not None:
            self._mark.write(self._database_id, self._writes)

    @contextmanager
    def plan_lock(self, step_id: str, *, wait: bool = True) -> Iterator[bool]:
        """Planning a step is exclusive across processes: one process owns a SQLite file, and the
        core's per-step lock serialises its threads. Yields True."""
        yield True

    def listen(self, fn: Callable[[str, str], None]) -> None:
        """No other process writes this database: nothing to hear."""

    # ---- steps

    def insert_step(self, rec: StepRecord, body: bytes) -> StepRecord | None:
        """Store a new step with its body, unless its step_id is taken.

        Returns:
            None when stored; the stored record when the step_id exists (nothing is written then:
            the caller decides whether it is an idempotent retry or a conflict).
        """
        stored = pack_body(body)
        with self._op("storing a step in", write=True) as db:
            self._check_space(len(stored), f"step {rec.step_id[:80]!r}")
            db.execute("BEGIN IMMEDIATE")
            row = db.execute(f"SELECT {_COLUMNS} FROM steps WHERE step_id = ?", (rec.step_id,)).fetchone()
            if row is not None:
                db.execute("COMMIT")
                return StepRecord.from_row(row)
            names = _COLUMNS + (", body" if self._inline_bodies else "")
            values = [getattr(rec, n) for n in _NAMES] + ([b""] if self._inline_bodies else [])
            db.execute(f"INSERT INTO steps ({names}) VALUES ({', '.join('?' * len(values))})", values)
            db.execute("INSERT OR REPLACE INTO bodies (step_id, body) VALUES (?, ?)", (rec.step_id, stored))
            self._commit(db)
        return None

    def get(self, step_id: str) -> StepRecord:
        """The step's record; NotFoundError when unknown."""
        with self._op("reading", write=False) as db:
            row = db.execute(f"SELECT {_COLUMNS} FROM steps WHERE step_id = ?", (step_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"step_id: no step {step_id!r}")
        return StepRecord.from_row(row)

    def body(self, step_id: str) -> tuple[str, bytes]:
        """(format, body bytes) of a stored step."""
        with self._op("reading", write=False) as db:
            row = db.execute(
                "SELECT s.body_format, b.body FROM steps s LEFT JOIN bodies b USING (step_id) WHERE s.step_id = ?",
                (step_id,),
            ).fetchone()
            if row is not None and row[1] is None and self._inline_bodies:
                row = db.execute("SELECT body_format, body FROM steps WHERE step_id = ?", (step_id,)).fetchone()
        if row is None or row[1] is None:
            raise NotFoundError(f"step_id: no step {step_id!r}")
        return row[0], unpack(row[1])

    def list(self, limit: int) -> list[StepRecord]:
        """At most `limit` steps, newest submission first."""
        with self._op("reading", write=False) as db:
            rows = db.execute(f"SELECT {_COLUMNS} FROM steps ORDER BY rowid DESC LIMIT ?", (int(limit),)).fetchall()
        return [StepRecord.from_row(r) for r in rows]

    def pending(self) -> list[StepRecord]:
        """Steps with a requested topology that were never planned (planning was interrupted)."""
        with self._op("reading", write=False) as db:
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM steps WHERE state = ? AND topology IS NOT NULL ORDER BY rowid",
                (SUBMITTED,),
            ).fetchall()
        return [StepRecord.from_row(r) for r in rows]

    def count_unplanned(self) -> int:
        with self._op("reading", write=False) as db:
            return int(db.execute("SELECT COUNT(*) FROM steps WHERE state = ?", (SUBMITTED,)).fetchone()[0])

    def request_plan(self, step_id: str, topology: bytes) -> None:
        """Record the topology a step is about to be planned for (so a restart resumes it)."""
        with self._op("recording a plan request in", write=True) as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "UPDATE steps SET topology = ?, state = ?, error = '' WHERE step_id = ? AND state != ?",
                (topology, SUBMITTED, step_id, PLANNED),
            )
            self._commit(db)

    def save_plan(self, step_id: str, *, topology: bytes, stats: bytes, slices: list[bytes]) -> float:
        """Store the sealed slices and mark the step PLANNED, atomically. Returns planned_at.

        Raises:
            NotFoundError: the step was deleted meanwhile (nothing is written).
        """
        planned_at = time.time()
        stored = [pack_slice(s) for s in slices]
        with self._op("storing a plan in", write=True) as db:
            self._check_space(sum(map(len, stored)), f"the plan of step {step_id[:80]!r}")
            db.execute("BEGIN IMMEDIATE")
            updated = db.execute(
                "UPDATE steps SET state = ?, topology = ?, stats = ?, error = '', planned_at = ?, world_size = ? "
                "WHERE step_id = ?",
                (PLANNED, topology, stats, planned_at, len(slices), step_id),
            ).rowcount
            if not updated:
                db.execute("ROLLBACK")
                raise NotFoundError(f"step_id: no step {step_id!r} (deleted while it was planned)")
            db.execute("DELETE FROM slices WHERE step_id = ?", (step_id,))
            db.executemany("INSERT INTO slices (step_id, rank, data) VALUES (?, ?, ?)",
                           [(step_id, r, s) for r, s in enumerate(stored)])
            self._commit(db)
        return planned_at

    def save_failure(self, step_id: str, *, topology: bytes, error: str) -> None:
        """Mark the step FAILED with a client-safe reason."""
        with self._op("recording a planning failure in", write=True) as db:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "UPDATE steps SET state = ?, topology = ?, error = ?, planned_at = ? WHERE step_id = ? AND state != ?",
                (FAILED, topology, error, time.time(), step_id, PLANNED),
            )
            self._commit(db)

    def slice(self, step_id: str, rank: int) -> bytes | None:
        """Sealed slice bytes of one rank, None when absent."""
        with self._op("reading", write=False) as db:
            row = db.execute("SELECT data FROM slices WHERE step_id = ? AND rank = ?", (step_id, int(rank))).fetchone()
        return None if row is None else unpack(row[0])

    # ---- retention and compaction

    def delete(self, step_id: str) -> bool:
        """Delete a step with its body and slices, in one transaction; False when there was none.
        Goes on while the disk is short of space (it frees space; docs/design/service.md)."""
        with self._op("deleting a step from", write=True, frees=True) as db:
            db.execute("BEGIN IMMEDIATE")
            gone = db.execute("DELETE FROM steps WHERE step_id = ?", (step_id,)).rowcount
            db.execute("DELETE FROM bodies WHERE step_id = ?", (step_id,))
            db.execute("DELETE FROM slices WHERE step_id = ?", (step_id,))
            self._commit(db)
        return bool(gone)

    def expired(self, *, keep: int = 0, before: float = 0.0, limit: int = 1000) -> list[str]:
        """Step ids a retention policy drops, oldest submission first.

        Args:
            keep: keep only the newest `keep` steps (0: no count limit).
            before: drop steps submitted before this Unix time (0: no age limit).
            limit: at most this many ids.
        """
        out: list[str] = []
        with self._op("reading", write=False) as db:
            if keep > 0:
                out += [r[0] for r in db.execute(
                    "SELECT step_id FROM steps ORDER BY rowid DESC LIMIT ? OFFSET ?", (int(limit), int(keep))
                ).fetchall()][::-1]
            if before > 0:
                # submission order is rowid order: walk from the oldest and stop at the first kept one
                for step_id, submitted_at in db.execute("SELECT step_id, submitted_at FROM steps ORDER BY rowid"):
                    if submitted_at >= before or len(out) >= limit:
                        break
                    if step_id not in out:
                        out.append(step_id)
        return out[:limit]

    def compact(self, *, vacuum: bool = False) -> int:
        """Give free pages back to the file system. Returns the bytes freed.

        Databases created with incremental auto-vacuum (every new one) shrink in place, in
        checkpointed transactions between which other calls go on (`sqlite_files.free_pages`),
        or, while the disk is short of space, as many as the WAL's blocks hold, so that compaction
        needs no new disk space. An older database only reuses its free pages, unless `vacuum`:
        one VACUUM then converts it, writing a copy of the whole file while every other database
        call waits, so it is never run behind the users' back (`harts serve --vacuum` runs it
        before the service is ready), and only when the disk has room for twice the file.
        """
        with self._op("compacting", write=True, frees=not vacuum) as db:
            before = file_bytes(self.path)
            mode = db.execute("PRAGMA auto_vacuum").fetchone()[0]
            if mode != 2 and not vacuum:
                if not self._vacuum_hint:
                    self._vacuum_hint = True
                    log.warning("%s predates incremental auto-vacuum: space of deleted steps is reused but the file "
                                "does not shrink; restart once with `harts serve --vacuum` to convert it", self.path)
                return 0
            if mode != 2:
                if self.path != ":memory:":
                    convert_to_incremental(db, self.path, before)
                return max(0, before - file_bytes(self.path))
            pages = db.execute("PRAGMA freelist_count").fetchone()[0]
        while pages > 0:
            with self._op("compacting", write=True, frees=True) as db:
                left = free_pages(db, self.path, pages, short_of_space=self.short_of_space)
            if left >= pages:
                break
            pages = left
        return max(0, before - file_bytes(self.path))
