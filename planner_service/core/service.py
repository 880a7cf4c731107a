"""`PlannerCore`: the planner service without a transport, put together from parts of one job each.

    core = PlannerCore(ServiceConfig(db_path="harts.db")); core.start(); ...; core.close()

Parts: `readiness.Readiness`, `submissions.Submissions`, `planning.Planning`, `steps.Steps`,
`waiters.Waiters`, `unstored.UnstoredPlans`, `caches.StepCaches`, `maintenance.Maintenance` (a
thread) and `async_api.AsyncCore` (`core.aio`, what the transports call); their jobs and the
service around them: docs/design/service.md ("Shape").
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import planner_service.planner as planner
from planner_service import ingest
from planner_service.core.async_api import AsyncCore
from planner_service.core.caches import StepCaches
from planner_service.core.config import ServiceConfig
from planner_service.core.maintenance import Maintenance
from planner_service.core.metrics import Metrics
from planner_service.core.planning import Planning, StepLocks
from planner_service.core.readiness import Readiness
from planner_service.core.steps import Steps
from planner_service.core.submissions import Submissions
from planner_service.core.unstored import UnstoredPlans
from planner_service.core.waiters import Waiters
from planner_service.errors import StorageError
from planner_service.store import open_store
from proto.harts.v1 import planner_pb2, rollouts_pb2

log = logging.getLogger(__name__)

__all__ = ["PlannerCore"]


class PlannerCore:
    """Transport-free service: thread-safe sync methods, and `aio` for the event loop.

    Args:
        cfg: service settings.
        metrics: where to record; a fresh registry by default.
    """

    def __init__(self, cfg: ServiceConfig, metrics: Metrics | None = None):
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.health = Readiness(self.metrics)
        self.store = open_store(cfg.db_path, synchronous=cfg.synchronous, min_free_bytes=cfg.min_free_bytes,
                                on_fault=self.health.storage_changed, accept_data_loss=cfg.accept_data_loss)
        self.metrics.steps_waiting.set_function(self._count_unplanned)
        self.caches = StepCaches(slice_bytes=cfg.slice_cache_bytes, forest_bytes=cfg.forest_cache_bytes,
                                 metrics=self.metrics, limits=cfg.limits)
        self.waiters = Waiters()
        self.unstored = UnstoredPlans()
        locks = StepLocks()
        parts = dict(cfg=cfg, store=self.store, caches=self.caches, waiters=self.waiters, unstored=self.unstored,
                     metrics=self.metrics)
        self.planning = Planning(**parts, readiness=self.health, locks=locks)
        self.maintenance = Maintenance(
            self.store, probe_seconds=cfg.storage_probe_seconds, retain_steps=cfg.retain_steps,
            max_age_seconds=cfg.max_age_seconds, resume=self.planning.resume_pending,
            resume_every=cfg.resume_seconds if self.store.shared else 0.0,
            delete=lambda step_id: self.steps.delete(step_id, cause="retention"))
        self.steps = Steps(**parts, locks=locks, maintenance=self.maintenance)
        self.submissions = Submissions(**parts, planning=self.planning, maintenance=self.maintenance)
        self.health.watch(self.store, wake=self.maintenance.wake)
        self.aio = AsyncCore(cfg=cfg, store=self.store, caches=self.caches, waiters=self.waiters, metrics=self.metrics,
                             readiness=self.health, submissions=self.submissions, planning=self.planning,
                             steps=self.steps)

    # ---- lifecycle and readiness

    def start(self) -> None:
        """Compile the Numba code (ingest and planner), VACUUM if configured, check that the
        database can be written and resume interrupted plans; then start the maintenance thread.
        Ready once started and healthy."""
        t0 = time.perf_counter()
        ingest.warmup()
        planner.warmup()
        log.info("numba code compiled in %.2f s", time.perf_counter() - t0)
        if self.cfg.vacuum:
            try:
                self.store.compact(vacuum=True)
            except StorageError:
                pass  # the store is faulted: the probe below reports it
        fault = self.store.probe()
        if fault is None:
            self.planning.resume_pending()
        self.store.listen(self._step_changed)
        self.store.watch_files()
        self.health.start(fault)
        self.maintenance.start(resume=fault is not None)

    @property
    def ready(self) -> bool:
        """Started, not stopping, and the database writable."""
        return self.health.state()[0]

    def readiness(self) -> tuple[bool, str]:
        """(ready, reason): the reason names what keeps the service from being ready ("" when ready)."""
        return self.health.state()

    def on_readiness(self, fn: Callable[[bool, str], None]) -> None:
        """Call `fn(ready, reason)` now and on every change (from any thread; it must not block)."""
        self.health.listen(fn)

    def stop_serving(self) -> None:
        """Report not ready from now on (the transports drain) and answer waiting long-polls at
        once (503: they retry, on another replica if they know one); `close` releases everything."""
        self.health.stop()
        self.waiters.notify_all()

    def close(self) -> None:
        self.stop_serving()
        self.maintenance.stop()
        self.planning.close()
        self.aio.close()
        self.store.close()

    def _step_changed(self, event: str, step_id: str) -> None:
        """A replica (maybe this one) committed `event` for a step: wake its long-polls; a deleted
        step leaves the caches. After a reconnect of the listener every waiter looks again."""
        if event == "deleted":
            self.caches.drop(step_id)
        if event == "reconnected":
            self.waiters.notify_all()
            return
        self.waiters.notify(step_id)

    def _count_unplanned(self) -> float:
        try:
            return float(self.store.count_unplanned())
        except StorageError:
            return math.nan

    # ---- the operations (blocking; `aio` runs them off the event loop)

    def submit(self, body: bytes | bytearray, fmt: str, topology: planner_pb2.Topology | None = None, *,
               body_sha256: str = "") -> planner_pb2.SubmitRolloutsResponse:
        """`Submissions.submit`: validate and store a step's rollouts, plan them if a topology applies."""
        return self.submissions.submit(body, fmt, topology, body_sha256=body_sha256)

    def submit_message(self, batch: rollouts_pb2.RolloutBatch, topology: planner_pb2.Topology | None = None, *,
                       body: bytes | None = None, body_sha256: str = "") -> planner_pb2.SubmitRolloutsResponse:
        """`Submissions.submit_message`: `submit` for an already parsed RolloutBatch (gRPC)."""
        return self.submissions.submit_message(batch, topology, body=body, body_sha256=body_sha256)

    def plan(self, step_id: str, topology: planner_pb2.Topology) -> planner_pb2.StepStatus:
        """`Planning.plan`: plan a stored step for a topology and store its sealed slices."""
        return self.planning.plan(step_id, topology)

    def resume_pending(self) -> None:
        """`Planning.resume_pending`: plan again what a fault or a restart interrupted."""
        self.planning.resume_pending()

    def fetch(self, step_id: str, rank: int) -> bytes:
        """`Steps.fetch`: one rank's sealed slice bytes (`aio.fetch` long-polls)."""
        return self.steps.fetch(step_id, rank)

    def status(self, step_id: str) -> planner_pb2.StepStatus:
        return self.steps.status(step_id)

    def list_steps(self, limit: int = 0) -> list[planner_pb2.StepStatus]:
        """`Steps.list_steps`: at most `limit` steps (0: the configured default), newest first."""
        return self.steps.list_steps(limit)

    def delete(self, step_id: str, *, cause: str = "request") -> planner_pb2.StepStatus:
        """`Steps.delete`: delete a step with its body and plan; its status as it was."""
        return self.steps.delete(step_id, cause=cause)
