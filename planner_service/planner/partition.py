"""The two-level partitioner: forest -> microbatches, edge modes, placement, order (DESIGN §4.1-4.2).

`partition(forest, cfg) -> Partition` is what `build_plan` consumes (see `spec.py`):

1. Level 1 (`level1.py`): cut the forest into units at chunk-aligned depths, cut it into the fewest
   connected pieces that fit B (Kundu-Misra), and pack pieces into microbatches, first fit
   decreasing, level by level down the piece forest: forest-root pieces together, then the pieces
   hanging below one microbatch together (so microbatches form a forest). A piece's size counts
   every row the builder will compute for it: kept tokens, bounded replay at its unaligned branches,
   and the replay rows (window) or the duplicated root path (no windows) its root needs. With
   W > 1 the root bins are re-packed to a multiple of W bins of about equal size.
2. Level 2 (`level2.py`): choose each cross-microbatch edge's mode (share through a window, or
   duplicate a short prefix), split window groups that are too heavy for one rank by duplicating an
   edge, place window groups on ranks (LPT over computed rows), keep every rank's live window stack
   under M (activation recomputation first, then duplication), and order each rank depth-first.

Every kernel has a plain-Python twin in `partition_ref.py`; `impl="ref"` runs the whole partitioner
on them (tests compare both; the benchmark times both).

`expand_forest` builds the trajectory-expanded baseline's forest (cfg.sharing False).

Legend: S segments, U units, K pieces, M microbatches, G window groups, W ranks, T trajectories.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from numba import njit

from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner import level1, level2, partition_ref
from planner_service.planner.config import PlanConfig
from planner_service.planner.spec import MicrobatchSpec, Partition

log = logging.getLogger(__name__)

_KERNELS = {
    "numba": SimpleNamespace(
        build_units=level1.build_units,
        cut_pieces=level1.cut_pieces,
        piece_roots=level1.piece_roots,
        first_fit_decreasing=level1.first_fit_decreasing,
        context_cost=level2.context_cost,
        export_rows=level2.export_rows,
        window_groups=level2.window_groups,
        subtree_costs=level2.subtree_costs,
        lpt_place=level2.lpt_place,
        live_stack=level2.live_stack,
        dfs_order=level2.dfs_order,
    ),
    "ref": partition_ref,
}

#: A shared edge whose duplicated context is shorter than this fraction of the child's kept rows
#: (or shorter than one chunk) is duplicated instead: a window costs exports and a stack slot.
SHORT_PREFIX_FRACTION = 0.05
#: Imbalance (max / mean rank cost) below which placement stops splitting window groups.
IMBALANCE_TARGET = 1.05
#: Duplicated-edge candidates placement tries per balancing round.
SPLIT_CANDIDATES = 8


@dataclass(slots=True, kw_only=True)
class PartitionReport:
    """The partitioner's own estimates (the builder's PlanStats are authoritative)."""

    rows: np.ndarray
    """int64 [M] computed rows per microbatch (kept + replay + duplicated)."""
    kept: np.ndarray
    """int64 [M] kept tokens per microbatch."""
    duplicated: np.ndarray
    """int64 [M] duplicated context rows (0 for shared or root microbatches)."""
    rank_load: np.ndarray
    """float64 [W] computed rows per rank."""
    live: np.ndarray
    """int64 [M] live stack while each microbatch runs (its rows plus open windows' live costs)."""
    pieces: int
    """Number of connected pieces level 1 cut the forest into."""

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_load.mean()) if self.rank_load.size else 0.0
        return float(self.rank_load.max()) / mean if mean > 0 else 1.0

    @property
    def peak_live(self) -> int:
        return int(self.live.max()) if self.live.size else 0


def partition(forest: Forest, cfg: PlanConfig, *, impl: str = "numba") -> Partition:
    """Microbatches, edge modes, placement and execution order of one step (see module docstring).

    Raises:
        PlanningError: settings that cannot be satisfied (a trajectory longer than B without
            windows, a window stack that cannot fit M).
    """
    return partition_with_report(forest, cfg, impl=impl)[0]


def partition_with_report(forest: Forest, cfg: PlanConfig, *, impl: str = "numba") -> tuple[Partition, PartitionReport]:
    """`partition` plus the partitioner's estimates."""
    if impl not in _KERNELS:
        raise ValueError(f"impl: expected one of {sorted(_KERNELS)}, got {impl!r}")
    k = _KERNELS[impl]
    W, C, B = cfg.world_size, cfg.chunk_size, cfg.microbatch_tokens
    if forest.num_segments == 0:
        empty = PartitionReport(
            rows=np.zeros(0, np.int64), kept=np.zeros(0, np.int64), duplicated=np.zeros(0, np.int64),
            rank_load=np.zeros(W), live=np.zeros(0, np.int64), pieces=0,
        )
        return Partition(microbatches=[], rank_steps=[[] for _ in range(W)]), empty
    dup_only = not cfg.windows
    if dup_only:
        _check_paths_fit(forest, B)

    # Level 1: units, pieces, microbatches.
    unit_seg, unit_off, unit_len, unit_depth, unit_parent = k.build_units(
        forest.seg_parent, forest.seg_length, forest.seg_depth, C
    )
    cut, resid, bad = k.cut_pieces(unit_parent, unit_len, unit_depth, C, B, dup_only, cfg.replay)
    if bad >= 0:  # only reachable without windows, and _check_paths_fit rules it out
        raise PlanningError(f"microbatch_tokens: unit {bad} cannot fit {B} rows; raise microbatch_tokens")
    root = k.piece_roots(unit_parent, cut)
    U = unit_parent.shape[0]
    pieces = np.flatnonzero(root == np.arange(U))
    anchor = unit_parent[pieces]
    has_anchor = anchor >= 0
    pdepth = unit_depth[pieces]
    tail = pdepth % C if cfg.replay else np.zeros_like(pdepth)
    tail = np.where(has_anchor, tail, 0)
    size = resid[pieces] + tail
    if dup_only:
        cap_of = np.where(has_anchor, B - pdepth + tail, B)
    else:
        cap_of = np.full(pieces.shape[0], B, np.int64)
    assert (size <= cap_of).all(), "a piece larger than its bin: cut_pieces broke its contract"
    ppar = np.where(has_anchor, np.searchsorted(pieces, root[np.maximum(anchor, 0)]), -1)
    separate = False
    piece_mb, M, n_root, root_items = _pack(k, size, cap_of, ppar, anchor, dup_only, B, separate)
    if W > 1 and not dup_only:
        # few large trees: keep their window groups apart if that is what balances the ranks
        before = _group_imbalance(k, W, piece_mb, M, ppar, size)
        if before > IMBALANCE_TARGET:
            alt = _pack(k, size, cap_of, ppar, anchor, dup_only, B, True)
            if _group_imbalance(k, W, alt[0], alt[1], ppar, size) < before:
                separate = True
                piece_mb, M, n_root, root_items = alt
    if W > 1 and M % W:
        root_cap = _balanced_root_cap(k, *root_items, n_root, M, W, B)
        piece_mb, M, _, _ = _pack(k, size, cap_of, ppar, anchor, dup_only, root_cap, separate)
    unit_piece = np.searchsorted(pieces, root)
    unit_mb = piece_mb[unit_piece]
    mb_parent = np.full(M, -1, np.int64)
    anchored = np.flatnonzero(has_anchor)
    mb_parent[piece_mb[anchored]] = unit_mb[anchor[anchored]]
    assert (mb_parent < np.arange(M)).all()

    # per-microbatch sizes under both edge modes
    by_mb = np.argsort(piece_mb, kind="stable")
    roots = pieces[by_mb].astype(np.int64)
    roots_off = np.r_[0, np.cumsum(np.bincount(piece_mb, minlength=M))].astype(np.int64)
    internal = np.bincount(piece_mb, weights=resid[pieces], minlength=M).astype(np.int64)
    tails = np.bincount(piece_mb, weights=tail, minlength=M).astype(np.int64)
    kept = np.bincount(unit_mb, weights=unit_len, minlength=M).astype(np.int64)
    ctx, ctx_replay = k.context_cost(roots_off, roots, unit_parent, unit_len, unit_depth, C, cfg.replay)
    rows_shared = internal + tails
    rows_dup = internal + ctx + ctx_replay
    has_parent = mb_parent >= 0
    can_dup = has_parent & (rows_dup <= B)

    # Level 2: edge modes, placement, the live stack, the order.
    if dup_only:
        shared = np.zeros(M, np.bool_)
    else:
        short = (ctx < C) | (ctx < SHORT_PREFIX_FRACTION * kept)
        shared = has_parent & ~(short & can_dup)

    def rows_now() -> np.ndarray:
        return np.where(shared | ~has_parent, rows_shared, rows_dup)

    mb_rank, load = _place(k, W, mb_parent, shared, can_dup, rows_now)

    recompute = np.zeros(M, np.bool_)
    live = _fit_memory(k, cfg, mb_parent, shared, recompute, can_dup, rows_now, roots_off, roots, unit_parent, unit_len, unit_mb)
    rows = rows_now()
    load = np.bincount(mb_rank, weights=rows, minlength=W).astype(np.float64)

    step_rank, step_kind, step_mb = k.dfs_order(mb_parent, shared, mb_rank, W)
    rank_steps: list[list[tuple[str, int]]] = [[] for _ in range(W)]
    for r, kind, m in zip(step_rank.tolist(), step_kind.tolist(), step_mb.tolist()):
        rank_steps[r].append(("B" if kind else "F", m))

    specs = _specs(unit_seg, unit_off, unit_len, unit_mb, M)
    microbatches = [
        MicrobatchSpec(
            ranges=specs[m], parent=int(mb_parent[m]), shared=bool(shared[m]),
            rank=int(mb_rank[m]), recompute=bool(recompute[m]),
        )
        for m in range(M)
    ]
    report = PartitionReport(
        rows=rows, kept=kept, duplicated=np.where(has_parent & ~shared, ctx, 0),
        rank_load=load, live=live, pieces=int(pieces.shape[0]),
    )
    log.debug(
        "partition: %d pieces, %d microbatches (%d windows, %d duplicated edges, %d recomputed), "
        "rows %d, imbalance %.3f, peak live %d",
        report.pieces, M, int(shared.sum()), int((has_parent & ~shared).sum()), int(recompute.sum()),
        int(rows.sum()), report.imbalance, report.peak_live,
    )
    return Partition(microbatches=microbatches, rank_steps=rank_steps), report


def _check_paths_fit(forest: Forest, budget: int) -> None:
    lengths = forest.traj_length()
    if lengths.size and int(lengths.max()) > budget:
        t = int(np.argmax(lengths))
        raise PlanningError(
            f"microbatch_tokens: trajectory {forest.traj_ids[t]!r} has {int(lengths[t])} tokens, expected <= "
            f"{budget} without sharing windows (a duplicated edge recomputes the whole root path in one "
            f"microbatch); raise microbatch_tokens to >= {int(lengths[t])} or enable windows"
        )


def _pack(k, size, cap_of, ppar, anchor, dup_only: bool, root_cap: int, separate: bool = False):
    """Microbatch of every piece: first fit decreasing, level by level down the piece forest.

    Forest-root pieces are packed together (bins of `root_cap`); with `separate`, two that have
    pieces below them never share a bin, so that their window groups stay apart for placement.
    The pieces hanging below one microbatch's pieces are packed together (without windows: below
    one anchor unit, so that they share one duplicated context). Parents get smaller ids.

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
    has_below = np.zeros(K, np.bool_)
    has_below[ppar[ppar >= 0]] = True
    piece_mb = np.full(K, -1, np.int64)
    M = n_root = 0
    root_items = (np.zeros(0, np.int64), np.zeros(0, np.bool_))
    for L in range(int(level.max()) + 1 if K else 0):
        idx = np.flatnonzero(level == L)
        if L == 0:
            key = np.zeros(idx.shape[0], np.int64)
            opens = has_below[idx] & separate
        elif dup_only:
            key = anchor[idx]
            opens = np.zeros(idx.shape[0], np.bool_)
        else:
            key = piece_mb[ppar[idx]]
            opens = np.zeros(idx.shape[0], np.bool_)
        sort = np.lexsort((idx, -size[idx], ~opens, key))
        order = idx[sort]
        skey = key[sort]
        starts = np.flatnonzero(np.r_[True, skey[1:] != skey[:-1]])
        group_off = np.r_[starts, order.shape[0]].astype(np.int64)
        caps = np.full(starts.shape[0], root_cap, np.int64) if L == 0 else cap_of[order][starts].astype(np.int64)
        sizes = size[order].astype(np.int64)
        bins, nb = k.first_fit_decreasing(sizes, group_off, caps, opens[sort])
        piece_mb[order] = M + bins
        M += int(nb)
        if L == 0:
            n_root = int(nb)
            root_items = (sizes, opens[sort])
    return piece_mb, M, n_root, root_items


def _group_imbalance(k, W: int, piece_mb: np.ndarray, M: int, ppar: np.ndarray, size: np.ndarray) -> float:
    """LPT imbalance of a packing if every cross-microbatch edge were a window."""
    mb_parent = np.full(M, -1, np.int64)
    below = ppar >= 0
    mb_parent[piece_mb[below]] = piece_mb[ppar[below]]
    rows = np.bincount(piece_mb, weights=size, minlength=M)
    _, load = _lpt(k, W, k.window_groups(mb_parent, np.ones(M, np.bool_)), rows)
    return float(load.max() / load.mean()) if load.mean() > 0 else 1.0


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


def _lpt(k, W: int, group: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    M = group.shape[0]
    gcost = np.bincount(group, weights=rows, minlength=M)
    gids = np.unique(group)
    order = gids[np.lexsort((gids, -gcost[gids]))]
    grank, load = k.lpt_place(gcost[order].astype(np.float64), W)
    rank_of_group = np.zeros(M, np.int64)
    rank_of_group[order] = grank
    return rank_of_group[group], load


def _split_once(k, mb_parent, shared, can_dup, rows, group, targets) -> bool:
    """Duplicate one edge inside the heaviest group among `targets`: the one that halves it best."""
    sub = k.subtree_costs(mb_parent, shared, rows)
    gcost = np.bincount(group, weights=rows, minlength=group.shape[0])
    for g in sorted(targets, key=lambda g: (-gcost[g], g)):
        cand = np.flatnonzero((group == g) & shared & can_dup)
        if cand.size:
            best = cand[np.argmin(np.abs(sub[cand] - gcost[g] / 2))]
            shared[best] = False
            return True
    return False


def _place(k, W, mb_parent, shared, can_dup, rows_now):
    """LPT placement of window groups; duplicate edges of groups too heavy for an even split."""
    M = mb_parent.shape[0]
    for _ in range(4 * W if W > 1 else 0):
        rows = rows_now()
        group = k.window_groups(mb_parent, shared)
        gcost = np.bincount(group, weights=rows, minlength=M)
        heavy = np.flatnonzero(gcost > rows.sum() / W).tolist() if W > 1 else []
        if not heavy or not _split_once(k, mb_parent, shared, can_dup, rows, group, heavy):
            break
    rows = rows_now()
    group = k.window_groups(mb_parent, shared)
    mb_rank, load = _lpt(k, W, group, rows)
    for _ in range(4 * W if W > 1 else 0):
        imbalance = load.max() / load.mean() if load.mean() > 0 else 1.0
        if imbalance <= IMBALANCE_TARGET:
            break
        # detach the subtree (one duplicated edge on the busiest rank) that LPT balances best,
        # among the few whose cost is closest to half the gap between the busiest and idlest ranks
        sub = k.subtree_costs(mb_parent, shared, rows)
        cand = np.flatnonzero((mb_rank == int(np.argmax(load))) & shared & can_dup)
        gap = (load.max() - load.min()) / 2
        best = None
        for c in cand[np.argsort(np.abs(sub[cand] - gap), kind="stable")[:SPLIT_CANDIDATES]].tolist():
            shared[c] = False
            rows2 = rows_now()
            group2 = k.window_groups(mb_parent, shared)
            rank2, load2 = _lpt(k, W, group2, rows2)
            score = load2.max() / load2.mean()
            if score < imbalance and (best is None or score < best[0]):
                best = (score, c, rows2, group2, rank2, load2)
            shared[c] = True
        if best is None:
            break
        _, c, rows, group, mb_rank, load = best
        shared[c] = False
    return mb_rank, load


def _fit_memory(k, cfg, mb_parent, shared, recompute, can_dup, rows_now, roots_off, roots, unit_parent, unit_len, unit_mb):
    """Keep every live window stack within M: mark recomputation where it saves rows, then
    duplicate edges (deepest first along a violating stack). Returns live [M].

    A recomputed window stays live with the rows it keeps and exports only (rows it imported and
    re-exports are live in the ancestor that keeps them), so recomputation pays off where
    exports < rows.
    """
    M_budget = cfg.memory_tokens

    def costs():
        rows = rows_now()
        exports = k.export_rows(roots_off, roots, unit_parent, unit_len, unit_mb, mb_parent, shared)
        return rows, exports

    def live_now():
        rows, exports = costs()
        return k.live_stack(mb_parent, shared, rows, np.where(recompute, exports, rows))[0]

    live = live_now()
    if (live <= M_budget).all():
        return live
    rows, exports = costs()
    for m in np.flatnonzero(live > M_budget).tolist():
        c = m
        while mb_parent[c] >= 0 and shared[c]:
            c = int(mb_parent[c])
            recompute[c] = exports[c] < rows[c]
    live = live_now()
    # Enough M without any duplication: under a larger M the violators are a subset of these and
    # their ancestors get the same marks.
    need = int(live.max())
    while (live > M_budget).any():
        changed = False
        for m in np.flatnonzero(live > M_budget).tolist():
            c = m
            while mb_parent[c] >= 0 and shared[c]:
                if can_dup[c]:
                    shared[c] = False
                    changed = True
                    break
                c = int(mb_parent[c])
            if changed:
                break
        if not changed:
            worst = int(np.argmax(live))
            raise PlanningError(
                f"memory_tokens: the live window stack of microbatch {worst} needs {int(live[worst])} tokens, "
                f"expected <= {M_budget} (a trajectory's ancestors must stay live for its attention); "
                f"raise memory_tokens to >= {need}, or raise microbatch_tokens so that deep edges can duplicate "
                f"their prefix"
            )
        live = live_now()
    rows, exports = costs()
    has_kids = np.zeros(mb_parent.shape[0], np.bool_)
    has_kids[mb_parent[(mb_parent >= 0) & shared]] = True
    recompute &= has_kids & (exports < rows)  # only lowers live costs
    return live_now()


def _specs(unit_seg, unit_off, unit_len, unit_mb, M: int) -> list[np.ndarray]:
    """Kept ranges (segment, start, end) of every microbatch, merging adjacent units of a segment."""
    order = np.argsort(unit_mb, kind="stable")
    mb = unit_mb[order]
    seg = unit_seg[order]
    new = np.ones(order.shape[0], np.bool_)
    new[1:] = (mb[1:] != mb[:-1]) | (seg[1:] != seg[:-1]) | (order[1:] != order[:-1] + 1)
    first = np.flatnonzero(new)
    last = np.r_[first[1:], order.shape[0]] - 1
    ranges = np.stack(
        [seg[first].astype(np.int64), unit_off[order[first]].astype(np.int64),
         unit_off[order[last]].astype(np.int64) + unit_len[order[last]]],
        axis=1,
    )
    cuts = np.searchsorted(mb[first], np.arange(1, M))
    return np.split(ranges, cuts)


@njit(cache=True)
def _expand_tokens(tokens, seg_parent, seg_offset, seg_length, seg_depth, traj_seg, traj_offset):
    out = np.empty(traj_offset[-1], np.int32)
    for t in range(traj_seg.shape[0]):
        s = traj_seg[t]
        base = traj_offset[t]
        while s >= 0:
            a = base + seg_depth[s]
            o = seg_offset[s]
            for i in range(seg_length[s]):
                out[a + i] = tokens[o + i]
            s = seg_parent[s]
    return out


def expand_forest(forest: Forest) -> Forest:
    """The trajectory-expanded baseline's forest: every trajectory its own single-segment tree.

    Trajectory-space fields are shared with `forest` (not copied); tree i is named
    "<tree id>/<trajectory id>".
    """
    T = forest.num_trajectories
    lengths = forest.traj_length()
    tokens = _expand_tokens(
        forest.tokens, forest.seg_parent, forest.seg_offset, forest.seg_length, forest.seg_depth,
        forest.traj_seg, forest.traj_offset,
    )
    tree_of = forest.seg_tree[forest.traj_seg]
    return Forest(
        batch_id=forest.batch_id,
        vocab_size=forest.vocab_size,
        tokens=tokens,
        seg_parent=np.full(T, -1, np.int32),
        seg_offset=forest.traj_offset[:-1].astype(np.int64),
        seg_length=lengths.astype(np.int32),
        seg_depth=np.zeros(T, np.int32),
        seg_tree=np.arange(T, dtype=np.int32),
        tree_ids=[f"{forest.tree_ids[tree_of[t]]}/{forest.traj_ids[t]}" for t in range(T)],
        traj_ids=list(forest.traj_ids),
        traj_seg=np.arange(T, dtype=np.int32),
        traj_offset=forest.traj_offset,
        loss_mask=forest.loss_mask,
        advantages=forest.advantages,
        old_logprobs=forest.old_logprobs,
        ref_logprobs=forest.ref_logprobs,
        reward=forest.reward,
        weight=forest.weight,
        group_ids=list(forest.group_ids),
    )
