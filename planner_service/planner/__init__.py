"""The HARTS planner (DESIGN §4): partition a step's prefix forest and build its plan.

    from planner_service.planner import PlanConfig, plan_step, warmup
    warmup()                                   # compile the Numba kernels once, at start-up (kernel_warmup.py)
    plan = plan_step(forest, PlanConfig(world_size=8, microbatch_tokens=16384))

`plan_step` (`step.py`) = `partition` (levels 1-2, `partition.py`; with `cfg.lockstep` the phases of
`lockstep.py`) + `build_plan` (`build.py`) + the wall time of both in `PlanStats.plan_seconds`.
With `cfg.sharing=False` it plans the trajectory-expanded baseline: every trajectory its own tree
(`expand_forest`), standard packing, the same builder.

With windows across ranks allowed (`cfg.crossing`: a lock-step plan with cross_rank_windows) it
builds the plan whose placement duplicates root paths (windows stay on their rank) and the plans
with windows across ranks: that plan's schedule with the duplicated rows imported where windows
enclose each other (`crossing.import_duplicates`), and the partitioner's crossing candidates
(`partition.crossing_partitions`: a tree's shared prefix imported from the rank keeping its root).
The best of the latter (shortest lock-step makespan, then fewest duplicated rows) replaces the
first only where it shortens the step or duplicates fewer rows at a step at most
CROSS_EQUAL_MAKESPAN longer; PlanStats.with_cross_edges / without_cross_edges report both.
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
