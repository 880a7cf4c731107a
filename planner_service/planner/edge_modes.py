"""Level 2 of the partitioner: each cross-microbatch edge's mode, the ranks without windows, the live stack.

    e = edge_rows(k, cfg, rf, l1)                # EdgeRows: every microbatch's rows under both edge modes
    l2 = choose_edge_modes(k, cfg, rf, l1, e)    # Level2: share or duplicate, ranks, recomputation, live bytes

Memory is kept within M by `memory_fit.fit_memory` (docs/design/planner.md, level 2).
Legend: n units of all rank forests, K pieces, M microbatches, W ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner_service.planner.config import PlanConfig
from planner_service.planner.memory_fit import WindowExports, fit_memory
from planner_service.planner.pieces import Level1
from planner_service.planner.rank_forests import RankForests

#: A shared edge whose duplicated context is shorter than this fraction of the child's kept rows
#: (or shorter than one chunk) is duplicated instead: a window costs exports and a stack slot.
SHORT_PREFIX_FRACTION = 0.05


@dataclass(slots=True)
class EdgeRows:
    """Rows of every microbatch under both modes of its edge to the parent (M microbatches)."""

    roots_off: np.ndarray
    """int64 [M+1] microbatch m's piece-root units are roots[roots_off[m]:roots_off[m+1]]."""
    roots: np.ndarray
    """int64 [K] piece-root units grouped by microbatch."""
    kept: np.ndarray
    """int64 [M] kept tokens."""
    own_dup: np.ndarray
    """int64 [M] rows duplicated by placement."""
    ctx: np.ndarray
    """int64 [M] duplicated context of a duplicated edge."""
    rows_shared: np.ndarray
    """int64 [M] computed rows with a shared edge (or none)."""
    rows_dup: np.ndarray
    """int64 [M] computed rows with a duplicated edge."""
    tails: np.ndarray
    """int64 [M] replay rows its piece roots import (shared edge)."""
    anchored: np.ndarray
    """int64 [M] its pieces that hang below another microbatch."""


def edge_rows(k, cfg: PlanConfig, rf: RankForests, l1: Level1) -> EdgeRows:
    """Per-microbatch sizes under both edge modes (level2.context_cost)."""
    M, piece_mb = l1.num_microbatches, l1.piece_mb
    roots = l1.pieces[np.argsort(piece_mb, kind="stable")].astype(np.int64)
    roots_off = np.r_[0, np.cumsum(np.bincount(piece_mb, minlength=M))].astype(np.int64)
    internal = np.bincount(piece_mb, weights=l1.resid[l1.pieces], minlength=M).astype(np.int64)
    tails = np.bincount(piece_mb, weights=l1.tail, minlength=M).astype(np.int64)
    kept = np.bincount(l1.unit_mb, weights=np.where(rf.dup, 0, rf.unit_len), minlength=M).astype(np.int64)
    own_dup = np.bincount(l1.unit_mb, weights=np.where(rf.dup, rf.unit_len, 0), minlength=M).astype(np.int64)
    ctx, ctx_replay = k.context_cost(roots_off, roots, rf.unit_parent, rf.unit_len, rf.unit_depth, cfg.chunk_size, cfg.replay)
    anchored = np.bincount(piece_mb, weights=rf.unit_parent[l1.pieces] >= 0, minlength=M).astype(np.int64)
    return EdgeRows(roots_off=roots_off, roots=roots, kept=kept, own_dup=own_dup, ctx=ctx,
                    rows_shared=internal + tails, rows_dup=internal + ctx + ctx_replay, tails=tails, anchored=anchored)


@dataclass(slots=True)
class Level2:
    """Edge modes, ranks, recomputation and live bytes of the microbatches (M microbatches)."""

    shared: np.ndarray
    """bool [M] the edge to the parent is a sharing window."""
    mb_rank: np.ndarray
    """int64 [M] rank running each microbatch."""
    recompute: np.ndarray
    """bool [M] activation recomputation of a window parent."""
    rows: np.ndarray
    """int64 [M] computed rows under the chosen edge modes."""
    live: np.ndarray
    """int64 [M] live bytes while each microbatch runs."""
    exports: np.ndarray
    """int64 [M] bytes each microbatch keeps as a recomputed open window."""
    load: np.ndarray
    """float64 [W] estimated cost per rank."""
    imp: np.ndarray
    """int64 [M] bytes of the exports a microbatch whose window crosses ranks receives and holds
    while it is open (an upper bound of its CrossEdge.bytes; 0 for the others)."""


def choose_edge_modes(k, cfg: PlanConfig, rf: RankForests, l1: Level1, e: EdgeRows, *,
                      minimal_recompute: bool = False) -> Level2:
    """Edge modes (share, or duplicate a short prefix), ranks without windows (LPT over computed
    rows), and the live window stacks within M (`memory_fit.fit_memory`; `minimal_recompute`: lock-step)."""
    W, C, B = cfg.world_size, cfg.chunk_size, cfg.microbatch_tokens
    M, mb_parent = l1.num_microbatches, l1.mb_parent
    has_parent = mb_parent >= 0
    can_dup = has_parent & (e.rows_dup <= B)
    if cfg.windows:
        short = (e.ctx < C) | (e.ctx < SHORT_PREFIX_FRACTION * e.kept)
        shared = has_parent & ~(short & can_dup)
    else:
        shared = np.zeros(M, np.bool_)

    def rows_now() -> np.ndarray:
        return np.where(shared | ~has_parent, e.rows_shared, e.rows_dup)

    if cfg.windows:
        mb_rank = l1.mb_home
    else:  # every microbatch independent: longest processing time first over computed rows
        mb_rank = _lpt(k, W, np.arange(M, dtype=np.int64), rows_now())[0]
    crossing = has_parent & (mb_rank[np.maximum(mb_parent, 0)] != mb_rank)  # only with rf.crossing
    received = cfg.sizes.export_bytes(e.ctx, np.minimum(e.ctx, (cfg.conv_kernel - 1) * e.anchored), e.tails, e.anchored)

    def imp_now() -> np.ndarray:
        return np.where(shared & crossing, received, 0).astype(np.int64)

    recompute = np.zeros(M, np.bool_)
    est = WindowExports(k, cfg, e.roots_off, e.roots, rf.unit_parent, rf.unit_len, rf.unit_depth, l1.unit_mb, mb_parent)
    live = fit_memory(k, cfg, est, mb_parent, shared, recompute, can_dup, rows_now, minimal=minimal_recompute,
                      crossing=crossing, imp_now=imp_now)
    rows = rows_now()
    load = rf.load if rf.load is not None else np.bincount(mb_rank, weights=rows, minlength=W).astype(np.float64)
    return Level2(shared=shared, mb_rank=mb_rank, recompute=recompute, rows=rows, live=live,
                  exports=est.bytes(shared, rows)[1], load=load, imp=imp_now())


def _lpt(k, W: int, group: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    M = group.shape[0]
    gcost = np.bincount(group, weights=rows, minlength=M)
    gids = np.unique(group)
    order = gids[np.lexsort((gids, -gcost[gids]))]
    grank, load = k.lpt_place(gcost[order].astype(np.float64), W)
    rank_of_group = np.zeros(M, np.int64)
    rank_of_group[order] = grank
    return rank_of_group[group], load

