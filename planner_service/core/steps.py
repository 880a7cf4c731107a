"""Reading and deleting stored steps: status, the list, one rank's sealed slice, deletion.

    fetch(step, rank) -> the stored sealed bytes, exactly (restored from their compressed stored
                         form, cached in memory once read)
    delete(step)      -> the step, its body and its slices leave the database and the caches
See docs/design/service.md.
"""
from __future__ import annotations

from planner_service.core.caches import StepCaches
from planner_service.core.config import ServiceConfig
from planner_service.core.maintenance import Maintenance
from planner_service.core.metrics import Metrics
from planner_service.core.planning import StepLocks
from planner_service.core.unstored import UnstoredPlans
from planner_service.core.waiters import Waiters
from planner_service.errors import NotFoundError, NotReadyError, PlanningError, StorageError, ValidationError
from planner_service.ids import check_rank, check_step_id
from planner_service.store import FAILED, PLANNED, Store
from proto.harts.v1 import planner_pb2

__all__ = ["Steps"]


class Steps:
    """Status, listing, slices and deletion of stored steps."""

    def __init__(self, *, cfg: ServiceConfig, store: Store, caches: StepCaches, waiters: Waiters,
                 unstored: UnstoredPlans, metrics: Metrics, locks: StepLocks, maintenance: Maintenance):
        self.cfg, self.store, self.caches, self.waiters = cfg, store, caches, waiters
        self.unstored, self.metrics, self.locks, self.maintenance = unstored, metrics, locks, maintenance

    def status(self, step_id: str) -> planner_pb2.StepStatus:
        check_step_id(step_id, "step_id")
        return self.unstored.status(self.store.get(step_id))

    def list_steps(self, limit: int = 0) -> list[planner_pb2.StepStatus]:
        """At most `limit` steps (0: the configured default; clipped to it), newest first."""
        if limit < 0:
            raise ValidationError("limit", f"expected >= 0, got {limit}")
        limit = min(limit or self.cfg.list_limit, self.cfg.list_limit)
        return [self.unstored.status(r) for r in self.store.list(limit)]

    def fetch(self, step_id: str, rank: int) -> bytes:
        """Sealed slice bytes of one rank (identical on every call).

        Raises:
            NotFoundError: unknown step or rank outside the topology. NotReadyError: not planned yet.
            PlanningError: planning failed (the status says why). StorageError: the plan could
            not be stored or read (retry; it is planned again when the storage recovers).
        """
        check_step_id(step_id, "step_id")
        check_rank(rank)
        cached = self.caches.slices.get((step_id, rank))
        if cached is not None:
            return cached
        rec = self.store.get(step_id)
        if rec.state != PLANNED:
            unstored = self.unstored.get(step_id)
            if unstored is not None:
                raise StorageError(unstored.error)
        if rec.state == FAILED:
            raise PlanningError(f"step {step_id!r} could not be planned: {rec.error}")
        if rec.state != PLANNED:
            raise NotReadyError(f"step {step_id!r} is not planned yet; retry, or long-poll with a wait")
        if rank >= rec.world_size:
            raise NotFoundError(f"rank: expected 0 <= rank < {rec.world_size} (the step's world_size), got {rank}")
        data = self.store.slice(step_id, rank)
        if data is None:
            raise NotFoundError(f"step_id: no step {step_id!r} (deleted while it was read)")
        self.caches.slices.put((step_id, rank), data)
        return data

    def delete(self, step_id: str, *, cause: str = "request") -> planner_pb2.StepStatus:
        """Delete a step, its body and its plan (a plan in progress finishes first).

        Its batch_id can be submitted again afterwards (as a new step).

        Returns:
            the step's status as it was before the deletion.
        Raises:
            NotFoundError: unknown step. StorageError: the database cannot be written.
        """
        check_step_id(step_id, "step_id")
        with self.locks(step_id):
            st = self.unstored.status(self.store.get(step_id))
            if not self.store.delete(step_id):
                raise NotFoundError(f"step_id: no step {step_id!r}")
            self.caches.drop(step_id)
            self.unstored.clear(step_id)
        self.metrics.steps_deleted.labels(cause).inc()
        self.maintenance.deleted()
        self.waiters.notify(step_id)
        return st
