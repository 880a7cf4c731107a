"""The plan builder: from a Forest and a Partition to the wire plan (docs/design/planner.md, "The builder").

    plan = build_plan(forest, cfg, partition)      # plan_pb2.Plan; impl="ref" runs the kernels' twins

Stages, in order: `partition_check.check_layouts`; `row_layout.fill_context`, `lay_out`,
`link_windows`, `schedule_calls`, `state_sources`; `logprob_map.logprob_map`;
`partition_check.rank_orders`, `check_phases`; `serialise.fill_header`, `serialise_microbatch`,
`fill_cross_edges`, `fill_steps`; `stats.fill_stats`. The kernels are picked once per plan
(`_KERNELS`), and both modes give byte-identical plans; `PlanStats.plan_seconds` is `plan_step`'s.

Legend: N_u forest tokens, N_e expanded positions, T trajectories, R local rows, I imported rows,
S local segments, K conv kernel, C chunk size.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import numpy as np

import planner_service.planner.build_kernels as bk
import planner_service.planner.linear_calls_codec as codec
import planner_service.planner.logprob_map as lpm
import planner_service.planner.min_calls as mc
from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.partition_check import check_layouts, check_phases, rank_orders
from planner_service.planner.row_layout import TokenIndex, fill_context, lay_out, link_windows, schedule_calls, state_sources
from planner_service.planner.serialise import fill_cross_edges, fill_header, fill_steps, serialise_microbatch
from planner_service.planner.spec import Partition
from planner_service.planner.stats import fill_lockstep_stats, fill_stats
from proto.arrays import pack as pk
from proto.harts.v1 import plan_pb2
from plan.microbatch import MicrobatchArrays

_KERNEL_NAMES = ("token_index", "expand_ranges", "local_segments", "local_rows_layout", "ext_parent_depth",
                 "sorted_union", "attn_ranges", "conv_ancestors", "subtree_occurrence", "row_occurrence")
_KERNELS = {
    "numba": SimpleNamespace(**{n: getattr(bk, n) for n in _KERNEL_NAMES}, lp_grouped=lpm.lp_grouped,
                             pack=partial(mc.pack, use_numba=True), schedule=mc.schedule,
                             fill_linear_calls=codec.fill_linear_calls),
    "ref": SimpleNamespace(**{n: getattr(bk, n + "_ref") for n in _KERNEL_NAMES}, lp_grouped=lpm.lp_grouped_ref,
                           pack=partial(mc.pack, use_numba=False), schedule=mc.schedule_ref,
                           fill_linear_calls=codec.fill_linear_calls_ref),
}


def build_plan(forest: Forest, cfg: PlanConfig, partition: Partition, *, impl: str = "numba") -> plan_pb2.Plan:
    """Lay out and serialise the plan of one step (the stages listed at the top of this module).

    Args:
        forest: the step's prefix forest.
        cfg: planner settings (chunk size, conv kernel, replay, log-prob positions, budgets, the
            memory model's sizes and the cost model).
        partition: microbatch membership, edge modes, placement and per-rank order.
        impl: "numba" (default) or "ref" (the kernels' plain-Python twins; tests).

    Raises:
        PlanningError: the partition does not describe a valid microbatch forest for `forest`.
            (Live stacks over the budget are reported in PlanStats.peak_live_bytes, not raised:
            `plan_step` and the validator enforce the budget.)
    """
    if impl not in _KERNELS:
        raise ValueError(f"impl: expected one of {sorted(_KERNELS)}, got {impl!r}")
    k = _KERNELS[impl]
    tix = TokenIndex(forest, k.token_index)
    layouts, kept_mb, topo = check_layouts(forest, cfg, partition, k)
    fill_context(forest, tix, layouts, kept_mb, topo, k)
    kept_row = np.empty(forest.unique_tokens, np.int64)  # every token is kept once: all filled
    for m in topo:
        lay_out(layouts[m], tix, cfg, k, kept_row)
    link_windows(layouts, topo, k)
    ext = schedule_calls(layouts, tix, cfg, topo, k)
    sources = state_sources(layouts)
    lp = lpm.logprob_map(forest, cfg, k, kept_mb, kept_row, len(layouts))
    steps, rank_order = rank_orders(partition, cfg)
    phases = check_phases(partition, cfg, steps)

    plan = plan_pb2.Plan()
    fill_header(plan.header, forest, cfg)
    if phases is not None:
        plan.header.lockstep_phases = pk(phases, "uint8")
    for r in range(cfg.world_size):
        plan.ranks.add(rank=r)
    mbs: dict[int, plan_pb2.Microbatch] = {}
    arrays: dict[int, MicrobatchArrays] = {}  # what plan.decode would decode, for the memory model
    occ_seg = k.subtree_occurrence(forest.traj_seg, forest.seg_parent)  # trajectories below each forest segment
    for r in range(cfg.world_size):
        for m in rank_order[r]:
            msg = plan.ranks[r].microbatches.add()
            arrays[m] = serialise_microbatch(msg, layouts[m], forest, cfg, k, ext[m], sources[m], lp, occ_seg)
            mbs[m] = msg
    edges = fill_cross_edges(plan, cfg, arrays, steps, topo)
    rank_costs, peak = fill_steps(plan, cfg, steps, rank_order, mbs, arrays, edges)
    fill_stats(plan.header.stats, forest, cfg, layouts, mbs, rank_costs, peak, edges)
    if phases is not None:
        fill_lockstep_stats(plan, phases, edges)
    return plan

