"""The core as the event loop calls it: every blocking call off the loop, and the long-poll.

Blocking work (ingest, the database, planning) never runs on the event loop. It goes to three
pools of worker threads that cannot hold each other up: planning (`Planning.pool`); reads (status,
list, slices: `_READ_WORKERS` threads of their own, so that slow plans and submissions never hold
up a GET); submissions and deletions (the loop's default pool). A long-poll waits on an event that
whoever changes the step sets (`Waiters`), not on a sleep loop. See docs/design/service.md.
"""
from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

from planner_service.core.caches import StepCaches
from planner_service.core.config import ServiceConfig
from planner_service.core.metrics import Metrics
from planner_service.core.planning import Planning
from planner_service.core.readiness import Readiness
from planner_service.core.steps import Steps
from planner_service.core.submissions import Submissions
from planner_service.core.waiters import Waiters
from planner_service.errors import NotFoundError, NotReadyError, StorageError, Unavailable, ValidationError
from planner_service.ids import check_step_id
from planner_service.store import Store
from proto.harts.v1 import planner_pb2, rollouts_pb2

__all__ = ["AsyncCore"]

_SHARED_POLL_S = 2.0
"""Longest wait of a long-poll between two looks at a shared (PostgreSQL) store."""

_READ_WORKERS = 4
"""Threads of the read pool (status, list, plan slices)."""


class AsyncCore:
    """Coroutines over the core's parts; the transports call only these."""

    def __init__(self, *, cfg: ServiceConfig, store: Store, caches: StepCaches, waiters: Waiters, metrics: Metrics,
                 readiness: Readiness, submissions: Submissions, planning: Planning, steps: Steps):
        self.cfg, self.store, self.caches, self.waiters, self.metrics = cfg, store, caches, waiters, metrics
        self.readiness, self.submissions, self.planning, self.steps = readiness, submissions, planning, steps
        self._read_pool = ThreadPoolExecutor(max_workers=_READ_WORKERS, thread_name_prefix="harts-read")

    def close(self) -> None:
        self._read_pool.shutdown(wait=True, cancel_futures=True)

    async def submit(self, body: bytes | bytearray, fmt: str, topology: planner_pb2.Topology | None = None, *,
                     body_sha256: str = "") -> planner_pb2.SubmitRolloutsResponse:
        return await asyncio.to_thread(self.submissions.submit, body, fmt, topology, body_sha256=body_sha256)

    async def submit_message(self, batch: rollouts_pb2.RolloutBatch, topology: planner_pb2.Topology | None = None,
                             *, body: bytes | None = None, body_sha256: str = "") -> planner_pb2.SubmitRolloutsResponse:
        return await asyncio.to_thread(self.submissions.submit_message, batch, topology, body=body,
                                       body_sha256=body_sha256)

    async def plan(self, step_id: str, topology: planner_pb2.Topology) -> planner_pb2.StepStatus:
        return await asyncio.get_running_loop().run_in_executor(self.planning.pool, self.planning.plan, step_id,
                                                                topology)

    async def status(self, step_id: str) -> planner_pb2.StepStatus:
        return await asyncio.get_running_loop().run_in_executor(self._read_pool, self.steps.status, step_id)

    async def list_steps(self, limit: int = 0) -> list[planner_pb2.StepStatus]:
        return await asyncio.get_running_loop().run_in_executor(self._read_pool, self.steps.list_steps, limit)

    async def delete(self, step_id: str) -> planner_pb2.StepStatus:
        return await asyncio.to_thread(self.steps.delete, step_id)

    async def fetch(self, step_id: str, rank: int, wait: float = 0.0) -> bytes:
        """`Steps.fetch` with long-poll: wait up to `wait` seconds (clipped to max_wait_seconds)
        for the step to be submitted and planned (or the storage to recover). Raises fetch's
        errors when the wait runs out, ValidationError for a wait that is negative or not a
        number, Unavailable when the service stops meanwhile."""
        wait = float(wait)
        if not (wait >= 0 and math.isfinite(wait)):
            raise ValidationError("wait_seconds", f"expected a finite number of seconds >= 0, got {wait!r}")
        check_step_id(step_id, "step_id")
        cached = self.caches.slices.get((step_id, rank))
        if cached is not None:
            return cached
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(event.set)

        deadline = loop.time() + min(wait, self.cfg.max_wait_seconds)
        self.waiters.add(step_id, wake)  # before the first look, so no change slips between
        try:
            while True:
                event.clear()
                try:
                    return await loop.run_in_executor(self._read_pool, self.steps.fetch, step_id, rank)
                except (NotReadyError, NotFoundError, StorageError) as exc:
                    if isinstance(exc, NotFoundError) and exc.message.startswith("rank:"):
                        raise
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise
                    if self.readiness.closing:
                        raise Unavailable("the service is stopping; retry (on another replica, if there is "
                                          "one)") from None
                await self._wait(event, remaining)
        finally:
            self.waiters.remove(step_id, wake)

    async def _wait(self, event: asyncio.Event, remaining: float) -> None:
        """Wait for `event` at most `remaining` seconds; less while the storage is faulted (a
        fault is not announced when it clears: look again every second) or shared (a replica's
        notifications may be missed while its listener reconnects)."""
        self.metrics.fetch_waiters.inc()
        try:
            timeout = min(remaining, 1.0) if self.store.fault else remaining
            if self.store.shared:
                timeout = min(timeout, _SHARED_POLL_S)
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self.metrics.fetch_waiters.dec()
