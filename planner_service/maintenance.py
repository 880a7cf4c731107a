"""The service's background upkeep: storage probes, plans resumed after a fault, retention, compaction.

One daemon thread per `PlannerCore`. Each round it probes the database (every
`storage_probe_seconds` while healthy, every second during a fault, at once when a fault starts);
while the database is healthy it resumes the plans a fault interrupted, deletes what the retention
policy drops (`retain_steps`: keep the newest N; `max_age_seconds`: keep the younger ones) and
compacts the file after deletions. `wake` starts a round early (a submission under a count policy,
a deletion, a fault).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from planner_service.errors import NotFoundError, StorageError

if TYPE_CHECKING:
    from planner_service.core import PlannerCore

log = logging.getLogger(__name__)

__all__ = ["Maintenance"]


class Maintenance:
    """Background upkeep of one core (module docstring).

    Args:
        core: the service core; its `cfg` holds the policies.
    """

    def __init__(self, core: PlannerCore):
        self.core = core
        self._wake = threading.Event()
        self._stop = False
        self._resume = False
        self._deleted = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, *, resume: bool) -> None:
        """Start the thread; `resume`: plans still need resuming once the storage is healthy."""
        self._resume = resume
        self._thread = threading.Thread(target=self._run, name="harts-maintenance", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def wake(self, *, resume: bool = False) -> None:
        """Run a round now; `resume`: resume interrupted plans in it (the storage recovered)."""
        if resume:
            self._resume = True
        self._wake.set()

    def deleted(self) -> None:
        """Count a deletion: the next round compacts the database."""
        with self._lock:
            self._deleted += 1
        self._wake.set()

    def _run(self) -> None:
        store, cfg = self.core.store, self.core.cfg
        last_probe = time.monotonic()
        while not self._stop:
            interval = 1.0 if store.fault else cfg.storage_probe_seconds
            self._wake.wait(max(0.0, last_probe + interval - time.monotonic()))
            self._wake.clear()
            if self._stop:
                return
            try:
                if store.fault or time.monotonic() - last_probe >= interval:
                    last_probe = time.monotonic()
                    if store.probe() is not None:
                        continue
                if self._resume:
                    self._resume = False
                    self.core.resume_pending()
                self._retain()
                self._compact()
            except StorageError:
                pass  # the store has the fault now; the next round probes again
            except Exception:
                log.exception("maintenance round failed")

    def _retain(self) -> None:
        cfg = self.core.cfg
        before = time.time() - cfg.max_age_seconds if cfg.max_age_seconds else 0.0
        if not (cfg.retain_steps or before):
            return
        doomed = self.core.store.expired(keep=cfg.retain_steps, before=before)
        deleted = 0
        for step_id in doomed:
            try:
                self.core.delete(step_id, cause="retention")
                deleted += 1
            except NotFoundError:
                pass
        if deleted:
            log.info("retention: deleted %d step(s), the oldest %s", deleted, doomed[0])

    def _compact(self) -> None:
        with self._lock:
            pending, self._deleted = self._deleted, 0
        if pending:
            store = self.core.store
            freed = store.compact()
            log.info("compacted %s after %d deletion(s): %d bytes freed", store.path, pending, freed)
