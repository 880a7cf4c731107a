"""The two-level partitioner: forest -> placement, microbatches, edge modes, order (docs/design/planner.md).

    part = partition(forest, cfg)                       # Partition: what `build_plan` consumes (spec.py)
    part, report = partition_with_report(forest, cfg)   # plus the partitioner's own estimates

Stages: `rank_forests` (units, placement), `pieces.cut_and_pack` (level 1), `edge_modes` with
`memory_fit` (level 2), `assemble` (order, specs). Lock-step plans align phases (`_lockstep`,
docs/design/lockstep.md); `crossing_partitions` are the candidates with windows across ranks
(docs/design/cross-rank.md). `impl="ref"` runs every kernel's plain-Python twin (`_KERNELS`).

Legend: S segments, U units, n units of all rank forests, K pieces, M microbatches, G window
groups, W ranks, T trajectories, P placement parts.
"""
from __future__ import annotations
import itertools
import logging
from types import SimpleNamespace

import numpy as np

import planner_service.planner.level1 as level1
import planner_service.planner.level2 as level2
import planner_service.planner.lockstep as lockstep
import planner_service.planner.lockstep_ref as lockstep_ref
import planner_service.planner.partition_ref as partition_ref
import planner_service.planner.placement as placement
import planner_service.planner.placement_ref as placement_ref
from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.assemble import PartitionReport, assemble
from planner_service.planner.config import PlanConfig
from planner_service.planner.edge_modes import choose_edge_modes, edge_rows
from planner_service.planner.pieces import cut_and_pack
from planner_service.planner.placement_search import unit_costs
from planner_service.planner.rank_forests import RankForests, crossing_forests, rank_forests
from planner_service.planner.spec import Partition

log = logging.getLogger(__name__)

_KERNELS = {
    "numba": SimpleNamespace(
        build_units=level1.build_units,
        cut_pieces=level1.cut_pieces,
        piece_roots=level1.piece_roots,
        first_fit_decreasing=level1.first_fit_decreasing,
        balance_bins=level1.balance_bins,
        context_cost=level2.context_cost,
        window_export_counts=level2.window_export_counts,
        window_groups=level2.window_groups,
        subtree_costs=level2.subtree_costs,
        lpt_place=level2.lpt_place,
        live_stack=level2.live_stack,
        dfs_order=level2.dfs_order,
        align_phases=lockstep.align_phases,
        context_costs=placement.context_costs,
        cut_parts=placement.cut_parts,
        rank_closure=placement.rank_closure,
        closure_costs=placement.closure_costs,
        refine=placement.refine,
        lp_row_flags=placement.lp_row_flags,
        subtree_sums=placement.subtree_sums,
        subtree_sizes=placement.subtree_sizes,
        lpt_parts=placement.lpt_parts,
        placement_costs=placement.placement_costs,
    ),
    "ref": SimpleNamespace(
        **{name: getattr(partition_ref, name) for name in (
            "build_units", "cut_pieces", "piece_roots", "first_fit_decreasing", "balance_bins", "context_cost",
            "window_export_counts", "window_groups", "subtree_costs", "lpt_place", "live_stack", "dfs_order")},
        align_phases=lockstep_ref.align_phases_ref,
        **{name: getattr(placement_ref, name) for name in (
            "context_costs", "cut_parts", "rank_closure", "closure_costs", "refine", "lp_row_flags",
            "subtree_sums", "subtree_sizes", "lpt_parts", "placement_costs")},
    ),
}


def partition(forest: Forest, cfg: PlanConfig, *, impl: str = "numba") -> Partition:
    """Placement, microbatches, edge modes and execution order of one step (docs/design/planner.md).

    Raises:
        PlanningError: settings that cannot be satisfied (a trajectory longer than B without
            windows, a root-to-leaf path whose window exports alone exceed M).
    """
    return partition_with_report(forest, cfg, impl=impl)[0]


def partition_with_report(forest: Forest, cfg: PlanConfig, *, impl: str = "numba") -> tuple[Partition, PartitionReport]:
    """`partition` plus the partitioner's estimates: the stages `rank_forests` (units and
    placement), `pieces.cut_and_pack` (pieces and microbatches), `edge_modes.edge_rows`,
    `edge_modes.choose_edge_modes` (edge modes, ranks without windows, the live stack) and
    `assemble` (order, specs, report)."""
    if impl not in _KERNELS:
        raise ValueError(f"impl: expected one of {sorted(_KERNELS)}, got {impl!r}")
    k = _KERNELS[impl]
    W = cfg.world_size
    if forest.num_segments == 0:
        empty = PartitionReport(
            rows=np.zeros(0, np.int64), kept=np.zeros(0, np.int64), duplicated=np.zeros(0, np.int64),
            rank_load=np.zeros(W), live=np.zeros(0, np.int64), pieces=0, exports=np.zeros(0, np.int64),
        )
        return Partition(microbatches=[], rank_steps=[[] for _ in range(W)]), empty
    if not cfg.windows:
        _check_paths_fit(forest, cfg.microbatch_tokens)
    if cfg.crossing:
        return crossing_partitions(forest, cfg, impl=impl)[0][1:]
    rf = rank_forests(k, forest, cfg)
    if cfg.lockstep:
        return assemble(k, cfg, rf, *_lockstep(k, cfg, rf))
    l1 = cut_and_pack(k, cfg, rf)
    edges = edge_rows(k, cfg, rf, l1)
    l2 = choose_edge_modes(k, cfg, rf, l1, edges)
    return assemble(k, cfg, rf, l1, edges, l2)


#: Lock-step plans try every rank at most (the fewest microbatches any rank needs at B) + each of
#: these microbatches, with equal counts per rank (`lockstep.equal_count_caps`).
LOCKSTEP_EXTRA_MICROBATCHES = (0, 1, 2)
#: Windows across ranks: the shared prefix imported lies above each tree's root segment (None:
#: what all its trajectories share) or above these fractions of B (deeper imports wait longer: a
#: lock-step importer forwards after its exporter's phase and closes before it), each with a
#: placement that counts that prefix as duplicated or as free.
CROSS_PREFIXES = (None, 1 / 8, 1 / 4)


def crossing_partitions(forest: Forest, cfg: PlanConfig, *, impl: str = "numba"
                        ) -> list[tuple[float, Partition, PartitionReport]]:
    """Lock-step partitions whose windows may cross ranks (cfg.crossing), one per candidate: the
    rank forests of `crossing_forests` for every prefix of CROSS_PREFIXES and both placements, each with its lock-step schedule (`_lockstep`). Returns (the schedule's
    lock-step makespan estimate, partition, report) of every candidate that fits the budgets and
    whose order finishes, shortest first; `plan_step` builds them and compares the plans with the plan
    without windows across ranks.

    Raises:
        PlanningError: no candidate does.
    """
    if impl not in _KERNELS:
        raise ValueError(f"impl: expected one of {sorted(_KERNELS)}, got {impl!r}")
    if not cfg.crossing:
        raise ValueError("cfg: expected a lock-step plan with cross_rank_windows, windows, sharing and world_size > 1")
    k = _KERNELS[impl]
    units = k.build_units(forest.seg_parent, forest.seg_length, forest.seg_depth, cfg.chunk_size)
    uc = unit_costs(k, forest, cfg, *units)
    placements: dict = {}  # the placement without a free prefix is the same for every prefix
    out, error = [], None
    for prefix, free_prefix in itertools.product(CROSS_PREFIXES, (True, False)):
        depth = -1 if prefix is None else int(prefix * cfg.microbatch_tokens)
        rf = crossing_forests(k, forest, cfg, units, uc, placements, depth, free_prefix)
        try:
            got = _lockstep(k, cfg, rf)
        except PlanningError as exc:
            error = error or exc
            continue
        out.append((got[3].makespan, got[3].phases.shape[0], len(out), *assemble(k, cfg, rf, *got)))
    if not out:
        raise error
    return [(x[0], x[3], x[4]) for x in sorted(out, key=lambda x: x[:3])]


def _lockstep(k, cfg: PlanConfig, rf: RankForests):
    """Level 1 with about equal microbatch counts and sizes per rank, level 2 with the fewest
    recomputed windows, and the phases aligned (`lockstep.align_phases`): of the candidate
    counts and rank weightings, the schedule with the shortest lock-step makespan (then the
    fewest phases); with windows across ranks also level 1 at B (fewer microbatches: shorter
    chains of windows across ranks), and each importer's received exports in its live bytes and
    their transfer in its cost. Returns (level 1, edge rows, level 2, schedule) for `assemble`.

    Raises:
        PlanningError: with windows across ranks, when no order finishes (ranks waiting for each
            other), or a budget level 2 cannot meet.
    """
    W, C, B = cfg.world_size, cfg.chunk_size, cfg.microbatch_tokens
    first = cut_and_pack(k, cfg, rf)
    candidates = [first]
    if cfg.windows and W > 1:
        n0 = int(np.bincount(first.mb_home, minlength=W).max())

        def counts(caps: np.ndarray) -> np.ndarray:
            return np.bincount(cut_and_pack(k, cfg, rf, caps).mb_home, minlength=W)

        candidates = [cut_and_pack(k, cfg, rf, lockstep.equal_count_caps(counts, W, B, C, n0 + extra))
                      for extra in LOCKSTEP_EXTRA_MICROBATCHES]
        if rf.crossing:
            candidates.append(first)
    best = None
    for l1 in candidates:
        e = edge_rows(k, cfg, rf, l1)
        l2 = choose_edge_modes(k, cfg, rf, l1, e, minimal_recompute=True)
        wparent = np.where((l1.mb_parent >= 0) & l2.shared, l1.mb_parent, -1)
        full = cfg.sizes.full_bytes(l2.rows)
        win = np.where(l2.recompute, l2.exports, cfg.sizes.kept_bytes(l2.rows))
        cost = l2.rows.astype(np.float64) * cfg.cost_model.row
        if rf.crossing:  # an importer across ranks holds what it receives, and both ranks pay for moving it
            full, win, exports = full + l2.imp, win + l2.imp, l2.exports + l2.imp
            cost = cost + 2.0 * float(cfg.cost_model.transfer_byte) * l2.imp
        else:
            exports = l2.exports
        sub = np.asarray(k.subtree_costs(l1.mb_parent, l2.shared, cost))  # open the costliest window subtree first
        for power, rec_open, small_fill in itertools.product(lockstep.WEIGHT_POWERS, (False, True), (False, True)):
            sch = lockstep.schedule(k.align_phases, l2.mb_rank, wparent, cost, sub, l2.recompute, full, win, exports,
                                    cfg.memory_bytes, W, power, rec_open, small_fill)
            if sch is None:  # stalled: importers and exporters across ranks waiting for each other
                continue
            key = (sch.makespan, sch.phases.shape[0])
            if best is None or key < best[0]:
                best = (key, l1, e, l2, sch)
    if best is None:
        raise PlanningError("cross_rank_windows: no lock-step order of this placement finishes (ranks wait for each "
                            "other's windows across ranks); plan with cross_rank_windows off")
    _, l1, e, l2, sch = best
    l2.recompute |= sch.voluntary
    log.debug("lock-step: %d microbatches, %d phases, estimated lock-step makespan %.0f", l1.num_microbatches,
              sch.phases.shape[0], sch.makespan)
    return l1, e, l2, sch


def _check_paths_fit(forest: Forest, budget: int) -> None:
    lengths = forest.traj_length()
    if lengths.size and int(lengths.max()) > budget:
        t = int(np.argmax(lengths))
        raise PlanningError(
            f"microbatch_tokens: trajectory {forest.traj_ids[t]!r} has {int(lengths[t])} tokens, expected <= "
            f"{budget} without sharing windows (a duplicated edge recomputes the whole root path in one "
            f"microbatch); raise microbatch_tokens to >= {int(lengths[t])} or enable windows"
        )

