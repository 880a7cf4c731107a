"""The placement search of the partitioner: which rank keeps each unit (docs/design/planner.md, "Placement").

    uc = unit_costs(k, forest, cfg, *units)            # cost-model costs per unit
    unit_rank, lower_bound = place_units(k, cfg, unit_parent, uc)

`k` is the partitioner's kernel namespace (`partition._KERNELS`: the Numba kernels of
`placement.py`, or their plain-Python twins of `placement_ref.py`).
Legend: U units, W ranks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig

log = logging.getLogger(__name__)

#: Part capacities `place_units` tries: a geometric grid of this ratio from the lower bound up to
#: the largest tree (at most PLACEMENT_CAPACITIES of them).
CAPACITY_STEP = 1.06
PLACEMENT_CAPACITIES = 64
#: Largest ranks x units for which LPT tracks every rank's held prefixes (bytes of a bool matrix);
#: above it parts are placed by their standalone costs.
HELD_MATRIX_LIMIT = 64 * 1024 * 1024
#: Placements of the grid that are refined (the best ones by makespan, plus the uncut one).
REFINED_PLACEMENTS = 3
#: Subtree moves of the refinement, per rank, and candidates scored exactly per move.
REFINE_ROUNDS_PER_RANK = 4
#: ... and at most this many moves in all (large worlds)
REFINE_MAX_ROUNDS = 512
REFINE_CANDIDATES = 8


@dataclass(slots=True, kw_only=True)
class UnitCosts:
    """Cost-model costs of the units (placement.py)."""

    w: np.ndarray
    """float64 [U] cost of a kept unit (rows, attended pairs, log-prob rows)."""
    w_dup: np.ndarray
    """float64 [U] cost of a duplicated unit (no log-prob rows)."""
    rc: np.ndarray
    """float64 [U] replay cost of every extra kept child at the unit's end."""
    ctx: np.ndarray
    """float64 [U] cost of the root path strictly above the unit."""


def unit_costs(k, forest: Forest, cfg: PlanConfig, unit_seg, unit_off, unit_len, unit_depth, unit_parent) -> UnitCosts:
    """Cost-model costs of every unit: kept, duplicated, the replay at its end, its prefix."""
    cm, C = cfg.cost_model, cfg.chunk_size
    L = unit_len.astype(np.float64)
    d = unit_depth.astype(np.float64)
    w_dup = cm.row * L + cm.attention * (L * d + L * (L + 1) / 2)
    w = w_dup
    if cm.logprob_row > 0:
        flags = k.lp_row_flags(forest.traj_offset, forest.traj_seg, forest.seg_parent, forest.seg_offset,
                               forest.seg_depth, forest.seg_length, forest.loss_mask, cfg.all_positions,
                               forest.unique_tokens)
        csum = np.r_[0, np.cumsum(flags, dtype=np.int64)]
        start = forest.seg_offset[unit_seg] + unit_off
        w = w_dup + cm.logprob_row * (csum[start + unit_len] - csum[start]).astype(np.float64)
    end = d + L
    br = end % C if cfg.replay else np.zeros_like(end)
    rc = cm.row * br + cm.attention * (br * (end - br) + br * (br + 1) / 2)
    return UnitCosts(w=w, w_dup=w_dup, rc=rc, ctx=np.asarray(k.context_costs(unit_parent, w_dup)))


def place_units(k, cfg: PlanConfig, unit_parent: np.ndarray, uc: UnitCosts) -> tuple[np.ndarray, float]:
    """Rank keeping every unit (docs/design/planner.md, "Placement").

    1. For every part capacity of a geometric grid from the makespan's lower bound to the
       costliest tree, `cut_parts` cuts the forest and LPT places the parts, twice: soonest end
       first, and packing each part onto the rank that holds most of its prefix among those where
       it ends within the target (`lpt_parts`).
    2. The few placements with the smallest makespan, and the one that cuts nothing, are refined
       by moving subtrees from the busiest rank to the idlest (`placement.refine`) until the
       makespan is within cfg.makespan_slack of the lower bound or no move lowers it.
    3. Of all placements whose makespan is within cfg.makespan_slack of the lower bound (or within
       1% of the best one, if that is higher), the one that duplicates least wins.

    Returns:
        unit_rank int64 [U], the lower bound max(total cost / W, costliest root path).
    """
    W = cfg.world_size
    U = unit_parent.shape[0]
    total = float(uc.w.sum())
    path = float((uc.ctx + uc.w).max()) if U else 0.0
    lower = max(total / W, path)
    sub = k.subtree_sums(unit_parent, uc.w)  # the costliest tree bounds the useful capacities
    biggest = float(sub[unit_parent < 0].max()) if U else 0.0
    caps = [lower]
    while caps[-1] < biggest and len(caps) < PLACEMENT_CAPACITIES:
        caps.append(caps[-1] * CAPACITY_STEP)
    caps[-1] = max(caps[-1], biggest)

    def evaluate(unit_rank) -> tuple[float, float]:
        cost, dup = k.placement_costs(unit_parent, unit_rank, uc.w, uc.w_dup, uc.rc, W)
        return float(np.max(cost)), float(np.sum(dup))

    target = lower * cfg.makespan_slack
    results = []  # (makespan, duplicated cost, capacity, refined, unit_rank)
    for cap in caps:
        cut, resid, bad = k.cut_parts(unit_parent, uc.w, uc.ctx, uc.rc, cap * (1 + 1e-12))
        if bad >= 0:
            continue
        part = k.piece_roots(unit_parent, cut)
        roots = np.flatnonzero(part == np.arange(U))
        pcost = resid[roots] + uc.ctx[roots]
        seq = np.lexsort((roots, -pcost))
        prank = np.empty(roots.shape[0], np.int64)
        if W * U <= HELD_MATRIX_LIMIT:  # parts of a tree share prefixes on a rank
            for fit in (-1.0, target):  # plain LPT, then packing parts under the makespan target
                prank[seq] = k.lpt_parts(unit_parent, part, roots[seq], resid[roots[seq]], uc.w_dup, uc.ctx, W, fit)[0]
                unit_rank = prank[np.searchsorted(roots, part)]
                results.append((*evaluate(unit_rank), cap, False, unit_rank))
        else:
            prank[seq] = k.lpt_place(pcost[seq].astype(np.float64), W)[0]
            unit_rank = prank[np.searchsorted(roots, part)]
            results.append((*evaluate(unit_rank), cap, False, unit_rank))
    if not results:  # cannot happen: the smallest capacity fits every root path
        raise AssertionError("placement: no part capacity fits the costliest root path")
    by_makespan = sorted(range(len(results)), key=lambda i: (results[i][0], results[i][1], i))
    for i in sorted(set(by_makespan[:REFINED_PLACEMENTS]) | {len(results) - 1}):
        makespan, _, cap, _, unit_rank = results[i]
        if makespan <= target:
            continue
        unit_rank = unit_rank.copy()
        k.refine(unit_parent, unit_rank, uc.w, uc.w_dup, uc.rc, W, min(REFINE_ROUNDS_PER_RANK * W, REFINE_MAX_ROUNDS), REFINE_CANDIDATES, target)
        results.append((*evaluate(unit_rank), cap, True, unit_rank))
    best = min(r[0] for r in results)
    ok = max(best * 1.01, target)
    makespan, dup, cap, refined, unit_rank = min(
        (r for r in results if r[0] <= ok), key=lambda r: (r[1], r[0], r[2], r[3]))
    log.debug("placement: capacity %.0f of %d%s, makespan %.0f (best %.0f), lower bound %.0f, duplicated %.0f",
              cap, len(caps), " refined" if refined else "", makespan, best, lower, dup)
    return np.asarray(unit_rank, np.int64), lower
