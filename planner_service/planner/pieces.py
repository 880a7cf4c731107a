"""Level 1 of the partitioner: cut every rank forest into pieces that fit B and pack them into microbatches.

    l1 = cut_and_pack(k, cfg, rf)          # Level1: pieces (Kundu-Misra), microbatches (first fit decreasing)
    l1 = cut_and_pack(k, cfg, rf, caps)    # lock-step plans: a smaller capacity per rank forest

`k` is the partitioner's kernel namespace (`level1.py`'s kernels or their twins in
`partition_ref.py`; docs/design/planner.md, level 1).
Legend: n units of all rank forests, K pieces, M microbatches, W ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner_service.errors import PlanningError
from planner_service.planner.config import PlanConfig
from planner_service.planner.rank_forests import RankForests, exported_prefix


@dataclass(slots=True)
class Level1:
    """Pieces and microbatches of the rank forests (K pieces, M microbatches)."""

    resid: np.ndarray
    """int64 [n] rows of each unit's part of its piece (level1.cut_pieces)."""
    pieces: np.ndarray
    """int64 [K] root unit of every piece, increasing."""
    tail: np.ndarray
    """int64 [K] replay rows a piece root imports (0 at a forest root or without replay)."""
    piece_mb: np.ndarray
    """int64 [K] microbatch of each piece."""
    unit_mb: np.ndarray
    """int64 [n] microbatch of each unit."""
    mb_parent: np.ndarray
    """int64 [M] microbatch the pieces of each one hang below, -1 for forest-root pieces."""
    mb_home: np.ndarray
    """int64 [M] rank forest of each microbatch."""

    @property
    def num_microbatches(self) -> int:
        return int(self.mb_parent.shape[0])


def cut_and_pack(k, cfg: PlanConfig, rf: RankForests, caps: np.ndarray | None = None) -> Level1:
    """Cut every rank forest into the fewest pieces that fit B (Kundu-Misra) and pack them into
    microbatches level by level (`_pack`).

    Args:
        caps: int64 [W] a smaller piece and microbatch capacity per rank forest (lock-step plans,
            `partition._lockstep`); None: B everywhere.
    """
    W, C, B = cfg.world_size, cfg.chunk_size, cfg.microbatch_tokens
    dup_only = not cfg.windows
    unit_parent, unit_depth = rf.unit_parent, rf.unit_depth
    budget = np.full(unit_parent.shape[0], B, np.int64) if caps is None else caps[rf.unit_rank]
    has_up = unit_parent >= 0
    force = rf.dup & has_up & ~rf.dup[np.maximum(unit_parent, 0)]
    prefix = None
    if rf.crossing:  # a piece never spans two ranks, nor the shared prefix and what hangs below it
        up = np.maximum(unit_parent, 0)
        across = has_up & (rf.unit_rank[up] != rf.unit_rank)
        prefix = exported_prefix(unit_parent, across)
        force |= across | (has_up & prefix[up] & ~prefix)
    cut, resid, bad = k.cut_pieces(unit_parent, rf.unit_len, unit_depth, C, budget, dup_only, cfg.replay, force)
    if bad >= 0:  # only reachable without windows, and partition._check_paths_fit rules it out
        raise PlanningError(f"microbatch_tokens: unit {bad} cannot fit {B} rows; raise microbatch_tokens")
    root = k.piece_roots(unit_parent, cut)
    pieces = np.flatnonzero(root == np.arange(unit_parent.shape[0]))
    anchor = unit_parent[pieces]
    has_anchor = anchor >= 0
    pdepth = unit_depth[pieces]
    tail = np.where(has_anchor, pdepth % C if cfg.replay else np.zeros_like(pdepth), 0)
    size = resid[pieces] + tail
    piece_cap = budget[pieces]
    cap_of = np.where(has_anchor, piece_cap - pdepth + tail, piece_cap) if dup_only else piece_cap
    assert (size <= cap_of).all(), "a piece larger than its bin: cut_pieces broke its contract"
    ppar = np.where(has_anchor, np.searchsorted(pieces, root[np.maximum(anchor, 0)]), -1)
    root_key = rf.unit_rank[pieces]
    piece_mb, M, n_root, root_items = _pack(k, size, cap_of, ppar, anchor, dup_only, piece_cap, root_key,
                                            balance_cap=B if caps is not None else 0,
                                            rank=root_key if rf.crossing else None, world_size=W,
                                            prefix=prefix[pieces] if rf.crossing else None)
    if dup_only and W > 1 and M % W:
        root_cap = _balanced_root_cap(k, *root_items, n_root, M, W, B)
        piece_mb, M, _, _ = _pack(k, size, cap_of, ppar, anchor, dup_only, np.full(pieces.shape[0], root_cap), root_key)
    unit_mb = piece_mb[np.searchsorted(pieces, root)]
    mb_parent = np.full(M, -1, np.int64)
    anchored = np.flatnonzero(has_anchor)
    mb_parent[piece_mb[anchored]] = unit_mb[anchor[anchored]]
    assert (mb_parent < np.arange(M)).all()
    mb_home = np.zeros(M, np.int64)
    mb_home[unit_mb] = rf.unit_rank  # the rank forest of every microbatch
    return Level1(resid=resid, pieces=pieces, tail=tail, piece_mb=piece_mb, unit_mb=unit_mb, mb_parent=mb_parent,
                  mb_home=mb_home)


def _pack(k, size, cap_of, ppar, anchor, dup_only: bool, root_cap: np.ndarray, root_key: np.ndarray, *,
          balance_cap: int = 0, rank: np.ndarray | None = None, world_size: int = 1, prefix: np.ndarray | None = None):
    """Microbatch of every piece: first fit decreasing, level by level down the piece forest.

    Root pieces with the same `root_key` (the rank forest they belong to) are packed together
    (bins of their `root_cap`, int64 [K], equal within a rank forest). The pieces hanging below
    one microbatch's pieces are packed together (without windows: below one anchor unit, so that
    they share one duplicated context); with windows across ranks (`rank`: int64 [K] the rank of
    every piece) those of each rank apart. Parents get smaller ids. With `balance_cap` > 0
    (lock-step plans) every group's pieces are then spread over its bins longest first onto the
    least loaded (`level1.balance_bins`, within that cap).

    Returns:
        piece_mb int64 [K], number of microbatches, number of root microbatches, and the root
        items in packing order (sizes int64, opens bool) for `_balanced_root_cap`.
    """
    K = size.shape[0]
    level = np.zeros(K, np.int64)
    child = np.flatnonzero(ppar >= 0)
    while True:  # one pass per level of the piece forest
        deeper = level[ppar[child]] + 1
        if (deeper == level[child]).all():
            break
        level[child] = deeper
    piece_mb = np.full(K, -1, np.int64)
    M = n_root = 0
    root_items = (np.zeros(0, np.int64), np.zeros(0, np.bool_))
    for L in range(int(level.max()) + 1 if K else 0):
        idx = np.flatnonzero(level == L)
        opens = np.zeros(idx.shape[0], np.bool_)
        if L == 0:
            key = np.asarray(root_key, np.int64)[idx]
        elif dup_only:
            key = anchor[idx]
        elif rank is not None:
            key = piece_mb[ppar[idx]] * world_size + rank[idx]
        else:
            key = piece_mb[ppar[idx]]
        if prefix is not None:
            key = 2 * key + prefix[idx]
        sort = np.lexsort((idx, -size[idx], ~opens, key))
        order = idx[sort]
        skey = key[sort]
        starts = np.flatnonzero(np.r_[True, skey[1:] != skey[:-1]])
        group_off = np.r_[starts, order.shape[0]].astype(np.int64)
        caps = (root_cap if L == 0 else cap_of)[order][starts].astype(np.int64)
        sizes = size[order].astype(np.int64)
        bins, nb = k.first_fit_decreasing(sizes, group_off, caps, opens[sort])
        if balance_cap:
            bins = k.balance_bins(sizes, group_off, bins, balance_cap)
        piece_mb[order] = M + bins
        M += int(nb)
        if L == 0:
            n_root = int(nb)
            root_items = (sizes, opens[sort])
    return piece_mb, M, n_root, root_items


def _balanced_root_cap(k, sizes: np.ndarray, opens: np.ndarray, n_root: int, M: int, W: int, budget: int) -> int:
    """Bin capacity (<= B) for the forest-root pieces so that the microbatch count becomes a
    multiple of W: bins of about equal size that LPT can spread evenly, instead of full bins plus
    a remainder that one rank carries alone."""
    target = min(n_root + (-M) % W, sizes.shape[0])
    one_group = np.array([0, sizes.shape[0]], np.int64)

    def bins(cap: int) -> int:
        return int(k.first_fit_decreasing(sizes, one_group, np.array([cap], np.int64), opens)[1])

    # smallest capacity whose packing needs <= target bins (binary search: FFD's bin count is
    # non-increasing in the capacity up to rare anomalies, which only cost a slightly larger cap)
    lo = max(int(sizes.max()), -(-int(sizes.sum()) // target))
    hi = budget
    if lo >= hi or bins(lo) <= target:
        return min(lo, budget)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if bins(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi

