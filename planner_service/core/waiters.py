"""Who waits for a step: the wake-up callbacks of long-polling fetches, by step id.

A long-poll registers before its first look (so no change slips between) and is woken by whoever
changes the step: a plan stored or failed, a submission, a deletion, a replica's notification, or
the service stopping (`notify_all`). A callback must not block (it sets an event).
See docs/design/service.md.
"""
from __future__ import annotations

import threading
from typing import Callable

__all__ = ["Waiters"]


class Waiters:
    """Wake-up callbacks by step id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, set[Callable[[], None]]] = {}

    def add(self, step_id: str, fn: Callable[[], None]) -> None:
        with self._lock:
            self._waiting.setdefault(step_id, set()).add(fn)

    def remove(self, step_id: str, fn: Callable[[], None]) -> None:
        with self._lock:
            fns = self._waiting.get(step_id)
            if fns is not None:
                fns.discard(fn)
                if not fns:
                    del self._waiting[step_id]

    def notify(self, step_id: str) -> None:
        """Wake the waiters of one step."""
        with self._lock:
            fns = list(self._waiting.get(step_id, ()))
        for fn in fns:
            fn()

    def notify_all(self) -> None:
        """Wake every waiter (the service stops; a replica's notifications may have been missed)."""
        with self._lock:
            fns = [fn for step_fns in self._waiting.values() for fn in step_fns]
        for fn in fns:
            fn()
