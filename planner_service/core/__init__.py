"""The planner service's domain: steps submitted, planned, fetched and deleted, with no transport.

    from planner_service.core import PlannerCore, ServiceConfig
    core = PlannerCore(ServiceConfig(db_path="harts.db")); core.start()
    core.submit(body, "json"); core.plan(step_id, topology); core.fetch(step_id, rank)
    await core.aio.fetch(step_id, rank, wait=30.0)      # from an event loop: the long-poll

`service.PlannerCore` puts the parts together, one job each (docs/design/service.md).
"""
from __future__ import annotations

from planner_service.core.config import ServiceConfig
from planner_service.core.service import PlannerCore

__all__ = ["PlannerCore", "ServiceConfig"]
