"""Plans whose outcome could not be stored (a storage fault): the core's one record of them.

Such a step shows as FAILED with the storage error (its status and fetches say so) and is planned
again when the storage recovers, or, for a plan that did not fit on the disk, once the disk has
room for it (`resumable`). A plan stored later, or the step deleted, clears its entry. `status`
is the status clients see, this record laid over the stored one (docs/design/service.md).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from planner_service.store import FAILED, PLANNED, StepRecord
from proto.harts.v1 import planner_pb2

__all__ = ["Unstored", "UnstoredPlans"]


@dataclass(slots=True, frozen=True, kw_only=True)
class Unstored:
    """One plan that could not be stored."""

    error: str
    """The storage error, with when the step is planned again (client-safe)."""
    topology: planner_pb2.Topology
    """The normalised topology it was planned for."""
    need: int
    """Bytes the plan needs on the disk (0: another fault stopped it)."""


class UnstoredPlans:
    """Unstored plans by step id (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, Unstored] = {}

    def record(self, step_id: str, entry: Unstored) -> None:
        with self._lock:
            self._plans[step_id] = entry

    def clear(self, step_id: str) -> None:
        with self._lock:
            self._plans.pop(step_id, None)

    def get(self, step_id: str) -> Unstored | None:
        with self._lock:
            return self._plans.get(step_id)

    def __contains__(self, step_id: str) -> bool:
        with self._lock:
            return step_id in self._plans

    def resumable(self, free: int | None, min_free: int) -> tuple[dict[str, planner_pb2.Topology], set[str]]:
        """(steps to plan again with their topologies, steps whose plans still wait for disk
        space) on a disk with `free` bytes (None: unknown) of which `min_free` stay free."""
        ready: dict[str, planner_pb2.Topology] = {}
        waiting: set[str] = set()
        with self._lock:
            for step_id, u in self._plans.items():
                if u.need and free is not None and free - u.need < min_free:
                    waiting.add(step_id)
                else:
                    ready[step_id] = u.topology
        return ready, waiting

    def status(self, rec: StepRecord) -> planner_pb2.StepStatus:
        """The StepStatus clients see of a stored step: an unstored plan shows it FAILED with
        the storage error and the topology it was planned for."""
        st = planner_pb2.StepStatus(
            step_id=rec.step_id,
            state=rec.state,
            trajectories=rec.trajectories,
            unique_tokens=rec.unique_tokens,
            expanded_tokens=rec.expanded_tokens,
            error=rec.error,
            submitted_at=rec.submitted_at,
            planned_at=rec.planned_at,
        )
        if rec.stats:
            st.stats.ParseFromString(rec.stats)
        if rec.topology:
            st.topology.ParseFromString(rec.topology)
        if rec.state != PLANNED:
            unstored = self.get(rec.step_id)
            if unstored is not None:
                st.state = FAILED
                st.error = unstored.error
                st.topology.CopyFrom(unstored.topology)
        return st
