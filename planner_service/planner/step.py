"""Plan one training step: `partition` + `build_plan`, and with windows across ranks the better of the plans.

    plan = plan_step(forest, PlanConfig(world_size=8, microbatch_tokens=16384))   # plan_pb2.Plan

With `cfg.sharing=False` it plans the trajectory-expanded baseline (`expand.expand_forest`); with
`cfg.crossing` it compares the plans with and without windows across ranks
(docs/design/cross-rank.md, "When the planner uses them").
"""
from __future__ import annotations

import dataclasses
import logging
import time

from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.build import build_plan
from planner_service.planner.config import PlanConfig
from planner_service.planner.crossing import import_duplicates
from planner_service.planner.expand import expand_forest
from planner_service.planner.partition import crossing_partitions, partition
from planner_service.planner.spec import Partition
from proto.harts.v1 import plan_pb2

log = logging.getLogger(__name__)


#: Two lock-step makespans within this fraction count as equal: a plan with windows across ranks
#: that duplicates fewer rows is kept at up to (1 + CROSS_EQUAL_MAKESPAN) x the other's step.
CROSS_EQUAL_MAKESPAN = 0.01


def plan_step(forest: Forest, cfg: PlanConfig, *, impl: str = "numba") -> plan_pb2.Plan:
    """Plan one training step.

    Args:
        forest: the step's prefix forest (planner_service.ingest).
        cfg: topology and budgets.
        impl: "numba" (default) or "ref" (plain-Python partitioner and builder kernels; tests and
            the benchmark's baseline).

    Raises:
        PlanningError: settings the forest cannot satisfy (see `partition`); the message names the
            setting and the remedy.
    """
    t0 = time.perf_counter()
    source = forest if cfg.sharing else expand_forest(forest)
    if cfg.crossing:
        plan = _plan_crossing(source, cfg, impl)
    else:
        plan = build_plan(source, cfg, partition(source, cfg, impl=impl), impl=impl)
    plan.header.stats.plan_seconds = time.perf_counter() - t0
    st = plan.header.stats
    if st.peak_live_bytes > cfg.memory_bytes:  # the partitioner's estimate bounds the exact stack
        raise PlanningError(
            f"memory_tokens: the plan's live window stack holds {st.peak_live_bytes} bytes ({st.peak_live_tokens} "
            f"row-equivalents), expected <= {cfg.memory_bytes} ({cfg.memory_tokens}); the partitioner's memory "
            f"estimate was below the exact stack, a planner bug"
        )
    log.debug(
        "planned %s: %d microbatches, compression %.3f of %.3f, imbalance %.3f, %.3f s",
        forest.batch_id, st.microbatches, st.compression_achieved, st.compression_ideal, st.imbalance, st.plan_seconds,
    )
    return plan


def _plan_crossing(source: Forest, cfg: PlanConfig, impl: str) -> plan_pb2.Plan:
    """The plan without windows across ranks, or the best plan with them where it is better: a
    shorter lock-step makespan, or one at most CROSS_EQUAL_MAKESPAN longer with fewer duplicated
    rows (docs/design/cross-rank.md)."""
    plans: dict[bool, plan_pb2.Plan] = {}
    errors: list[PlanningError] = []
    candidates: list[Partition] = []
    try:
        base = partition(source, dataclasses.replace(cfg, cross_rank_windows=False), impl=impl)
        plans[False] = build_plan(source, cfg, base, impl=impl)
        kept = import_duplicates(source, base)  # the same schedule, duplicated rows imported where it allows
        if kept is not None:
            candidates.append(kept)
    except PlanningError as exc:  # a budget the duplicating placement cannot meet
        errors.append(exc)
    try:
        candidates += [part for _, part, _ in crossing_partitions(source, cfg, impl=impl)]
    except PlanningError as exc:  # no candidate fits the budgets or finishes its order
        errors.append(exc)
        log.debug("plan %s with windows across ranks: %s", source.batch_id, exc)
    built = set()
    for part in candidates:
        key = part.digest()
        if key in built:  # another prefix or placement gave the same partition
            continue
        built.add(key)
        plan = build_plan(source, cfg, part, impl=impl)
        if plan.header.stats.peak_live_bytes > cfg.memory_bytes:  # what it receives does not fit
            continue
        best = plans.get(True)
        if best is None or _step_key(plan) < _step_key(best):
            plans[True] = plan
    if not plans:
        raise errors[0]
    base, cross = plans.get(False), plans.get(True)
    if base is None or cross is None:
        return base or cross
    b, x = base.header.stats, cross.header.stats
    use = x.cross_edges > 0 and (
        x.lockstep_makespan < b.lockstep_makespan
        or (x.lockstep_makespan <= (1 + CROSS_EQUAL_MAKESPAN) * b.lockstep_makespan and x.duplicated_tokens < b.duplicated_tokens))
    plan = cross if use else base
    for msg, st in ((plan.header.stats.with_cross_edges, x), (plan.header.stats.without_cross_edges, b)):
        for name in ("compression_achieved", "makespan_ratio", "lockstep_makespan", "duplicated_tokens", "cross_edges",
                     "exchanged_bytes", "makespan", "makespan_lower_bound"):
            setattr(msg, name, getattr(st, name))
    log.debug("plan %s: %s windows across ranks (lock-step makespan %.0f with %d edges, %.0f without)", source.batch_id,
              "with" if use else "without", x.lockstep_makespan, x.cross_edges, b.lockstep_makespan)
    return plan


def _step_key(plan: plan_pb2.Plan) -> tuple[float, int]:
    """Order of the plans with windows across ranks: the shortest lock-step step, then the fewest
    duplicated rows."""
    st = plan.header.stats
    return st.lockstep_makespan, st.duplicated_tokens

