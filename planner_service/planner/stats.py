"""The plan report (PlanStats): token counts, compression, costs, makespan, live memory, cross edges, phases.

    fill_stats(plan.header.stats, forest, cfg, layouts, mbs, rank_costs, peak, edges)
    fill_lockstep_stats(plan, phases, edges)          # lock-step plans

The fields: docs/design/plan-contract.md, "The header". Legend: W ranks, P phases.
"""
from __future__ import annotations

import numpy as np

from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.row_layout import Layout
from proto.harts.v1 import plan_pb2
from plan.cross_edges import CrossEdgeArrays, transfer_bytes
from plan.phases import phase_counts, step_cost


def fill_lockstep_stats(plan: plan_pb2.Plan, phases: np.ndarray, edges: list[CrossEdgeArrays]) -> None:
    """PlanStats.lockstep_*: the phases, their makespan (plan.phases' cost model, each rank's step
    plus the transfers of its cross edges in the phase) and the ratio."""
    st = plan.header.stats
    cost = np.zeros((len(plan.ranks), phases.shape[0]), np.float64)
    tb = plan.header.params.cost_model.transfer_byte
    for r, rp in enumerate(plan.ranks):
        for i, (step, phase) in enumerate(zip(rp.steps, phases.tolist())):
            if step.microbatch >= 0:
                cost[r, i] = step_cost(phase, rp.microbatches[step.microbatch].cost)
        if edges:
            cost[r] += tb * transfer_bytes(edges, r, phases.shape[0])
    st.lockstep_phases = int(phases.shape[0])
    st.lockstep_makespan = float(cost.max(axis=0).sum()) if cost.size else 0.0
    st.lockstep_ratio = st.lockstep_makespan / st.makespan if st.makespan > 0 else 1.0
    st.lockstep_forward_phases, st.lockstep_backward_phases, st.lockstep_recompute_phases = phase_counts(phases)


def fill_stats(st: plan_pb2.PlanStats, forest: Forest, cfg: PlanConfig, layouts: list[Layout],
               mbs: dict[int, plan_pb2.Microbatch], rank_costs: list[float], peak: int,
               edges: list[CrossEdgeArrays]) -> None:
    """The plan report (PlanStats): token counts, compression, costs, makespan, live memory,
    windows across ranks."""
    st.unique_tokens = forest.unique_tokens
    st.expanded_tokens = forest.expanded_tokens
    st.replay_tokens = sum(x.replay_tokens for x in mbs.values())
    st.duplicated_tokens = sum(x.duplicated_tokens for x in mbs.values())
    st.computed_tokens = st.unique_tokens + st.replay_tokens + st.duplicated_tokens
    st.compression_ideal = st.expanded_tokens / st.unique_tokens if st.unique_tokens else 0.0
    st.compression_achieved = st.expanded_tokens / st.computed_tokens if st.computed_tokens else 0.0
    st.microbatches = len(layouts)
    st.linear_attention_calls = max((len(x.linear_calls) for x in mbs.values()), default=0)
    st.rank_costs.extend(rank_costs)
    mean = float(np.mean(rank_costs)) if rank_costs else 0.0
    st.imbalance = max(rank_costs) / mean if mean > 0 else 1.0
    moved = np.zeros(cfg.world_size, np.int64)
    for e in edges:
        moved[[e.exporter_rank, e.importer_rank]] += 2 * e.bytes
    if cfg.crossing:
        st.rank_transfer_costs.extend((moved * float(cfg.cost_model.transfer_byte)).tolist())
    st.cross_edges = len(edges)
    st.exchanged_bytes = 2 * sum(e.bytes for e in edges)
    st.max_rank_exchanged_bytes = int(moved.max()) if edges else 0
    st.makespan = max((c + t for c, t in zip(rank_costs, st.rank_transfer_costs or [0.0] * len(rank_costs))), default=0.0)
    lengths = forest.traj_length()
    longest = float(cfg.cost_model.path_cost(int(lengths.max()))) if lengths.shape[0] else 0.0
    st.makespan_lower_bound = max(sum(rank_costs) / cfg.world_size, longest)
    st.makespan_ratio = st.makespan / st.makespan_lower_bound if st.makespan_lower_bound > 0 else 1.0
    st.peak_live_bytes = int(peak)
    st.peak_live_tokens = cfg.sizes.tokens(peak)
    st.windows = sum(1 for L in layouts if L.shared and L.ctx_tok.shape[0])

