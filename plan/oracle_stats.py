"""The oracle validator's statistics rules: PlanStats as the microbatches, costs, phases and cross edges give them.

    check_counts(plan, all_mbs, kept, peak, sizes)    # tokens, live memory, costs, lock-step, windows
    check_cross_edge_stats(plan, edges)                # edges listed on both ranks, their totals

Costs compare within a relative 1e-9 (docs/design/plan-contract.md, "The header"). Legend: W ranks, P phases, E cross edges.
"""
from __future__ import annotations

import numpy as np

from proto.harts.v1 import plan_pb2
from plan.cross_edges import CrossEdgeArrays, check_plan_edges, decode_edges, transfer_bytes
from plan.memory_model import RowSizes
from plan.microbatch import PlanValidationError
from plan.oracle_rows import CheckedMicrobatch
from plan.phases import lockstep_phases, phase_counts, step_cost


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")


def check_counts(plan: plan_pb2.Plan, all_mbs: dict[int, CheckedMicrobatch], kept: int, peak: int,
                 sizes: RowSizes) -> None:
    """Token counts (`kept` rows kept once), live memory (`peak` bytes, the ranks' stacks), costs,
    lock-step statistics and windows."""
    st = plan.header.stats
    M = len(all_mbs)
    if st.unique_tokens != kept:
        _fail("header.stats.unique_tokens", f"expected {kept} kept rows, got {st.unique_tokens}")
    replay = sum(mb.msg.replay_tokens for mb in all_mbs.values())
    dup = sum(mb.msg.duplicated_tokens for mb in all_mbs.values())
    if (st.replay_tokens, st.duplicated_tokens, st.computed_tokens, st.microbatches) != (replay, dup, kept + replay + dup, M):
        _fail("header.stats", "expected replay/duplicated/computed tokens and microbatches to match the microbatches")
    if st.peak_live_bytes != peak:
        _fail("header.stats.peak_live_bytes", f"expected {peak} (live stack along the execution order), got {st.peak_live_bytes}")
    if st.peak_live_tokens != sizes.tokens(peak):
        _fail("header.stats.peak_live_tokens", f"expected {sizes.tokens(peak)} (peak_live_bytes in row-equivalents), got {st.peak_live_tokens}")
    _check_costs(plan, all_mbs)
    _check_lockstep_stats(plan)
    windows = sum(1 for mb in all_mbs.values() if mb.I)
    if st.windows != windows:
        _fail("header.stats.windows", f"expected {windows} (microbatches with imports), got {st.windows}")


def check_cross_edge_stats(plan: plan_pb2.Plan, edges: list[CrossEdgeArrays]) -> None:
    """Step-wide rules of windows across ranks: every edge listed identically by its exporter's
    and its importer's rank, ids 0..E-1 (`plan.cross_edges.check_plan_edges`), and the statistics
    that count them."""
    check_plan_edges(list(plan.ranks))
    by_id = {e.id: e for e in edges}
    E = len(by_id)
    st = plan.header.stats
    moved = np.zeros(len(plan.ranks), np.int64)
    for e in by_id.values():
        moved[[e.exporter_rank, e.importer_rank]] += 2 * e.bytes
    want = (E, 2 * sum(e.bytes for e in by_id.values()), int(moved.max()) if E else 0)
    got = (st.cross_edges, st.exchanged_bytes, st.max_rank_exchanged_bytes)
    if got != want:
        _fail("header.stats.cross_edges", f"expected (cross_edges, exchanged_bytes, max_rank_exchanged_bytes) = {want} "
              f"from the edges, got {got}")


def _rank_transfer(plan: plan_pb2.Plan) -> list[float]:
    """transfer_byte x the bytes each rank sends plus receives over its cross edges."""
    tb = plan.header.params.cost_model.transfer_byte
    return [tb * sum(2 * e.bytes for e in rank.cross_edges) for rank in plan.ranks]


def _check_costs(plan: plan_pb2.Plan, all_mbs: dict[int, CheckedMicrobatch]) -> None:
    """rank_costs sum their microbatches' costs, rank_transfer_costs price their cross edges; the
    makespan statistics follow from both."""
    st, W = plan.header.stats, len(plan.ranks)
    costs = [sum(mb.cost for mb in rank.microbatches) for rank in plan.ranks]
    if len(st.rank_costs) != W or any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(st.rank_costs, costs)):
        _fail("header.stats.rank_costs", f"expected the sums of each rank's microbatch costs {costs[:4]}..., got {list(st.rank_costs)[:4]}...")
    if any(mb.msg.cost < 0 for mb in all_mbs.values()):
        _fail("microbatch cost", "expected costs >= 0")
    transfer = _rank_transfer(plan)
    got = list(st.rank_transfer_costs) or [0.0] * W
    if len(got) != W or any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(got, transfer)):
        _fail("header.stats.rank_transfer_costs", f"expected transfer_byte x each rank's exchanged bytes {transfer[:4]}..., "
              f"got {list(st.rank_transfer_costs)[:4]}...")
    top = max((c + t for c, t in zip(costs, transfer)), default=0.0)
    if abs(st.makespan - top) > 1e-9 * max(1.0, top):
        _fail("header.stats.makespan", f"expected the largest rank cost (with its transfers) {top}, got {st.makespan}")
    # a rank computes the longest trajectory's rows unless windows cross ranks; a lock-step plan's
    # phases run them in sequence either way
    step = _lockstep_makespan(plan, lockstep_phases(plan.header)) if plan.header.params.lockstep else top
    if st.makespan_lower_bound < sum(costs) / W * (1 - 1e-9) or st.makespan_lower_bound > step * (1 + 1e-9) + 1e-9:
        _fail("header.stats.makespan_lower_bound", f"expected between total / world_size = {sum(costs) / W} and the "
              f"{'lock-step makespan' if plan.header.params.lockstep else 'makespan'} {step}, got {st.makespan_lower_bound}")
    want = top / st.makespan_lower_bound if st.makespan_lower_bound > 0 else 1.0
    if abs(st.makespan_ratio - want) > 1e-9 * max(1.0, want):
        _fail("header.stats.makespan_ratio", f"expected makespan / makespan_lower_bound = {want}, got {st.makespan_ratio}")


def _lockstep_makespan(plan: plan_pb2.Plan, phases: np.ndarray) -> float:
    """The sum over phases of the slowest rank's step cost, its transfers included (plan.phases)."""
    slowest = np.zeros(phases.shape[0], np.float64)
    tb = plan.header.params.cost_model.transfer_byte
    for rank in plan.ranks:
        cost = np.zeros(phases.shape[0], np.float64)
        for i, (step, phase) in enumerate(zip(rank.steps, phases.tolist())):
            if step.microbatch >= 0:
                cost[i] = step_cost(phase, rank.microbatches[step.microbatch].cost)
        if len(rank.cross_edges):
            cost += tb * transfer_bytes(decode_edges(rank), rank.rank, phases.shape[0])
        slowest = np.maximum(slowest, cost)
    return float(slowest.sum())


def _check_lockstep_stats(plan: plan_pb2.Plan) -> None:
    """PlanStats.lockstep_*: the phase counts, and the makespan and ratio of plan.phases' cost
    model over the ranks' steps (all 0 in a free plan)."""
    st = plan.header.stats
    phases = lockstep_phases(plan.header)
    if not plan.header.params.lockstep:
        got = (st.lockstep_phases, st.lockstep_makespan, st.lockstep_ratio, st.lockstep_forward_phases,
               st.lockstep_backward_phases, st.lockstep_recompute_phases)
        if any(got):
            _fail("header.stats.lockstep_phases", f"expected no lock-step statistics in a free plan, got {got}")
        return
    counts = phase_counts(phases)
    got = (st.lockstep_forward_phases, st.lockstep_backward_phases, st.lockstep_recompute_phases)
    if st.lockstep_phases != phases.shape[0] or got != counts:
        _fail("header.stats.lockstep_phases", f"expected {phases.shape[0]} phases ({counts} forward, backward, recompute), "
              f"got {st.lockstep_phases} ({got})")
    want = _lockstep_makespan(plan, phases)
    if abs(st.lockstep_makespan - want) > 1e-9 * max(1.0, want):
        _fail("header.stats.lockstep_makespan", f"expected the sum over phases of the slowest rank's step cost (with its "
              f"transfers) {want}, "
              f"got {st.lockstep_makespan}")
    ratio = want / st.makespan if st.makespan > 0 else 1.0
    if abs(st.lockstep_ratio - ratio) > 1e-9 * max(1.0, ratio):
        _fail("header.stats.lockstep_ratio", f"expected lockstep_makespan / makespan = {ratio}, got {st.lockstep_ratio}")
