"""The HARTS planner (DESIGN §4): partition a step's prefix forest and build its plan.

    from planner_service.planner import PlanConfig, plan_step, warmup
    warmup()                                   # compile the Numba kernels once, at start-up
    plan = plan_step(forest, PlanConfig(world_size=8, microbatch_tokens=16384))

`plan_step` = `partition` (levels 1-2, `partition.py`; with `cfg.lockstep` the phases of
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

import dataclasses
import logging
import time

import numpy as np

import planner_service.planner.placement as placement
from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.build import build_plan
from planner_service.planner.config import PlanConfig
from planner_service.planner.cost_model import CostModel
from planner_service.planner.crossing import import_duplicates
from planner_service.planner.partition import crossing_partitions, expand_forest, partition, partition_with_report
from planner_service.planner.spec import MicrobatchSpec, Partition
from proto.harts.v1 import plan_pb2

__all__ = [
    "MicrobatchSpec", "Partition", "PlanConfig", "PlanningError", "build_plan", "crossing_partitions", "expand_forest",
    "partition", "partition_with_report", "plan_step", "warmup",
]

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
    """The plan without windows across ranks, or the best plan with them where it is better
    (module docstring)."""
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


def _tiny_forest() -> Forest:
    """Two trees: a 10-token prompt with three 12-token branches, and a lone 20-token trajectory."""
    seg_length = np.array([10, 12, 12, 12, 20], np.int32)
    n_u = int(seg_length.sum())
    traj_len = np.array([22, 22, 22, 20], np.int64)
    n_e = int(traj_len.sum())
    return Forest(
        batch_id="warmup",
        vocab_size=64,
        tokens=(np.arange(n_u) % 64).astype(np.int32),
        seg_parent=np.array([-1, 0, 0, 0, -1], np.int32),
        seg_offset=(np.cumsum(seg_length, dtype=np.int64) - seg_length),
        seg_length=seg_length,
        seg_depth=np.array([0, 10, 10, 10, 0], np.int32),
        seg_tree=np.array([0, 0, 0, 0, 1], np.int32),
        tree_ids=["a", "b"],
        traj_ids=["a0", "a1", "a2", "b0"],
        traj_seg=np.array([1, 2, 3, 4], np.int32),
        traj_offset=np.r_[0, np.cumsum(traj_len)].astype(np.int64),
        loss_mask=np.ones(n_e, np.uint8),
        advantages=np.zeros(n_e, np.float32),
        old_logprobs=np.zeros(n_e, np.float32),
        reward=np.zeros(4, np.float32),
        weight=np.ones(4, np.float32),
        group_ids=["g"] * 4,
    )


def warmup() -> float:
    """Compile (or load from the on-disk cache) every Numba kernel of the planner on a tiny input:
    windows, duplication, recomputation, placement across ranks with a full cost model, the
    expanded baseline, the replay ablation and a lock-step plan.

    Returns the seconds it took.
    """
    t0 = time.perf_counter()
    forest = _tiny_forest()
    for cfg in (
        PlanConfig(world_size=2, microbatch_tokens=16, chunk_size=8, memory_tokens=24),
        PlanConfig(world_size=3, microbatch_tokens=16, chunk_size=4, makespan_slack=1.0,
                   cost_model=CostModel(row=1.0, attention=0.01, linear_call=1.0, logprob_row=1.0)),
        PlanConfig(world_size=2, microbatch_tokens=32, chunk_size=8, windows=False),
        PlanConfig(world_size=1, microbatch_tokens=16, chunk_size=4, replay=False),
        PlanConfig(world_size=2, microbatch_tokens=64, chunk_size=8, sharing=False),
        PlanConfig(world_size=2, microbatch_tokens=16, chunk_size=8, memory_tokens=24, lockstep=True),
    ):
        try:
            plan_step(forest, cfg)
        except PlanningError:
            partition(forest, PlanConfig(world_size=cfg.world_size, microbatch_tokens=64, chunk_size=cfg.chunk_size))
    parent = np.array([-1, 0, 0, 1, -1], np.int64)
    w = np.ones(5)
    placement.refine(parent, np.zeros(5, np.int64), w, w, w * 0, 2, 4, 4, 0.0)  # placement may not need it above
    seconds = time.perf_counter() - t0
    log.debug("planner warm-up %.3f s", seconds)
    return seconds
