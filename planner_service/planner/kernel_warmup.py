"""Compile (or load from Numba's on-disk cache) every planner kernel once, at start-up.

    seconds = warmup()

It plans a tiny forest under settings that reach every kernel: windows, duplication,
recomputation, placement with a full cost model, the expanded baseline, the replay ablation and a
lock-step plan (docs/design/planner.md).
"""
from __future__ import annotations

import logging
import time

import numpy as np

import planner_service.planner.placement as placement
from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.cost_model import CostModel
from planner_service.planner.partition import partition
from planner_service.planner.step import plan_step

log = logging.getLogger(__name__)


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
