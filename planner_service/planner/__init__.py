"""The HARTS planner: partition a step's prefix forest and build its plan (docs/design/planner.md).

    from planner_service.planner import PlanConfig, plan_step, warmup
    warmup()                                   # compile the Numba kernels once, at start-up
    plan = plan_step(forest, PlanConfig(world_size=8, microbatch_tokens=16384))

`plan_step` (`step.py`) is `partition` (levels 1-2, `partition.py`) then `build_plan` (`build.py`);
`cfg.sharing=False` plans the trajectory-expanded baseline (`expand_forest`), and a lock-step plan
with cross_rank_windows keeps the better of its plans with and without windows across ranks
(docs/design/cross-rank.md).
"""
from __future__ import annotations

from planner_service.errors import PlanningError
from planner_service.planner.build import build_plan
from planner_service.planner.config import PlanConfig
from planner_service.planner.expand import expand_forest
from planner_service.planner.kernel_warmup import warmup
from planner_service.planner.partition import crossing_partitions, partition, partition_with_report
from planner_service.planner.spec import MicrobatchSpec, Partition
from planner_service.planner.step import plan_step

__all__ = [
    "MicrobatchSpec", "Partition", "PlanConfig", "PlanningError", "build_plan", "crossing_partitions", "expand_forest",
    "partition", "partition_with_report", "plan_step", "warmup",
]
