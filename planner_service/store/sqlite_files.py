"""The SQLite store's files: opening them (schema, pragmas, a read-only fallback), their identity,
their sizes, and the VACUUM that converts a database of an earlier version. `store.sqlite` owns
the connection and the fault state; these functions only touch the files and one connection.
See docs/design/service.md.
"""
from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from pathlib import Path
from typing import NamedTuple

from planner_service.store.acked import new_database_id

log = logging.getLogger(__name__)

__all__ = ["FAULTS", "Opened", "is_fault", "describe", "ident_of", "fsync_dir", "connect", "connect_for_reading",
           "disk_free", "file_bytes", "free_pages", "convert_to_incremental"]

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

VACUUM_PAGES = 256
"""Pages one compaction transaction gives back while the disk has room (16 MiB of 64 KiB pages)."""

WAL_KEEP_BYTES = 16 << 20
"""WAL size kept after a checkpoint (`journal_size_limit`): its blocks take the frames of a
deletion or a compaction step on a full disk."""

#: SQLite errors that mean the storage, not the statement, is at fault (full, read-only, I/O,
#: locked, corrupt). Integrity and programming errors are bugs and propagate unchanged.
FAULTS = (sqlite3.OperationalError, sqlite3.InternalError, OSError)


def is_fault(exc: BaseException) -> bool:
    return isinstance(exc, FAULTS) or type(exc) is sqlite3.DatabaseError  # "file is not a database"


def describe(exc: BaseException, doing: str, path: str) -> str:
    """The client-safe fault reason of `exc`, raised while `doing` the database at `path`."""
    if isinstance(exc, sqlite3.Error):
        name = getattr(exc, "sqlite_errorname", None)
        what = f"{exc} ({name})" if name else str(exc)
    elif isinstance(exc, OSError):
        what = exc.strerror or str(exc)
        if exc.filename and exc.filename != path:
            what += f" ({exc.filename})"
    else:
        what = str(exc)
    return f"storage: {what} while {doing} {path}"


def ident_of(path: str) -> tuple[int, int] | None:
    """(device, inode) of a file, None when there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def fsync_dir(path: str) -> None:
    """Make a rename in the folder of `path` durable."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Opened(NamedTuple):
    """An open database connection and what the store reads from it once."""

    db: sqlite3.Connection
    inline_bodies: bool
    """The steps table keeps bodies inline (a database of an earlier version)."""
    database_id: str
    """The database's id ("": a database of an earlier version)."""
    writes: int
    """Acknowledged writes the database counts."""


def _opened(db: sqlite3.Connection) -> Opened:
    inline = any(r[1] == "body" for r in db.execute("PRAGMA table_info(steps)"))
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        return Opened(db, inline, "", 0)
    meta = dict(db.execute("SELECT key, value FROM meta WHERE key IN ('database_id', 'writes')").fetchall())
    return Opened(db, inline, str(meta.get("database_id", "")), int(meta.get("writes", 0)))


def connect(path: str, synchronous: str) -> Opened:
    """Open (creating it with its folder) the database for writing, in WAL mode with the schema."""
    if path != ":memory:":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
    try:
        # Bodies and slices are megabyte blobs: 64 KiB pages write them about twice as fast as
        # the default 4 KiB. Both pragmas only apply to a new file (WAL mode fixes the page
        # size afterwards); incremental auto-vacuum lets `compact` shrink the file in place.
        db.execute("PRAGMA page_size=65536")
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode.lower() not in ("wal", "memory"):
            raise sqlite3.OperationalError(f"cannot use WAL mode (journal_mode stays {mode})")
        db.execute(f"PRAGMA synchronous={synchronous}")
        db.execute("PRAGMA secure_delete=FAST")
        db.execute(f"PRAGMA journal_size_limit={WAL_KEEP_BYTES}")
        db.executescript(_SCHEMA)
        db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('database_id', ?), ('writes', 0)",
                   (new_database_id(),))
        return _opened(db)
    except BaseException:
        db.close()
        raise


def connect_for_reading(path: str) -> Opened | None:
    """A connection that only reads, for a database that cannot be opened for writing (a full
    disk, a read-only file): acknowledged steps stay readable while the store is faulted. None
    when even that fails."""
    if path == ":memory:" or not os.path.exists(path):
        return None
    # read-only needs the -shm (and -wal) to exist or be creatable; after a clean stop they
    # are gone (or left empty by the failed open) and the file holds every commit, so on a
    # full disk it is read as immutable
    try:
        wal_bytes = os.path.getsize(path + "-wal")
    except OSError:
        wal_bytes = 0
    modes = ["mode=ro"] + ([] if wal_bytes else ["immutable=1"])
    for mode in modes:
        try:
            db = sqlite3.connect(f"file:{path}?{mode}", uri=True, isolation_level=None,
                                 check_same_thread=False, timeout=30.0)
            db.execute("SELECT COUNT(*) FROM steps").fetchone()
            opened = _opened(db)
        except sqlite3.Error as exc:
            log.warning("%s cannot be opened for reading (%s): %s", path, mode, exc)
            continue
        log.warning("%s opened for reading only until it can be written", path)
        return opened
    return None


def disk_free(path: str) -> int | None:
    """Free bytes on the file system of the database at `path` (None for ":memory:" or when unknown)."""
    if path == ":memory:":
        return None
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:
        return None


def file_bytes(path: str) -> int:
    """Bytes of the database file and its WAL (0 for ":memory:")."""
    if path == ":memory:":
        return 0
    total = 0
    for suffix in ("", "-wal"):
        try:
            total += os.path.getsize(path + suffix)
        except OSError:
            pass
    return total


def free_pages(db: sqlite3.Connection, path: str, pages: int, *, short_of_space: bool) -> int:
    """Give up to `pages` free pages back to the file system in one checkpointed transaction:
    `VACUUM_PAGES`, or, while the disk is short of space, what the WAL's blocks hold (a moved page
    takes a frame, its parent and pointer-map pages up to two more). Returns the free pages left."""
    chunk = VACUUM_PAGES
    if short_of_space:
        try:
            frames = os.path.getsize(path + "-wal") // (db.execute("PRAGMA page_size").fetchone()[0] + 24)
        except OSError:
            frames = 0
        chunk = max(1, frames // 3)
    db.execute("BEGIN IMMEDIATE")
    for _ in range(min(pages, chunk)):  # a statement frees one page (Python steps it once)
        db.execute("PRAGMA incremental_vacuum").fetchall()
    db.execute("COMMIT")
    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()  # truncates the database file
    return db.execute("PRAGMA freelist_count").fetchone()[0]


def convert_to_incremental(db: sqlite3.Connection, path: str, size: int) -> None:
    """Convert a database of an earlier version to incremental auto-vacuum (one VACUUM), when
    the disk has room for the copy (twice the file's `size`)."""
    need = 2 * size
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if free < need:
        log.warning("not compacting %s: VACUUM needs about %d free bytes, the disk has %d", path, need, free)
        return
    t0 = time.perf_counter()
    db.execute("PRAGMA auto_vacuum=INCREMENTAL")
    db.execute("VACUUM")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    log.info("vacuumed %s in %.1f s (incremental auto-vacuum from now on)", path, time.perf_counter() - t0)
