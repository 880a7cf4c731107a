"""PostgreSQL step store: one database that any number of `harts serve` replicas share.

    harts serve --db postgresql://harts@db.internal:5432/harts

Each write is one transaction, committed before the client is answered. A step is planned once
across replicas (`plan_lock`: a session advisory lock), every write that changes a step sends
`NOTIFY harts_steps` (`listen` wakes the other replicas' long-polls), and storage errors fault the
store until the probe reconnects (docs/design/service.md, "Replicas on PostgreSQL").
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import errors as pg_errors

from planner_service.errors import NotFoundError
from planner_service.store.faults import FaultState
from planner_service.store.records import COLUMNS, NAMES, PLANNED, SUBMITTED, FAILED, StepRecord
from planner_service.store.stored_form import pack_body, pack_slice, unpack

log = logging.getLogger(__name__)

__all__ = ["PostgresStore"]

_CHANNEL = "harts_steps"
_SCHEMA_LOCK = 0x4841525453  # "HARTS": serialises schema creation across replicas

_SCHEMA = """
CREATE TABLE IF NOT EXISTS harts_steps (
    seq             BIGSERIAL,
    step_id         TEXT PRIMARY KEY,
    body_sha256     TEXT NOT NULL,
    body_format     TEXT NOT NULL,
    trajectories    BIGINT NOT NULL,
    unique_tokens   BIGINT NOT NULL,
    expanded_tokens BIGINT NOT NULL,
    submitted_at    DOUBLE PRECISION NOT NULL,
    state           INTEGER NOT NULL,
    topology        BYTEA,
    stats           BYTEA,
    error           TEXT NOT NULL DEFAULT '',
    planned_at      DOUBLE PRECISION NOT NULL DEFAULT 0,
    world_size      INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS harts_steps_seq ON harts_steps (seq);
CREATE TABLE IF NOT EXISTS harts_bodies (
    step_id TEXT PRIMARY KEY,
    body    BYTEA NOT NULL
);
CREATE TABLE IF NOT EXISTS harts_slices (
    step_id TEXT NOT NULL,
    rank    INTEGER NOT NULL,
    data    BYTEA NOT NULL,
    PRIMARY KEY (step_id, rank)
);
"""

#: Errors that mean the database, not the statement, is at fault: a lost or refused connection,
#: a read-only or full database, a server shutting down. Integrity and programming errors are
#: bugs and propagate unchanged.
_FAULTS = (psycopg.OperationalError, psycopg.InterfaceError, psycopg.InternalError, OSError)


def _is_fault(exc: BaseException) -> bool:
    return isinstance(exc, _FAULTS) or isinstance(exc, pg_errors.ReadOnlySqlTransaction)


def _redacted(url: str) -> str:
    """The URL without its password (it goes into logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


def _lock_key(step_id: str) -> int:
    """A signed 64-bit advisory-lock key for a step id."""
    return int.from_bytes(hashlib.sha256(b"harts-plan:" + step_id.encode("utf-8", "surrogatepass")).digest()[:8],
                          "little", signed=True)


class PostgresStore:
    """PostgreSQL persistence of steps and sealed plan slices, shared by replicas (docs/design/service.md).

    Opening never raises for an unreachable database: the store starts faulted and `probe`
    connects once it can.

    Args:
        url: `postgresql://user[:password]@host[:port]/dbname[?options]` (libpq's URL form).
        on_fault: called with the new fault reason (None: healthy again) on every change, with the
            store's lock held: it must not call the store.
    """

    shared = True
    """Other replicas write the same database."""
    min_free_bytes = 0
    """PostgreSQL manages its own disk: a fault here is never only the service's space reserve."""

    def __init__(self, url: str, *, on_fault: Callable[[str | None], None] | None = None):
        self.url = url
        self.path = _redacted(url)
        self._faults = FaultState(is_fault=_is_fault, describe=self._reason)
        self._lock = threading.Lock()
        self._db: psycopg.Connection | None = None
        self._spare: list[psycopg.Connection] = []
        self._spare_lock = threading.Lock()
        self._listener: threading.Thread | None = None
        self._closing = False
        try:
            self._db = self._connect()
            self._create_schema(self._db)
        except BaseException as exc:
            if not _is_fault(exc):
                raise
            self._faults.set(self._reason(exc, "opening"))
        self._faults.on_change = on_fault  # from now on: opening tells nobody

    @property
    def fault(self) -> str | None:
        """Why the storage is unusable now; None when healthy."""
        return self._faults.reason

    @property
    def short_of_space(self) -> bool:
        """Never: PostgreSQL manages its own disk."""
        return False

    # ---- connections and faults

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url, autocommit=True, connect_timeout=10, application_name="harts-serve")

    @staticmethod
    def _create_schema(db: psycopg.Connection) -> None:
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            db.execute(_SCHEMA)

    def _reason(self, exc: BaseException, doing: str) -> str:
        what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        sqlstate = getattr(exc, "sqlstate", None)
        return f"storage: {what}{f' ({sqlstate})' if sqlstate else ''} while {doing} {self.path}"

    @contextmanager
    def _op(self, doing: str, *, write: bool) -> Iterator[psycopg.Connection]:
        """The main connection, under the lock (reconnected for reads after a failure); storage
        errors become StorageError and set the fault."""
        with self._lock:
            if write:
                self._faults.check_write()
            with self._faults.translating(doing):
                if self._db is None or self._db.broken or self._db.closed:
                    self._db = self._connect()
                yield self._db

    def probe(self) -> str | None:
        """Reconnect if needed and check that the database accepts writes; writes nothing.
        Clears or sets the fault; returns it (None: healthy)."""
        with self._lock:
            try:
                if self._db is None or self._db.broken or self._db.closed:
                    self._db = self._connect()
                    self._create_schema(self._db)
                read_only = self._db.execute("SHOW transaction_read_only").fetchone()[0]
                if read_only != "off":
                    self._faults.set(f"storage: {self.path} is read-only (transaction_read_only = {read_only})")
                    return self.fault
            except BaseException as exc:
                if not _is_fault(exc):
                    raise
                self._faults.set(self._reason(exc, "checking"))
                return self.fault
            self._faults.set(None)
            return None

    def free_bytes(self) -> int | None:
        """Unknown: the database server manages its own disk."""
        return None

    def close(self) -> None:
        self._closing = True
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
        with self._spare_lock:
            for conn in self._spare:
                conn.close()
            self._spare.clear()
        if self._listener is not None:
            self._listener.join(timeout=5)

    # ---- across replicas

    @contextmanager
    def plan_lock(self, step_id: str, *, wait: bool = True) -> Iterator[bool]:
        """Hold the step's planning lock (all replicas) while the block runs; yields whether it
        was acquired (always True when `wait`). The lock lives on a dedicated connection, so a
        replica that dies releases it with its connection."""
        with self._spare_lock:
            conn = self._spare.pop() if self._spare else None
        key = _lock_key(step_id)
        try:
            if conn is None or conn.broken or conn.closed:
                conn = self._connect()
            if wait:
                conn.execute("SELECT pg_advisory_lock(%s)", (key,))
                got = True
            else:
                got = bool(conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()[0])
        except BaseException as exc:
            if conn is not None:
                conn.close()
            if not _is_fault(exc):
                raise
            with self._lock:
                raise self._faults.fail(self._reason(exc, "locking a step in")) from None
        try:
            yield got
        finally:
            try:
                if got:
                    conn.execute("SELECT pg_advisory_unlock(%s)", (key,))
                with self._spare_lock:
                    if not self._closing and len(self._spare) < 4:
                        self._spare.append(conn)
                        conn = None
            except BaseException as exc:
                if not _is_fault(exc):
                    raise
            finally:
                if conn is not None:
                    conn.close()  # closing it releases the lock

    def watch_files(self) -> None:
        """The server's files are not this process's to watch."""

    def listen(self, fn: Callable[[str, str], None]) -> None:
        """Call `fn(event, step_id)` for every step change any replica commits (this one's too),
        from a daemon thread that reconnects when the database goes away."""
        if self._listener is not None:
            raise RuntimeError("listen: already listening")

        def run() -> None:
            conn = None
            while not self._closing:
                try:
                    if conn is None:
                        conn = self._connect()
                        conn.execute(f"LISTEN {_CHANNEL}")
                        fn("reconnected", "")  # notifications may have been missed meanwhile
                    for note in conn.notifies(timeout=1.0):
                        event, _, step_id = note.payload.partition(":")
                        fn(event, step_id)
                except BaseException as exc:
                    if not _is_fault(exc):
                        log.exception("listening to %s failed", self.path)
                    if conn is not None:
                        conn.close()
                        conn = None
                    time.sleep(1.0)
            if conn is not None:
                conn.close()

        self._listener = threading.Thread(target=run, name="harts-pg-listen", daemon=True)
        self._listener.start()

    @staticmethod
    def _notify(db: psycopg.Connection, event: str, step_id: str) -> None:
        db.execute("SELECT pg_notify(%s, %s)", (_CHANNEL, f"{event}:{step_id}"))

    # ---- steps

    def insert_step(self, rec: StepRecord, body: bytes) -> StepRecord | None:
        """Store a new step with its body, unless its step_id is taken.

        Returns:
            None when stored; the stored record when the step_id exists (nothing is written then).
        """
        stored = pack_body(body)
        values = [getattr(rec, n) for n in NAMES]
        with self._op("storing a step in", write=True) as db:
            with db.transaction():
                cur = db.execute(
                    f"INSERT INTO harts_steps ({COLUMNS}) VALUES ({', '.join(['%s'] * len(values))}) "
                    "ON CONFLICT (step_id) DO NOTHING", values)
                if cur.rowcount == 0:
                    row = db.execute(f"SELECT {COLUMNS} FROM harts_steps WHERE step_id = %s", (rec.step_id,),
                                     binary=True).fetchone()
                    return StepRecord.from_row(row)
                db.execute("INSERT INTO harts_bodies (step_id, body) VALUES (%s, %s) "
                           "ON CONFLICT (step_id) DO UPDATE SET body = EXCLUDED.body", (rec.step_id, stored))
                self._notify(db, "submitted", rec.step_id)
        return None

    def get(self, step_id: str) -> StepRecord:
        """The step's record; NotFoundError when unknown."""
        with self._op("reading", write=False) as db:
            row = db.execute(f"SELECT {COLUMNS} FROM harts_steps WHERE step_id = %s", (step_id,), binary=True).fetchone()
        if row is None:
            raise NotFoundError(f"step_id: no step {step_id!r}")
        return StepRecord.from_row(row)

    def body(self, step_id: str) -> tuple[str, bytes]:
        """(format, body bytes) of a stored step."""
        with self._op("reading", write=False) as db:
            row = db.execute("SELECT s.body_format, b.body FROM harts_steps s JOIN harts_bodies b USING (step_id) "
                             "WHERE s.step_id = %s", (step_id,), binary=True).fetchone()
        if row is None:
            raise NotFoundError(f"step_id: no step {step_id!r}")
        return row[0], unpack(row[1])

    def list(self, limit: int) -> list[StepRecord]:
        """At most `limit` steps, newest submission first."""
        with self._op("reading", write=False) as db:
            rows = db.execute(f"SELECT {COLUMNS} FROM harts_steps ORDER BY seq DESC LIMIT %s", (int(limit),),
                              binary=True).fetchall()
        return [StepRecord.from_row(r) for r in rows]

    def pending(self) -> list[StepRecord]:
        """Steps with a requested topology that were never planned (interrupted, or in progress
        on a replica: `plan_lock(wait=False)` tells them apart)."""
        with self._op("reading", write=False) as db:
            rows = db.execute(f"SELECT {COLUMNS} FROM harts_steps WHERE state = %s AND topology IS NOT NULL "
                              "ORDER BY seq", (SUBMITTED,), binary=True).fetchall()
        return [StepRecord.from_row(r) for r in rows]

    def count_unplanned(self) -> int:
        with self._op("reading", write=False) as db:
            return int(db.execute("SELECT COUNT(*) FROM harts_steps WHERE state = %s", (SUBMITTED,)).fetchone()[0])

    def request_plan(self, step_id: str, topology: bytes) -> None:
        """Record the topology a step is about to be planned for (so another replica resumes it)."""
        with self._op("recording a plan request in", write=True) as db:
            db.execute("UPDATE harts_steps SET topology = %s, state = %s, error = '' WHERE step_id = %s AND state != %s",
                       (topology, SUBMITTED, step_id, PLANNED))

    def save_plan(self, step_id: str, *, topology: bytes, stats: bytes, slices: list[bytes]) -> float:
        """Store the sealed slices and mark the step PLANNED, atomically. Returns planned_at.

        Raises:
            NotFoundError: the step was deleted meanwhile (nothing is written).
        """
        planned_at = time.time()
        stored = [pack_slice(s) for s in slices]
        with self._op("storing a plan in", write=True) as db:
            with db.transaction():
                updated = db.execute(
                    "UPDATE harts_steps SET state = %s, topology = %s, stats = %s, error = '', planned_at = %s, "
                    "world_size = %s WHERE step_id = %s",
                    (PLANNED, topology, stats, planned_at, len(slices), step_id)).rowcount
                if not updated:
                    raise NotFoundError(f"step_id: no step {step_id!r} (deleted while it was planned)")
                db.execute("DELETE FROM harts_slices WHERE step_id = %s", (step_id,))
                with db.cursor() as cur:
                    cur.executemany("INSERT INTO harts_slices (step_id, rank, data) VALUES (%s, %s, %s)",
                                    [(step_id, r, s) for r, s in enumerate(stored)])
                self._notify(db, "planned", step_id)
        return planned_at

    def save_failure(self, step_id: str, *, topology: bytes, error: str) -> None:
        """Mark the step FAILED with a client-safe reason."""
        error = error.replace("\x00", "\\x00")  # PostgreSQL text holds no NUL (a message may quote an id)
        with self._op("recording a planning failure in", write=True) as db:
            with db.transaction():
                db.execute("UPDATE harts_steps SET state = %s, topology = %s, error = %s, planned_at = %s "
                           "WHERE step_id = %s AND state != %s", (FAILED, topology, error, time.time(), step_id, PLANNED))
                self._notify(db, "failed", step_id)

    def slice(self, step_id: str, rank: int) -> bytes | None:
        """Sealed slice bytes of one rank, None when absent."""
        with self._op("reading", write=False) as db:
            row = db.execute("SELECT data FROM harts_slices WHERE step_id = %s AND rank = %s", (step_id, int(rank)),
                             binary=True).fetchone()
        return None if row is None else unpack(row[0])

    # ---- retention

    def delete(self, step_id: str) -> bool:
        """Delete a step with its body and slices, in one transaction; False when there was none."""
        with self._op("deleting a step from", write=True) as db:
            with db.transaction():
                gone = db.execute("DELETE FROM harts_steps WHERE step_id = %s", (step_id,)).rowcount
                db.execute("DELETE FROM harts_bodies WHERE step_id = %s", (step_id,))
                db.execute("DELETE FROM harts_slices WHERE step_id = %s", (step_id,))
                if gone:
                    self._notify(db, "deleted", step_id)
        return bool(gone)

    def expired(self, *, keep: int = 0, before: float = 0.0, limit: int = 1000) -> list[str]:
        """Step ids a retention policy drops, oldest submission first (see SQLiteStore.expired)."""
        out: list[str] = []
        with self._op("reading", write=False) as db:
            if keep > 0:
                out += [r[0] for r in db.execute("SELECT step_id FROM harts_steps ORDER BY seq DESC LIMIT %s OFFSET %s",
                                                 (int(limit), int(keep))).fetchall()][::-1]
            if before > 0:
                for (step_id,) in db.execute("SELECT step_id FROM harts_steps WHERE submitted_at < %s ORDER BY seq "
                                             "LIMIT %s", (before, int(limit))).fetchall():
                    if step_id not in out:
                        out.append(step_id)
        return out[:limit]

    def compact(self, *, vacuum: bool = False) -> int:
        """Nothing to do: PostgreSQL's autovacuum reclaims the space of deleted rows. Returns 0."""
        return 0
