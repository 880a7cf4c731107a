"""Every rank's forest of units: the units a rank keeps plus their duplicated ancestors.

    rf = rank_forests(k, forest, cfg)                      # placement (placement_search), windows on their rank
    rf = crossing_forests(k, forest, cfg, units, uc, ...)  # a tree's shared prefix imported across ranks

`k` is the partitioner's kernel namespace (`partition._KERNELS`); docs/design/planner.md, "Placement",
and docs/design/cross-rank.md. Legend: U units of the forest,
n units of all rank forests, W ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.placement_search import UnitCosts, place_units, unit_costs


@dataclass(slots=True)
class RankForests:
    """Every rank's forest of units (`placement.rank_closure`): the units it keeps plus their
    duplicated ancestors, grouped by rank (n units of all rank forests)."""

    unit_seg: np.ndarray
    """int32 [n] forest segment of each unit."""
    unit_off: np.ndarray
    """int32 [n] its offset inside the segment."""
    unit_len: np.ndarray
    """int32 [n] its tokens."""
    unit_depth: np.ndarray
    """int64 [n] depth of its first token."""
    unit_parent: np.ndarray
    """int64 [n] parent unit in the same rank forest, -1 at a root."""
    unit_rank: np.ndarray
    """int64 [n] rank of the forest."""
    dup: np.ndarray
    """bool [n] an ancestor kept by another rank (duplicated here)."""
    load: np.ndarray | None
    """float64 [W] placement's cost per rank (closure costs); None without placement."""
    lower_bound: float
    """Placement's makespan lower bound (0 without placement and W > 1)."""
    crossing: bool = False
    """Windows across ranks (`crossing_forests`): unit_parent may lie in another rank's forest
    (a piece boundary whose window crosses ranks); the arrays are then not in one preorder."""


def rank_forests(k, forest: Forest, cfg: PlanConfig) -> RankForests:
    """Units (level1.build_units) and, with windows and W > 1, their placement on ranks."""
    W, C = cfg.world_size, cfg.chunk_size
    g_seg, g_off, g_len, g_depth, g_parent = k.build_units(forest.seg_parent, forest.seg_length, forest.seg_depth, C)
    U = g_parent.shape[0]
    if not cfg.windows or W == 1:
        # one forest: every unit kept where it is, nothing duplicated by placement
        lower_bound = 0.0
        if W == 1 and cfg.windows:
            lower_bound = float(unit_costs(k, forest, cfg, g_seg, g_off, g_len, g_depth, g_parent).w.sum())
        return RankForests(unit_seg=g_seg, unit_off=g_off, unit_len=g_len, unit_depth=g_depth,
                           unit_parent=g_parent.astype(np.int64), unit_rank=np.zeros(U, np.int64),
                           dup=np.zeros(U, np.bool_), load=None, lower_bound=lower_bound)
    uc = unit_costs(k, forest, cfg, g_seg, g_off, g_len, g_depth, g_parent)
    unit_rank, lower_bound = place_units(k, cfg, g_parent, uc)
    ru_unit, ru_rank, ru_dup, ru_parent = k.rank_closure(g_parent, unit_rank, W)
    load = np.asarray(k.closure_costs(ru_unit, ru_rank, ru_dup, ru_parent, uc.w, uc.w_dup, uc.rc, W)[0])
    return RankForests(unit_seg=g_seg[ru_unit], unit_off=g_off[ru_unit], unit_len=g_len[ru_unit],
                       unit_depth=g_depth[ru_unit], unit_parent=ru_parent, unit_rank=ru_rank, dup=ru_dup, load=load,
                       lower_bound=lower_bound)


def crossing_forests(k, forest: Forest, cfg: PlanConfig, units, uc: UnitCosts, placements: dict, prefix_depth: int,
                     free_prefix: bool) -> RankForests:
    """Rank forests whose shared prefix crosses ranks (`partition.crossing_partitions`): the placement of
    `placement_search.place_units` (with `free_prefix`, duplicating a unit above prefix_depth
    costs nothing there: it will be imported; prefix_depth < 0: the end of each tree's root
    segment), then every unit above prefix_depth that another rank needs (the shared prefix)
    moves to the rank keeping its tree's root, and the other ranks drop their duplicated copies
    of it: what hangs below imports it across ranks (a unit parent on another rank). Deeper
    shared units stay duplicated as before. `units` (level1.build_units) and their costs `uc` are
    the forest's; `placements` keeps the placement without a free prefix across calls."""
    W = cfg.world_size
    g_seg, g_off, g_len, g_depth, g_parent = units
    U = g_parent.shape[0]
    lower_bound = max(float(uc.w.sum()) / W, float((uc.ctx + uc.w).max()))
    top = np.asarray(k.piece_roots(g_parent, np.zeros(U, np.bool_)))  # the tree root of every unit
    if prefix_depth < 0:  # each tree's root segment: what all its trajectories share
        above = g_depth < forest.seg_length[g_seg[top]]
    else:
        above = g_depth < prefix_depth
    if free_prefix:
        w_dup = np.where(above, 0.0, uc.w_dup)
        placed = UnitCosts(w=uc.w, w_dup=w_dup, rc=uc.rc, ctx=np.asarray(k.context_costs(g_parent, w_dup)))
        unit_rank, _ = place_units(k, cfg, g_parent, placed)
    else:
        if "plain" not in placements:
            placements["plain"] = place_units(k, cfg, g_parent, uc)[0]
        unit_rank = placements["plain"]
    ru_unit, _, ru_dup, _ = k.rank_closure(g_parent, unit_rank, W)
    prefix = np.zeros(U, np.bool_)
    prefix[ru_unit[ru_dup]] = True  # some other rank needs it
    prefix &= above
    unit_rank = np.where(prefix, unit_rank[top], unit_rank)
    ru_unit, ru_rank, ru_dup, ru_parent = k.rank_closure(g_parent, unit_rank, W)
    load = np.asarray(k.closure_costs(ru_unit, ru_rank, ru_dup, ru_parent, uc.w, uc.w_dup, uc.rc, W)[0])
    keep = ~ru_dup | ~prefix[ru_unit]  # a duplicated copy of the prefix is imported instead
    kept_at = np.full(U, -1, np.int64)
    kept_at[ru_unit[~ru_dup]] = np.flatnonzero(~ru_dup)
    par = ru_parent.copy()
    lost = (par >= 0) & ~keep[np.maximum(par, 0)]
    par[lost] = kept_at[ru_unit[par[lost]]]  # the kept copy of the parent unit, on its keeper's rank
    new_index = np.cumsum(keep) - 1
    par = np.where(par >= 0, new_index[np.maximum(par, 0)], -1)[keep]
    sel = ru_unit[keep]
    return RankForests(unit_seg=g_seg[sel], unit_off=g_off[sel], unit_len=g_len[sel], unit_depth=g_depth[sel],
                       unit_parent=par, unit_rank=ru_rank[keep], dup=ru_dup[keep], load=load, lower_bound=lower_bound,
                       crossing=True)


def exported_prefix(unit_parent: np.ndarray, across: np.ndarray) -> np.ndarray:
    """bool [n] units on the root path above a window across ranks (their rows travel)."""
    out = np.zeros(unit_parent.shape[0], np.bool_)
    for u in np.flatnonzero(across).tolist():
        a = int(unit_parent[u])
        while a >= 0 and not out[a]:
            out[a] = True
            a = int(unit_parent[a])
    return out

