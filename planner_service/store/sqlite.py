"""SQLite step store (WAL mode): the embedded default, one process (`planner_service.store`).

Bodies live in their own table, so reading a step's record never walks the overflow pages of a
large body (databases of earlier versions keep theirs inline).

Durability: every acknowledged write is checkpointed from the WAL into the database file before
it is acknowledged (the WAL only ever holds the write in progress), counted in the database
(`meta.writes`) and then in the mark beside it (`store.acked`). A start on a database that lacks
acknowledged writes (deleted, replaced or restored from an older copy while the service was down
or killed) is faulted for good, not ready, until started once with `accept_data_loss`.

Storage faults: while faulted, writes are refused at once (reads still go to the database) until
`probe` succeeds. A healthy store's probe writes nothing (an idle server leaves the disk alone):
it checks that the database and its WAL are the files opened, that both are writable, and that
the disk has `min_free_bytes` free; during a fault it commits a one-row write, reopening the
database when that helps (a file that was read-only at start). The files are also looked at ten
times a second (`watch_files`), and before every write: a database deleted under the running
service is copied back from the open connection (SQLite's backup API) and serving goes on; when
that fails, or the file was replaced by another one, writes are refused and readiness says why
until a restart. A WAL deleted under it loses nothing (the database holds every acknowledged
write); a new one is started.

Disk space: a write that would leave less than `min_free_bytes` free is refused with a
`StorageError` (`need` says how much it wants) before SQLite fills the disk; the store is faulted
(not ready) only while less than `min_free_bytes` is free, so small writes go on when a plan does
not fit. Opening a database on a full disk still serves reads. Deleting and compacting go on
while the disk is full (`short_of_space`), and need no new disk space: freed pages are not
overwritten (`secure_delete=FAST`, so a deletion changes a few pages), the WAL keeps up to
`_WAL_KEEP_BYTES` of its blocks after a checkpoint, and compaction moves no more pages per
checkpointed transaction than those blocks take.

Retention and compaction: `delete` removes a step with its body and slices; `expired` names the
steps a count or age policy drops; `compact` returns the freed pages to the file system
(`PRAGMA incremental_vacuum` on databases created with incremental auto-vacuum, which new ones
are; an older one is converted by one `VACUUM` only on request, `harts serve --vacuum`, since it
copies the whole file while every other call waits, and only when the disk has room for the copy).

The store is thread-safe: one connection guarded by a lock (SQLite serialises writers anyway, and
the service caches the hot reads, the sealed slices, in memory).
"""
from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Callable, Iterator

from planner_service.errors import NotFoundError, StorageError
from planner_service.store.acked import AckedMark, new_database_id
from planner_service.store.records import COLUMNS as _COLUMNS
from planner_service.store.records import NAMES as _NAMES
from planner_service.store.records import PLANNED, SUBMITTED, FAILED, StepRecord
from planner_service.store.stored_form import pack_body, pack_slice, unpack

log = logging.getLogger(__name__)

__all__ = ["SQLiteStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    step_id         TEXT PRIMARY KEY,
    body_sha256     TEXT NOT NULL,
    body_format     TEXT NOT NULL,
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
CREATE TABLE IF NOT EXISTS bodies (
    step_id TEXT PRIMARY KEY,
    body    BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS slices (
    step_id TEXT NOT NULL,
    rank    INTEGER NOT NULL,
    data    BLOB NOT NULL,
    PRIMARY KEY (step_id, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value
);
"""

_WATCH_S = 0.1
"""Seconds between two looks at the database and WAL files (`watch_files`)."""

_WAL_KEEP_BYTES = 16 << 20
"""WAL size kept after a checkpoint (`journal_size_limit`): its blocks take the frames of a
deletion or a compaction step on a full disk."""

_VACUUM_PAGES = 256
"""Pages one compaction transaction gives back while the disk has room (16 MiB of 64 KiB pages)."""

#: SQLite errors that mean the storage, not the statement, is at fault (full, read-only, I/O,
#: locked, corrupt). Integrity and programming errors are bugs and propagate unchanged.
_FAULTS = (sqlite3.OperationalError, sqlite3.InternalError, OSError)


def _ident_of(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _fsync_dir(path: str) -> None:
    """Make a rename in the folder of `path` durable."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_fault(exc: BaseException) -> bool:
    return isinstance(exc, _FAULTS) or type(exc) is sqlite3.DatabaseError  # "file is not a database"


class SQLiteStore:
    """SQLite persistence of steps and sealed plan slices.

    Opening never raises for a storage fault: the store starts faulted (see the module docstring)
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
        self._on_fault = on_fault
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._ident: tuple[int, int] | None = None
        self._wal_ident: tuple[int, int] | None = None
        self._inline_bodies = False
        self._gone: str | None = None
        self._vacuum_hint = False
        self._mark = AckedMark(self.path) if self.path != ":memory:" else None
        self._database_id = ""
        self._writes = 0
        self._watch: threading.Thread | None = None
        self._watch_stop = threading.Event()
        self.fault: str | None = None
        """Why the storage is unusable now; None when healthy."""
        self.short_of_space = False
        """The fault is only that the disk is fuller than `min_free_bytes` allows: deleting and
        compacting, which free space, go on."""
        try:
            self._db = self._connect()
        except BaseException as exc:
            if not _is_fault(exc):
                raise
            self.fault = self._reason(exc, "opening")
            self._db = self._connect_for_reading()
        self._check_acknowledged(accept_data_loss)
        if self._db is not None and self.fault is None:
            self.fault = self._space_fault()
            self.short_of_space = self.fault is not None

    # ---- connection and faults

    def _connect(self) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        try:
            # Bodies and slices are megabyte blobs: 64 KiB pages write them about twice as fast as
            # the default 4 KiB. Both pragmas only apply to a new file (WAL mode fixes the page
            # size afterwards); incremental auto-vacuum lets `compact` shrink the file in place.
            db.execute("PRAGMA page_size=65536")
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() not in ("wal", "memory"):
                raise sqlite3.OperationalError(f"cannot use WAL mode (journal_mode stays {mode})")
            db.execute(f"PRAGMA synchronous={self._synchronous}")
            db.execute("PRAGMA secure_delete=FAST")
            db.execute(f"PRAGMA journal_size_limit={_WAL_KEEP_BYTES}")
            db.executescript(_SCHEMA)
            self._inline_bodies = any(r[1] == "body" for r in db.execute("PRAGMA table_info(steps)"))
            db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('database_id', ?), ('writes', 0)",
                       (new_database_id(),))
            self._read_identity(db)
            if self.path != ":memory:":
                st = os.stat(self.path)
                ident = (st.st_dev, st.st_ino)
                if self._ident is not None and ident != self._ident:
                    raise OSError(f"{self.path} is another file than the one opened before")
                self._ident = ident
                self._wal_ident = _ident_of(self.path + "-wal")
        except BaseException:
            db.close()
            raise
        return db

    def _connect_for_reading(self) -> sqlite3.Connection | None:
        """A connection that only reads, for a database that cannot be opened for writing (a full
        disk, a read-only file): acknowledged steps stay readable while the store is faulted."""
        if self.path == ":memory:" or not os.path.exists(self.path):
            return None
        # read-only needs the -shm (and -wal) to exist or be creatable; after a clean stop they
        # are gone (or left empty by the failed open) and the file holds every commit, so on a
        # full disk it is read as immutable
        try:
            wal_bytes = os.path.getsize(self.path + "-wal")
        except OSError:
            wal_bytes = 0
        modes = ["mode=ro"] + ([] if wal_bytes else ["immutable=1"])
        for mode in modes:
            try:
                db = sqlite3.connect(f"file:{self.path}?{mode}", uri=True, isolation_level=None,
                                     check_same_thread=False, timeout=30.0)
                db.execute("SELECT COUNT(*) FROM steps").fetchone()
                self._inline_bodies = any(r[1] == "body" for r in db.execute("PRAGMA table_info(steps)"))
                self._read_identity(db)
            except sqlite3.Error as exc:
                log.warning("%s cannot be opened for reading (%s): %s", self.path, mode, exc)
                continue
            log.warning("%s opened for reading only until it can be written", self.path)
            return db
        return None

    def _read_identity(self, db: sqlite3.Connection) -> None:
        """The database's id and acknowledged writes (none in a database of an earlier version)."""
        if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
            self._database_id, self._writes = "", 0
            return
        meta = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('database_id', 'writes')").fetchall())
        self._database_id, self._writes = str(meta.get("database_id", "")), int(meta.get("writes", 0))

    def _check_acknowledged(self, accept: bool) -> None:
        """At open: fault for good when the database lacks writes the mark says were acknowledged
        (`accept`: log it and serve the database as it is); then mark what it holds."""
        if self._mark is None or self._db is None:
            return
        lost = self._mark.lost(self._database_id, self._writes)
        if lost is not None and not accept:
            self._gone = (f"storage: {self.path} lacks acknowledged writes: {lost}. It was deleted, replaced or "
                          "restored from an older copy while the service was down or killed. Put the right file "
                          "back, or start once with `harts serve --accept-data-loss` to serve it as it is")
            self.fault = self._gone
            return
        if lost is not None:
            log.warning("serving %s as it is (--accept-data-loss): %s", self.path, lost)
        if self.fault is None:
            self._mark.write(self._database_id, self._writes)

    def free_bytes(self) -> int | None:
        """Free bytes on the database's file system (None for ":memory:" or when unknown)."""
        if self.path == ":memory:":
            return None
        try:
            return shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free
        except OSError:
            return None

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
            self._set_fault(fault, space=True)
        raise StorageError(f"storage: the disk holding {self.path} is too full for {what}: it needs about {need} "
                           f"bytes, {free} are free and {self.min_free_bytes} stay free (`harts serve --min-free-mb`)",
                           need=need)

    def _reason(self, exc: BaseException, doing: str) -> str:
        if isinstance(exc, sqlite3.Error):
            name = getattr(exc, "sqlite_errorname", None)
            what = f"{exc} ({name})" if name else str(exc)
        elif isinstance(exc, OSError):
            what = exc.strerror or str(exc)
            if exc.filename and exc.filename != self.path:
                what += f" ({exc.filename})"
        else:
            what = str(exc)
        return f"storage: {what} while {doing} {self.path}"

    def _set_fault(self, reason: str | None, *, space: bool = False) -> None:
        self.short_of_space = space and reason is not None
        if reason == self.fault:
            return
        self.fault = reason
        if self._on_fault is not None:
            self._on_fault(reason)

    def _check_file(self) -> None:
        """Fault when the database or its WAL cannot be written (made read-only or immutable: WAL
        appends may still pass, the checkpoint and the next start would not); copy a deleted
        database back from the open connection; fault for good when that fails or the file at
        `path` is another one (later writes would be lost)."""
        if self._gone is None and self.path != ":memory:" and self._ident is not None:
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) != self._ident:
                    self._gone = (f"storage: the database file {self.path} was replaced by another file while "
                                  "the service ran; writes are refused; restart the service to use the new file "
                                  "(with --accept-data-loss: it lacks the writes acknowledged here)")
            except FileNotFoundError:
                self._restore_deleted()
            except OSError as exc:
                self._set_fault(self._reason(exc, "checking"))
                raise StorageError(self.fault) from None
        if self._gone is not None:
            self._set_fault(self._gone)
            raise StorageError(self._gone)
        if self.path != ":memory:":
            self._check_wal()
            for name in (self.path, self.path + "-wal"):
                if os.path.exists(name) and not os.access(name, os.W_OK):
                    self._set_fault(f"storage: {name} is not writable (read-only or immutable)")
                    raise StorageError(self.fault)

    def _restore_deleted(self) -> None:
        """The database file was deleted under the open connection: copy the database the
        connection still reads to a new file (SQLite's backup API), close the connection, remove
        what is left of the deleted database's WAL, rename the copy to `path` and reopen it.
        `_gone` when that fails (before the close, the open connection keeps serving reads)."""
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
            if not _is_fault(exc):
                raise
            self._gone = (f"storage: the database file {self.path} was deleted while the service ran and could not "
                          f"be written back ({exc}); writes are refused (they would be lost); stop the service and "
                          "put the file back")
            return
        self._db.close()
        self._db = None
        try:
            for leftover in (self.path + "-wal", self.path + "-shm"):  # the deleted database's
                with suppress(FileNotFoundError):
                    os.unlink(leftover)
            os.rename(tmp, self.path)
            _fsync_dir(self.path)
            self._ident = self._wal_ident = None
            self._db = self._connect()
        except BaseException as exc:
            if not _is_fault(exc):
                raise
            where = self.path if os.path.exists(self.path) else tmp
            self._gone = (f"storage: the database file {self.path} was deleted while the service ran; it was copied "
                          f"to {where} but cannot be opened there for writing ({exc}); writes are refused; stop the "
                          f"service, make sure the copy is at {self.path}, and start it again")
            self._db = self._connect_for_reading()
            return
        log.warning("the database file %s was deleted while the service ran: wrote the open database back "
                    "(%d acknowledged writes) and serving on", self.path, self._writes)

    def _check_wal(self) -> None:
        """A WAL deleted or replaced under the open connection: checkpoint the one still open into
        the database (a safeguard: every acknowledged write is there already) and start a new one."""
        if self._wal_ident is None or self._db is None or _ident_of(self.path + "-wal") == self._wal_ident:
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
            if not _is_fault(exc):
                raise
            self._gone = (f"storage: the WAL of {self.path} was deleted while the service ran and could not be "
                          f"checkpointed ({exc}); writes are refused; restart the service")
            self._set_fault(self._gone)
            raise StorageError(self._gone) from None

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
                if self.fault is not None and not (frees and self.short_of_space):
                    raise StorageError(self.fault)
            try:
                yield self._db
            except BaseException as exc:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                if not _is_fault(exc):
                    raise
                self._set_fault(self._reason(exc, doing))
                raise StorageError(self.fault) from None

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
                self._set_fault(space, space=True)
                return space
            try:
                if self.fault is None and self._db is not None:
                    self._db.execute("SELECT 1 FROM meta LIMIT 1").fetchall()
                    return None
                if self._db is None:
                    self._db = self._connect()
                self._probe_write(self._db)
            except BaseException as exc:
                if not _is_fault(exc):
                    raise
                reason = self._reason(exc, "writing to")
                if self._db is not None:
                    # a connection opened read-only, or left unusable by an I/O error: try a new one
                    try:
                        fresh = self._connect()
                    except BaseException as exc2:
                        if not _is_fault(exc2):
                            raise
                    else:
                        try:
                            self._probe_write(fresh)
                        except BaseException as exc2:
                            fresh.close()
                            if not _is_fault(exc2):
                                raise
                        else:
                            self._db.close()
                            self._db = fresh
                            self._set_fault(None)
                            return None
                self._set_fault(reason)
                return reason
            self._set_fault(None)
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
                    if self._db is None or self._gone is not None:
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
            if self._db is not None and self._gone is None and self.path != ":memory:":
                try:
                    self._check_file()
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
                except (StorageError, *_FAULTS) as exc:
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

    def _row(self, row) -> StepRecord:
        return StepRecord.from_row(row)

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
                return self._row(row)
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
        return self._row(row)

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
        return [self._row(r) for r in rows]

    def pending(self) -> list[StepRecord]:
        """Steps with a requested topology that were never planned (planning was interrupted)."""
        with self._op("reading", write=False) as db:
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM steps WHERE state = ? AND topology IS NOT NULL ORDER BY rowid",
                (SUBMITTED,),
            ).fetchall()
        return [self._row(r) for r in rows]

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
        Goes on while the disk is short of space (module docstring)."""
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
        checkpointed transactions between which other calls go on: `_VACUUM_PAGES` pages each,
        or, while the disk is short of space, as many as the WAL's blocks hold, so that compaction
        needs no new disk space. An older database only reuses its free pages, unless `vacuum`:
        one VACUUM then converts it, writing a copy of the whole file while every other database
        call waits, so it is never run behind the users' back (`harts serve --vacuum` runs it
        before the service is ready), and only when the disk has room for twice the file.
        """
        with self._op("compacting", write=True, frees=not vacuum) as db:
            before = self._file_bytes()
            mode = db.execute("PRAGMA auto_vacuum").fetchone()[0]
            if mode != 2 and not vacuum:
                if not self._vacuum_hint:
                    self._vacuum_hint = True
                    log.warning("%s predates incremental auto-vacuum: space of deleted steps is reused but the file "
                                "does not shrink; restart once with `harts serve --vacuum` to convert it", self.path)
                return 0
            if mode != 2:
                if self.path != ":memory:":
                    self._vacuum(db, before)
                return max(0, before - self._file_bytes())
            pages = db.execute("PRAGMA freelist_count").fetchone()[0]
        while pages > 0:
            with self._op("compacting", write=True, frees=True) as db:
                db.execute("BEGIN IMMEDIATE")
                for _ in range(min(pages, self._vacuum_chunk(db))):  # a statement frees one page (Python steps it once)
                    db.execute("PRAGMA incremental_vacuum").fetchall()
                db.execute("COMMIT")
                db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # truncates the database file
                left = db.execute("PRAGMA freelist_count").fetchone()[0]
            if left >= pages:
                break
            pages = left
        return max(0, before - self._file_bytes())

    def _vacuum_chunk(self, db: sqlite3.Connection) -> int:
        """Pages one compaction transaction moves: `_VACUUM_PAGES`, or, while the disk is short of
        space, what the WAL's blocks hold (a moved page takes a frame, its parent and pointer-map
        pages up to two more)."""
        if not self.short_of_space:
            return _VACUUM_PAGES
        try:
            frames = os.path.getsize(self.path + "-wal") // (db.execute("PRAGMA page_size").fetchone()[0] + 24)
        except OSError:
            frames = 0
        return max(1, frames // 3)

    def _vacuum(self, db: sqlite3.Connection, size: int) -> None:
        """Convert a database of an earlier version to incremental auto-vacuum (one VACUUM), when
        the disk has room for the copy."""
        need = 2 * size
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free
        if free < need:
            log.warning("not compacting %s: VACUUM needs about %d free bytes, the disk has %d", self.path, need, free)
            return
        t0 = time.perf_counter()
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("VACUUM")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        log.info("vacuumed %s in %.1f s (incremental auto-vacuum from now on)", self.path, time.perf_counter() - t0)

    def _file_bytes(self) -> int:
        if self.path == ":memory:":
            return 0
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(self.path + suffix)
            except OSError:
                pass
        return total
