"""The service's background upkeep: storage probes, plans resumed after a fault, retention, compaction.

    m = Maintenance(store, probe_seconds=5.0, retain_steps=0, max_age_seconds=0.0, resume=..., delete=...)
    m.start(resume=False); m.wake(); m.deleted(); m.stop()

One daemon thread per `PlannerCore`: each round probes the database (every `probe_seconds` while
healthy, writing nothing; every second during a fault), resumes interrupted plans once it is
healthy, applies the retention policy and compacts after deletions, these two also while the disk
is short of space (they free it). See docs/design/service.md ("Durability", "Retention").
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from planner_service.errors import NotFoundError, StorageError
from planner_service.store import Store

log = logging.getLogger(__name__)

__all__ = ["Maintenance"]


class Maintenance:
    """Background upkeep of one store (docs/design/service.md, "Durability", "Retention").

    Args:
        store: the database it probes, prunes and compacts.
        probe_seconds: probe interval while the database is healthy.
        retain_steps: keep only the newest this many steps (0: no count limit).
        max_age_seconds: delete steps submitted longer ago (0: no age limit).
        resume: plans the steps whose planning a fault interrupted (called from this thread).
        delete: deletes one step the retention policy drops, with its caches (NotFoundError when
            it is gone already).
        resume_every: also resume this often (seconds; 0: only after a fault): a shared store's
            replicas pick up the plans of a replica that died.
    """

    def __init__(self, store: Store, *, probe_seconds: float, retain_steps: int, max_age_seconds: float,
                 resume: Callable[[], None], delete: Callable[[str], object], resume_every: float = 0.0):
        self.store = store
        self.probe_seconds = probe_seconds
        self.retain_steps = retain_steps
        self.max_age_seconds = max_age_seconds
        self._resume_plans = resume
        self._delete = delete
        self.resume_every = resume_every
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
        store = self.store
        last_probe = last_resume = time.monotonic()
        while not self._stop:
            interval = 1.0 if store.fault else self.probe_seconds
            until = last_probe + interval
            if self.resume_every:
                until = min(until, last_resume + self.resume_every)
            self._wake.wait(max(0.0, until - time.monotonic()))
            self._wake.clear()
            if self._stop:
                return
            try:
                healthy = True
                if store.fault or time.monotonic() - last_probe >= interval:
                    last_probe = time.monotonic()
                    healthy = store.probe() is None
                    if healthy:
                        self._resume = True  # plans that waited for the disk may fit now
                    elif not store.short_of_space:
                        continue
                if healthy and (self._resume or (self.resume_every and time.monotonic() - last_resume >= self.resume_every)):
                    self._resume = False
                    last_resume = time.monotonic()
                    self._resume_plans()
                # retention and compaction free space: they go on while the disk is short of it
                self._retain()
                self._compact()
            except StorageError:
                pass  # the store has the fault now; the next round probes again
            except Exception:
                log.exception("maintenance round failed")

    def _retain(self) -> None:
        before = time.time() - self.max_age_seconds if self.max_age_seconds else 0.0
        if not (self.retain_steps or before):
            return
        doomed = self.store.expired(keep=self.retain_steps, before=before)
        deleted = 0
        for step_id in doomed:
            try:
                self._delete(step_id)
                deleted += 1
            except NotFoundError:
                pass
        if deleted:
            log.info("retention: deleted %d step(s), the oldest %s", deleted, doomed[0])

    def _compact(self) -> None:
        with self._lock:
            pending, self._deleted = self._deleted, 0
        if pending:
            freed = self.store.compact()
            log.info("compacted %s after %d deletion(s): %d bytes freed", self.store.path, pending, freed)
