"""Planning a stored step: the topology's PlanConfig, the planner, one sealed slice per rank, stored.

    plan(step, topology) -> PlanConfig of the topology -> planner.plan_step -> seal one slice per
                            rank -> Store.save_plan (one transaction) -> wake long-polling fetches

Plans run on a pool of their own (`plan_workers` threads: planning is CPU-bound Numba code), one
step at a time (`StepLocks`, and across replicas the store's `plan_lock`). A plan whose outcome
could not be stored is kept in `UnstoredPlans` and planned again by `resume_pending` when the
storage recovers; so is a plan a restart or a replica's death interrupted.
See docs/design/service.md.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import planner_service.planner as planner
from planner_service.core.caches import StepCaches
from planner_service.core.config import ServiceConfig
from planner_service.core.metrics import Metrics
from planner_service.core.readiness import Readiness
from planner_service.core.unstored import Unstored, UnstoredPlans
from planner_service.core.waiters import Waiters
from planner_service.errors import ConflictError, HartsError, NotFoundError, PlanningError, StorageError
from planner_service.ids import check_step_id
from planner_service.planner.config import PlanConfig
from planner_service.store import PLANNED, SUBMITTED, StepRecord, Store
from planner_service.topology import normalized_topology
from plan.seal import seal, slice_plan
from proto.harts.v1 import plan_pb2, planner_pb2

log = logging.getLogger(__name__)

__all__ = ["Planning", "StepLocks"]


class StepLocks:
    """One lock per step id, held while the step is planned or deleted (kept while in use)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: weakref.WeakValueDictionary[str, threading.Lock] = weakref.WeakValueDictionary()

    def __call__(self, step_id: str) -> threading.Lock:
        with self._guard:
            lock = self._locks.get(step_id)
            if lock is None:
                lock = self._locks[step_id] = threading.Lock()
            return lock


class Planning:
    """Plans steps, in the caller's thread (`plan`) or in the planning pool (`queue`)."""

    def __init__(self, *, cfg: ServiceConfig, store: Store, caches: StepCaches, waiters: Waiters,
                 unstored: UnstoredPlans, metrics: Metrics, readiness: Readiness, locks: StepLocks):
        self.cfg, self.store, self.caches, self.waiters = cfg, store, caches, waiters
        self.unstored, self.metrics, self.readiness, self.locks = unstored, metrics, readiness, locks
        self.pool = ThreadPoolExecutor(max_workers=cfg.plan_workers, thread_name_prefix="harts-plan")
        self._guard = threading.Lock()
        self._queued: set[str] = set()
        """Steps handed to the pool and not finished: resuming skips them."""

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def plan(self, step_id: str, topology: planner_pb2.Topology, *, resumed: bool = False) -> planner_pb2.StepStatus:
        """Plan a stored step for a topology and store its sealed slices.

        Idempotent: a step already planned for the same (normalised) topology returns its status;
        a planned step is never re-planned for another topology (its slices may be in use), and
        a step whose planning failed can be planned again. Planning a step is exclusive across the
        replicas of a shared store: a request waits for a plan in progress elsewhere, a resumed
        plan (`resumed`) leaves it to that replica.

        Raises:
            NotFoundError: unknown step. ValidationError: bad topology.
            ConflictError: planned for another topology. PlanningError: the planner cannot satisfy it.
            StorageError: the outcome could not be stored; the step shows as failed with this
                error and is planned again when the storage recovers.
        """
        check_step_id(step_id, "step_id")
        cfg = self.cfg.plan_config(topology)
        topo = normalized_topology(cfg)
        want = topo.SerializeToString(deterministic=True)
        with self.locks(step_id), self.store.plan_lock(step_id, wait=not resumed) as mine:
            rec = self.store.get(step_id)
            if rec.state == PLANNED:
                if rec.topology == want:
                    return self.unstored.status(rec)
                raise ConflictError(
                    f"topology: step {step_id!r} is already planned for another topology; submit the "
                    "rollouts under a new batch_id to plan them differently"
                )
            if not mine or (resumed and rec.state != SUBMITTED and step_id not in self.unstored):
                return self.unstored.status(rec)  # another replica plans it, or its planning failed
            try:
                rec = self._plan_locked(rec, cfg, want)
            except StorageError as exc:
                later = "when the disk has room for it" if exc.need else "when the storage recovers"
                msg = f"{exc.message}; the step is planned again {later}"
                self.unstored.record(step_id, Unstored(error=msg, topology=topo, need=exc.need))
                self.waiters.notify(step_id)
                raise StorageError(msg, need=exc.need) from None
            self.unstored.clear(step_id)
        self.waiters.notify(step_id)
        return self.unstored.status(rec)

    def _plan_locked(self, rec: StepRecord, cfg: PlanConfig, want: bytes) -> StepRecord:
        step_id = rec.step_id
        self.store.request_plan(step_id, want)
        forest = self.caches.forest(self.store, step_id, rec.body_sha256)
        t0 = time.perf_counter()
        try:
            plan = planner.plan_step(forest, cfg)
        except (PlanningError, ValueError) as exc:
            msg = exc.message if isinstance(exc, HartsError) else str(exc)
            self._failed(step_id, want, msg)
            raise PlanningError(msg) from None
        except Exception:
            log.exception("planning step %s failed", step_id)
            self._failed(step_id, want, "internal error while planning")
            raise
        seconds = time.perf_counter() - t0
        slices = _seal_all(plan, cfg.world_size)
        self.store.save_plan(step_id, topology=want, stats=plan.header.stats.SerializeToString(deterministic=True),
                             slices=slices)
        for r, data in enumerate(slices):
            self.caches.slices.put((step_id, r), data)
        st = plan.header.stats
        self.metrics.plans.labels("planned").inc()
        self.metrics.plan_seconds.observe(seconds)
        self.metrics.compression_ideal.observe(st.compression_ideal)
        self.metrics.compression_achieved.observe(st.compression_achieved)
        log.info("planned step %s: %d microbatches, compression %.2fx achieved / %.2fx ideal, %.3f s",
                 step_id, st.microbatches, st.compression_achieved, st.compression_ideal, seconds)
        return self.store.get(step_id)

    def _failed(self, step_id: str, want: bytes, error: str) -> None:
        """Record a plan the planner refused (or crashed on) as the step's outcome."""
        self.metrics.plans.labels("failed").inc()
        self.store.save_failure(step_id, topology=want, error=error)
        self.unstored.clear(step_id)
        self.waiters.notify(step_id)

    # ---- in the background

    def queue(self, step_id: str, topology: planner_pb2.Topology, *, resumed: bool = False) -> bool:
        """Hand a step to the planning pool unless it is there already. Returns whether it was queued."""
        with self._guard:
            if step_id in self._queued or self.readiness.closing:
                return False
            self._queued.add(step_id)
        try:
            self.pool.submit(self._background, step_id, topology, resumed)
        except RuntimeError:  # the pool shut down meanwhile
            with self._guard:
                self._queued.discard(step_id)
            return False
        return True

    def _background(self, step_id: str, topology: planner_pb2.Topology, resumed: bool) -> None:
        try:
            self.plan(step_id, topology, resumed=resumed)
        except NotFoundError:
            log.info("step %s was deleted before it was planned", step_id)
        except HartsError as exc:
            log.warning("step %s not planned: %s", step_id, exc.message)
        except Exception:  # logged with its traceback by plan()
            pass
        finally:
            with self._guard:
                self._queued.discard(step_id)

    def resume_pending(self) -> None:
        """Plan again every step whose planning was interrupted (here, or on a replica that died:
        one whose planning lock nobody holds) or could not be stored; a plan that did not fit on
        the disk waits until it does."""
        todo = {rec.step_id: planner_pb2.Topology.FromString(rec.topology) for rec in self.store.pending()}
        ready, waiting = self.unstored.resumable(self.store.free_bytes(), self.store.min_free_bytes)
        for step_id in waiting:
            todo.pop(step_id, None)
        for step_id, topo in ready.items():
            todo.setdefault(step_id, topo)
        for step_id, topo in todo.items():
            if self.queue(step_id, topo, resumed=True):
                log.info("resuming the plan of step %s", step_id)


def _seal_all(plan: plan_pb2.Plan, world_size: int) -> list[bytes]:
    if len(plan.ranks) != world_size:
        raise AssertionError(f"planner returned {len(plan.ranks)} ranks for world_size {world_size}")
    return [seal(slice_plan(plan, r)) for r in range(world_size)]
