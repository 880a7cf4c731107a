"""The acknowledged-writes mark of a SQLite database: a small file beside it, `<db>.acked`.

    mark = AckedMark(db_path)
    mark.write(database_id, writes)           # after every acknowledged write: one pwrite, no fsync
    reason = mark.lost(database_id, writes)   # at start: None, or why acknowledged writes are missing

A database deleted, replaced or restored from an older copy while the service was down fails the
check, and the service stays not ready on it until started once with `harts serve
--accept-data-loss`; deleting a database on purpose means deleting its mark too
(docs/design/service.md, "Durability").
"""
from __future__ import annotations

import logging
import os
import uuid

log = logging.getLogger(__name__)

__all__ = ["AckedMark", "new_database_id"]

_WIDTH = 32 + 1 + 20  # hex id, space, zero-padded count


def new_database_id() -> str:
    """A random id for a new database (32 hex digits)."""
    return uuid.uuid4().hex


class AckedMark:
    """The mark file of the database at `db_path`: "<database id> <writes>", one fixed-width line."""

    def __init__(self, db_path: str):
        self.path = db_path + ".acked"
        self._fd: int | None = None
        self._warned = False

    def read(self) -> tuple[str, int] | None:
        """(database id, acknowledged writes), or None when there is no readable mark."""
        try:
            with open(self.path, "rb") as f:
                text = f.read(_WIDTH + 1).decode("ascii")
        except (OSError, UnicodeDecodeError):
            return None
        db_id, _, count = text.strip().partition(" ")
        return (db_id, int(count)) if len(db_id) == 32 and count.isdigit() else None

    def lost(self, database_id: str, writes: int) -> str | None:
        """Why the database (`database_id`, holding `writes`) lacks writes the mark says were
        acknowledged; None when it does not (or there is no mark)."""
        mark = self.read()
        if mark is None:
            return None
        mark_id, acked = mark
        if mark_id != database_id:
            return (f"it is not the database the service acknowledged {acked} write(s) into (database id {mark_id} "
                    f"in {self.path}, this one is {database_id or 'of an earlier version'} with {writes})")
        if writes < acked:
            return f"it holds {writes} of the {acked} write(s) the service acknowledged ({self.path})"
        return None

    def write(self, database_id: str, writes: int) -> None:
        """Record that `writes` writes of `database_id` were acknowledged (never raises: a mark that
        cannot be written is logged once and only weakens the next start's check)."""
        line = f"{database_id} {writes:020d}\n".encode("ascii")
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            os.pwrite(self._fd, line, 0)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("cannot write %s (%s): a restart will not notice acknowledged writes that go missing",
                            self.path, exc.strerror or exc)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
