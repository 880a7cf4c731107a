"""Whether the service is ready, and why not: starting, stopping, or the store's fault.

The store tells `storage_changed` of every change of its fault (with its lock held: this only
records, logs, counts and wakes); readiness listeners (the transports' health services) hear
every change of (ready, reason) (docs/design/service.md).
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from planner_service.core.metrics import Metrics
from planner_service.store import Store

log = logging.getLogger(__name__)

__all__ = ["Readiness"]

_STARTING = "starting: compiling the Numba code and resuming interrupted plans"


class Readiness:
    """Started, not stopping, and the database writable.

    Args:
        metrics: where storage health is counted (`harts_storage_ok`, `harts_storage_faults_total`).
    """

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.started = False
        self.closing = False
        self._store: Store | None = None
        self._wake: Callable[..., None] = lambda **_: None
        self._listeners: list[Callable[[bool, str], None]] = []
        self._healthy = True
        self._fault_logged = 0.0

    def watch(self, store: Store, *, wake: Callable[..., None]) -> None:
        """Follow `store`'s fault; `wake(resume=...)` starts a maintenance round (resume: the
        storage recovered, interrupted plans may run again)."""
        self._store = store
        self._wake = wake
        self._healthy = store.fault is None
        self.metrics.storage_ok.set(0 if store.fault else 1)

    def state(self) -> tuple[bool, str]:
        """(ready, reason): the reason names what keeps the service from being ready ("" when ready)."""
        if self.closing:
            return False, "stopping"
        if not self.started:
            return False, _STARTING
        fault = self._store.fault if self._store is not None else None
        return (False, fault) if fault else (True, "")

    def listen(self, fn: Callable[[bool, str], None]) -> None:
        """Call `fn(ready, reason)` now and on every change (from any thread; it must not block)."""
        self._listeners.append(fn)
        fn(*self.state())

    def changed(self) -> None:
        state = self.state()
        for fn in list(self._listeners):
            fn(*state)

    def start(self, fault: str | None) -> None:
        """Ready from now on, unless the store's `fault` (found by the start-up probe) says otherwise."""
        if fault is not None and time.monotonic() - self._fault_logged > 1.0:  # not just logged by storage_changed
            log.warning("storage fault, not ready until it clears: %s", fault)
        self.started = True
        self.changed()

    def stop(self) -> None:
        """Not ready from now on (the service stops)."""
        self.closing = True
        self.changed()

    def storage_changed(self, reason: str | None) -> None:
        """The store's fault changed to `reason` (None: writable again)."""
        if reason is None:
            log.info("storage recovered: %s can be written again; resuming plans", self._store.path)
            self.metrics.storage_ok.set(1)
            self._wake(resume=True)
        else:
            # one line when the fault starts; a changed reason at most once a minute after that
            now = time.monotonic()
            if self._healthy or now - self._fault_logged > 60:
                log.warning("storage fault, not ready until it clears: %s", reason)
                self._fault_logged = now
            if self._healthy:
                self.metrics.storage_faults.inc()
                self._wake()  # probe every second from now on
            self.metrics.storage_ok.set(0)
        self._healthy = reason is None
        self.changed()
