"""The storage fault state machine both stores share.

    READY ──storage error──▶ FAULTED ──probe succeeds──▶ READY
    READY ──disk below the reserve──▶ SHORT_OF_SPACE ──probe finds room──▶ READY
    any ──file replaced, not restorable, acknowledged writes missing──▶ LOST (until a restart)

While not READY, writes are refused with the reason (`check_write`); SHORT_OF_SPACE still lets
the writes that free space (deleting, compacting) through. Reads go on in every state. Every
change of the reason is told to `on_change` (the core's readiness), with the store's lock held.
See docs/design/service.md, "Durability".
"""
from __future__ import annotations

import enum
from contextlib import contextmanager
from typing import Callable, Iterator

from planner_service.errors import StorageError

__all__ = ["Health", "FaultState"]


class Health(enum.Enum):
    """Where a store stands (`FaultState.health`)."""

    READY = "ready"
    SHORT_OF_SPACE = "short of space"
    """Only the disk's reserve (`min_free_bytes`) is short: writes that free space go on."""
    FAULTED = "faulted"
    """Read-only, unreachable, an I/O error: the next successful probe clears it."""
    LOST = "lost"
    """The database is not the one acknowledged writes went to: writes are refused until a restart."""


class FaultState:
    """One store's fault: the reason (None when READY), told to `on_change` on every change.

    Args:
        is_fault: whether an exception means the storage (not the statement) is at fault.
        describe: the client-safe reason of such an exception, given what the store was doing.
    """

    def __init__(self, *, is_fault: Callable[[BaseException], bool], describe: Callable[[BaseException, str], str]):
        self.is_fault = is_fault
        self.describe = describe
        self.reason: str | None = None
        """Why the storage is unusable now; None when READY."""
        self.short_of_space = False
        self.lost: str | None = None
        """Why the database is LOST (set once, kept until the process ends)."""
        self.on_change: Callable[[str | None], None] | None = None
        """Told the new reason (None: READY again); set once the store is open, so that opening
        a faulted store tells nobody."""

    @property
    def health(self) -> Health:
        if self.reason is None:
            return Health.READY
        if self.lost is not None and self.reason == self.lost:
            return Health.LOST
        return Health.SHORT_OF_SPACE if self.short_of_space else Health.FAULTED

    def set(self, reason: str | None, *, space: bool = False) -> None:
        """Enter the fault `reason` (`space`: only the disk's reserve is short), or READY with None."""
        self.short_of_space = space and reason is not None
        if reason == self.reason:
            return
        self.reason = reason
        if self.on_change is not None:
            self.on_change(reason)

    def fail(self, reason: str, *, space: bool = False, need: int = 0) -> StorageError:
        """Enter the fault `reason`; returns the StorageError to raise."""
        self.set(reason, space=space)
        return StorageError(reason, need=need)

    def lose(self, reason: str) -> None:
        """The database is LOST; the fault follows at the next `check_lost` (or at once with `set`)."""
        self.lost = reason

    def check_lost(self) -> None:
        """Raise (and enter) the LOST fault, if the database is lost."""
        if self.lost is not None:
            raise self.fail(self.lost)

    def check_write(self, *, frees: bool = False) -> None:
        """Refuse a write while not READY; `frees`: a write that frees disk space goes on while
        the store is only SHORT_OF_SPACE."""
        if self.reason is not None and not (frees and self.short_of_space):
            raise StorageError(self.reason)

    @contextmanager
    def translating(self, doing: str) -> Iterator[None]:
        """A storage error raised in the block becomes a StorageError and the fault (its reason
        names `doing`); any other error propagates unchanged."""
        try:
            yield
        except BaseException as exc:
            if not self.is_fault(exc):
                raise
            raise self.fail(self.describe(exc, doing)) from None
