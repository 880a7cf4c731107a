"""The two-level partitioner: forest -> placement, microbatches, edge modes, order (DESIGN §4.1-4.2).

`partition(forest, cfg) -> Partition` is what `build_plan` consumes (see `spec.py`):

1. Units (`level1.build_units`): segments cut at the chunk-aligned depths inside them.
2. Placement (`placement_search.place_units` over the kernels of `placement.py`, with sharing
   windows and W > 1): the unit forest is cut into parts whose duplicated root paths make them
   independent, the parts are placed on ranks longest-processing-time first and refined by
   moving subtrees from the busiest rank to the idlest, keeping the placement with the smallest
   makespan under `cfg.cost_model` (within `cfg.makespan_slack`, the one that duplicates least).
   Every rank's forest is the units it keeps plus their ancestors, duplicated there, so windows
   never cross ranks.
3. Level 1 (`level1.py`) per rank forest: cut into the fewest connected pieces that fit B
   (Kundu-Misra; a duplicated unit below a kept one always starts a piece) and pack pieces into
   microbatches, first fit decreasing, level by level down the piece forest: each rank's root
   pieces together, then the pieces hanging below one microbatch together (so microbatches form
   a forest on each rank). A piece's size counts every row the builder will compute for it: kept
   and duplicated tokens, bounded replay at its unaligned branches, and the replay rows (window)
   or the duplicated root path (no windows) its root needs.
4. Level 2 (`level2.py`): choose each cross-microbatch edge's mode (share through a window, or
   duplicate a short prefix), keep every rank's live window stack under M in bytes of the memory
   model (`plan.memory_model`: activation recomputation first, then duplication), and order each
   rank depth-first. Without windows every microbatch carries its whole root path and microbatches
   are placed longest-processing-time first over computed rows.

With `cfg.lockstep` (`_lockstep`, DESIGN §5.7) level 1 packs every rank forest into about the
same number of microbatches of about the same size (`lockstep.equal_count_caps`, then
`level1.balance_bins`), level 2 marks only the root-most windows a too-deep stack needs as
recomputed, and the order is one global sequence of phases (`lockstep.align_phases`; stand-ins
where a rank has nothing of a phase's kind): of a few microbatch counts and aligner variants, the
shortest lock-step makespan.

Windows across ranks (`crossing_partitions`, cfg.crossing: lock-step plans with
cross_rank_windows; plan.proto CrossEdge): `_crossing_forests` takes the duplicating placement, moves
every unit above a depth (its tree's root segment, or a fraction of B: CROSS_PREFIXES) that
another rank needs (a tree's shared prefix) to the rank keeping the tree's root, and drops the other ranks' duplicated copies of it:
what hung below them now has a unit parent on another rank. Level 1 cuts pieces there, and keeps
the units that travel in pieces of their own, packed apart, so the microbatches exporting them are
thin and open first; level 2 counts what an importer receives in its live bytes; the aligner makes
a microbatch whose parent runs on another rank available once that parent has forwarded. Deeper
imports are not tried: a lock-step importer forwards only after its exporter's phase and the
exporter closes only after it, so every level of exporters adds a phase pair to the step.
`plan_step` builds the candidates and keeps one only where it pays.

Every kernel has a plain-Python twin (`partition_ref.py`, `placement_ref.py`, `lockstep.py`);
`impl="ref"` runs the whole partitioner on them (tests compare both; the benchmark times both).

`expand_forest` builds the trajectory-expanded baseline's forest (cfg.sharing False).

Legend: S segments, U units, n units of all rank forests, K pieces, M microbatches, G window
groups, W ranks, T trajectories, P placement parts.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
from numba import njit

import planner_service.planner.level1 as level1
import planner_service.planner.level2 as level2
import planner_service.planner.lockstep as lockstep
import planner_service.planner.partition_ref as partition_ref
import planner_service.planner.placement as placement
import planner_service.planner.placement_ref as placement_ref
from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.placement_search import UnitCosts, place_units, unit_costs
from planner_service.planner.spec import MicrobatchSpec, Partition

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
        align_phases=lockstep.align_phases_ref,
        **{name: getattr(placement_ref, name) for name in (
            "context_costs", "cut_parts", "rank_closure", "closure_costs", "refine", "lp_row_flags",
            "subtree_sums", "subtree_sizes", "lpt_parts", "placement_costs")},
    ),
}

#: A shared edge whose duplicated context is shorter than this fraction of the child's kept rows
#: (or shorter than one chunk) is duplicated instead: a window costs exports and a stack slot.
SHORT_PREFIX_FRACTION = 0.05
@dataclass(slots=True, kw_only=True)
class PartitionReport:
    """The partitioner's own estimates (the builder's PlanStats are authoritative)."""

    rows: np.ndarray
    """int64 [M] computed rows per microbatch (kept + replay + duplicated)."""
    kept: np.ndarray
    """int64 [M] kept tokens per microbatch."""
    duplicated: np.ndarray
    """int64 [M] duplicated rows (placement prefixes and duplicated-edge context)."""
    rank_load: np.ndarray
    """float64 [W] estimated cost per rank (placement's cost model; computed rows without windows)."""
    live: np.ndarray
    """int64 [M] live bytes while each microbatch runs (its full activations plus its open
    windows' live bytes, plan.memory_model)."""
    pieces: int
    """Number of connected pieces level 1 cut the rank forests into."""
    exports: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 [M] upper bound of the bytes each microbatch keeps as a recomputed open window (its
    own exported rows and states; 0 for one nobody imports from)."""
    lower_bound: float = 0.0
    """Placement's makespan lower bound estimate: max(total cost / W, the costliest root path)."""

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_load.mean()) if self.rank_load.size else 0.0
        return float(self.rank_load.max()) / mean if mean > 0 else 1.0

    @property
    def peak_live(self) -> int:
        return int(self.live.max()) if self.live.size else 0


def partition(forest: Forest, cfg: PlanConfig, *, impl: str = "numba") -> Partition:
    """Placement, microbatches, edge modes and execution order of one step (see module docstring).

    Raises:
        PlanningError: settings that cannot be satisfied (a trajectory longer than B without
            windows, a root-to-leaf path whose window exports alone exceed M).
    """
    return partition_with_report(forest, cfg, impl=impl)[0]


def partition_with_report(forest: Forest, cfg: PlanConfig, *, impl: str = "numba") -> tuple[Partition, PartitionReport]:
    """`partition` plus the partitioner's estimates: the stages `_rank_forests` (units and
    placement), `_level1` (pieces and microbatches), `_edge_rows`, `_level2` (edge modes, ranks
    without windows, the live stack) and `_assemble` (order, specs, report)."""
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
    rf = _rank_forests(k, forest, cfg)
    if cfg.lockstep:
        return _assemble(k, cfg, rf, *_lockstep(k, cfg, rf))
    l1 = _level1(k, cfg, rf)
    edges = _edge_rows(k, cfg, rf, l1)
    l2 = _level2(k, cfg, rf, l1, edges)
    return _assemble(k, cfg, rf, l1, edges, l2)


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
    rank forests of `_crossing_forests` for every prefix of CROSS_PREFIXES and both placements, each with its lock-step schedule (`_lockstep`). Returns (the schedule's
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
        rf = _crossing_forests(k, forest, cfg, units, uc, placements, depth, free_prefix)
        try:
            got = _lockstep(k, cfg, rf)
        except PlanningError as exc:
            error = error or exc
            continue
        out.append((got[3].makespan, got[3].phases.shape[0], len(out), *_assemble(k, cfg, rf, *got)))
    if not out:
        raise error
    return [(x[0], x[3], x[4]) for x in sorted(out, key=lambda x: x[:3])]


def _lockstep(k, cfg: PlanConfig, rf: _RankForests):
    """Level 1 with about equal microbatch counts and sizes per rank, level 2 with the fewest
    recomputed windows, and the phases aligned (`lockstep.align_phases`): of the candidate
    counts and rank weightings, the schedule with the shortest lock-step makespan (then the
    fewest phases); with windows across ranks also level 1 at B (fewer microbatches: shorter
    chains of windows across ranks), and each importer's received exports in its live bytes and
    their transfer in its cost. Returns (level 1, edge rows, level 2, schedule) for `_assemble`.

    Raises:
        PlanningError: with windows across ranks, when no order finishes (ranks waiting for each
            other), or a budget level 2 cannot meet.
    """
    W, C, B = cfg.world_size, cfg.chunk_size, cfg.microbatch_tokens
    first = _level1(k, cfg, rf)
    candidates = [first]
    if cfg.windows and W > 1:
        n0 = int(np.bincount(first.mb_home, minlength=W).max())

        def counts(caps: np.ndarray) -> np.ndarray:
            return np.bincount(_level1(k, cfg, rf, caps).mb_home, minlength=W)

        candidates = [_level1(k, cfg, rf, lockstep.equal_count_caps(counts, W, B, C, n0 + extra))
                      for extra in LOCKSTEP_EXTRA_MICROBATCHES]
        if rf.crossing:
            candidates.append(first)
    best = None
    for l1 in candidates:
        e = _edge_rows(k, cfg, rf, l1)
        l2 = _level2(k, cfg, rf, l1, e, minimal_recompute=True)
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


@dataclass(slots=True)
class _RankForests:
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
    """Windows across ranks (`_crossing_forests`): unit_parent may lie in another rank's forest
    (a piece boundary whose window crosses ranks); the arrays are then not in one preorder."""


def _rank_forests(k, forest: Forest, cfg: PlanConfig) -> _RankForests:
    """Units (level1.build_units) and, with windows and W > 1, their placement on ranks."""
    W, C = cfg.world_size, cfg.chunk_size
    g_seg, g_off, g_len, g_depth, g_parent = k.build_units(forest.seg_parent, forest.seg_length, forest.seg_depth, C)
    U = g_parent.shape[0]
    if not cfg.windows or W == 1:
        # one forest: every unit kept where it is, nothing duplicated by placement
        lower_bound = 0.0
        if W == 1 and cfg.windows:
            lower_bound = float(unit_costs(k, forest, cfg, g_seg, g_off, g_len, g_depth, g_parent).w.sum())
        return _RankForests(unit_seg=g_seg, unit_off=g_off, unit_len=g_len, unit_depth=g_depth,
                            unit_parent=g_parent.astype(np.int64), unit_rank=np.zeros(U, np.int64),
                            dup=np.zeros(U, np.bool_), load=None, lower_bound=lower_bound)
    uc = unit_costs(k, forest, cfg, g_seg, g_off, g_len, g_depth, g_parent)
    unit_rank, lower_bound = place_units(k, cfg, g_parent, uc)
    ru_unit, ru_rank, ru_dup, ru_parent = k.rank_closure(g_parent, unit_rank, W)
    load = np.asarray(k.closure_costs(ru_unit, ru_rank, ru_dup, ru_parent, uc.w, uc.w_dup, uc.rc, W)[0])
    return _RankForests(unit_seg=g_seg[ru_unit], unit_off=g_off[ru_unit], unit_len=g_len[ru_unit],
                        unit_depth=g_depth[ru_unit], unit_parent=ru_parent, unit_rank=ru_rank, dup=ru_dup, load=load,
                        lower_bound=lower_bound)


def _crossing_forests(k, forest: Forest, cfg: PlanConfig, units, uc: UnitCosts, placements: dict, prefix_depth: int,
                      free_prefix: bool) -> _RankForests:
    """Rank forests whose shared prefix crosses ranks (`crossing_partitions`): the placement of
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
    return _RankForests(unit_seg=g_seg[sel], unit_off=g_off[sel], unit_len=g_len[sel], unit_depth=g_depth[sel],
                        unit_parent=par, unit_rank=ru_rank[keep], dup=ru_dup[keep], load=load, lower_bound=lower_bound,
                        crossing=True)


@dataclass(slots=True)
class _Level1:
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


def _level1(k, cfg: PlanConfig, rf: _RankForests, caps: np.ndarray | None = None) -> _Level1:
    """Cut every rank forest into the fewest pieces that fit B (Kundu-Misra) and pack them into
    microbatches level by level (`_pack`).

    Args:
        caps: int64 [W] a smaller piece and microbatch capacity per rank forest (lock-step plans,
            `_lockstep`); None: B everywhere.
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
        prefix = _exported_prefix(unit_parent, across)
        force |= across | (has_up & prefix[up] & ~prefix)
    cut, resid, bad = k.cut_pieces(unit_parent, rf.unit_len, unit_depth, C, budget, dup_only, cfg.replay, force)
    if bad >= 0:  # only reachable without windows, and _check_paths_fit rules it out
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
    return _Level1(resid=resid, pieces=pieces, tail=tail, piece_mb=piece_mb, unit_mb=unit_mb, mb_parent=mb_parent,
                   mb_home=mb_home)


@dataclass(slots=True)
class _EdgeRows:
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


def _edge_rows(k, cfg: PlanConfig, rf: _RankForests, l1: _Level1) -> _EdgeRows:
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
    return _EdgeRows(roots_off=roots_off, roots=roots, kept=kept, own_dup=own_dup, ctx=ctx,
                     rows_shared=internal + tails, rows_dup=internal + ctx + ctx_replay, tails=tails, anchored=anchored)


@dataclass(slots=True)
class _Level2:
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


def _level2(k, cfg: PlanConfig, rf: _RankForests, l1: _Level1, e: _EdgeRows, *, minimal_recompute: bool = False
            ) -> _Level2:
    """Edge modes (share, or duplicate a short prefix), ranks without windows (LPT over computed
    rows), and the live window stacks within M (`_fit_memory`; `minimal_recompute`: lock-step)."""
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
    est = _Exports(k, cfg, e.roots_off, e.roots, rf.unit_parent, rf.unit_len, rf.unit_depth, l1.unit_mb, mb_parent)
    live = _fit_memory(k, cfg, est, mb_parent, shared, recompute, can_dup, rows_now, minimal=minimal_recompute,
                       crossing=crossing, imp_now=imp_now)
    rows = rows_now()
    load = rf.load if rf.load is not None else np.bincount(mb_rank, weights=rows, minlength=W).astype(np.float64)
    return _Level2(shared=shared, mb_rank=mb_rank, recompute=recompute, rows=rows, live=live,
                   exports=est.bytes(shared, rows)[1], load=load, imp=imp_now())


def _assemble(k, cfg: PlanConfig, rf: _RankForests, l1: _Level1, e: _EdgeRows, l2: _Level2,
              sch: lockstep.Schedule | None = None) -> tuple[Partition, PartitionReport]:
    """Every rank's order (depth-first, or the lock-step schedule `sch`), the microbatch specs and
    the partition report."""
    W, M = cfg.world_size, l1.num_microbatches
    if sch is not None:
        rank_steps = sch.rank_steps
    else:
        step_rank, step_kind, step_mb = k.dfs_order(l1.mb_parent, l2.shared, l2.mb_rank, W)
        rank_steps = [[] for _ in range(W)]
        for r, kind, m in zip(step_rank.tolist(), step_kind.tolist(), step_mb.tolist()):
            rank_steps[r].append(("B" if kind else "F", m))
    kept_specs = _specs(rf.unit_seg, rf.unit_off, rf.unit_len, l1.unit_mb, M, ~rf.dup)
    dup_specs = _specs(rf.unit_seg, rf.unit_off, rf.unit_len, l1.unit_mb, M, rf.dup)
    microbatches = [
        MicrobatchSpec(
            ranges=kept_specs[m], dup_ranges=dup_specs[m], parent=int(l1.mb_parent[m]), shared=bool(l2.shared[m]),
            rank=int(l2.mb_rank[m]), recompute=bool(l2.recompute[m]),
        )
        for m in range(M)
    ]
    has_parent = l1.mb_parent >= 0
    report = PartitionReport(
        rows=l2.rows, kept=e.kept, duplicated=e.own_dup + np.where(has_parent & ~l2.shared, e.ctx, 0),
        rank_load=l2.load, live=l2.live, pieces=int(l1.pieces.shape[0]), exports=l2.exports,
        lower_bound=rf.lower_bound,
    )
    log.debug(
        "partition: %d pieces, %d microbatches (%d windows, %d duplicated edges, %d recomputed), "
        "rows %d (%d duplicated by placement), imbalance %.3f, peak live %d bytes",
        report.pieces, M, int(l2.shared.sum()), int((has_parent & ~l2.shared).sum()), int(l2.recompute.sum()),
        int(l2.rows.sum()), int(e.own_dup.sum()), report.imbalance, report.peak_live,
    )
    return Partition(microbatches=microbatches, rank_steps=rank_steps,
                     phases=None if sch is None else sch.phases), report


def _exported_prefix(unit_parent: np.ndarray, across: np.ndarray) -> np.ndarray:
    """bool [n] units on the root path above a window across ranks (their rows travel)."""
    out = np.zeros(unit_parent.shape[0], np.bool_)
    for u in np.flatnonzero(across).tolist():
        a = int(unit_parent[u])
        while a >= 0 and not out[a]:
            out[a] = True
            a = int(unit_parent[a])
    return out


def _check_paths_fit(forest: Forest, budget: int) -> None:
    lengths = forest.traj_length()
    if lengths.size and int(lengths.max()) > budget:
        t = int(np.argmax(lengths))
        raise PlanningError(
            f"microbatch_tokens: trajectory {forest.traj_ids[t]!r} has {int(lengths[t])} tokens, expected <= "
            f"{budget} without sharing windows (a duplicated edge recomputes the whole root path in one "
            f"microbatch); raise microbatch_tokens to >= {int(lengths[t])} or enable windows"
        )


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


def _lpt(k, W: int, group: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    M = group.shape[0]
    gcost = np.bincount(group, weights=rows, minlength=M)
    gids = np.unique(group)
    order = gids[np.lexsort((gids, -gcost[gids]))]
    grank, load = k.lpt_place(gcost[order].astype(np.float64), W)
    rank_of_group = np.zeros(M, np.int64)
    rank_of_group[order] = grank
    return rank_of_group[group], load


class _Exports:
    """The partitioner's estimate of what each window keeps (plan.memory_model's rules).

    `full` are what a microbatch holds while it runs (`RowSizes.full_bytes`: with activation
    checkpointing its kept activations plus one recomputed block's); what it keeps while its
    dependents run is its kept activations (`RowSizes.kept_bytes`), or, recomputed, the exports of
    its own rows that `level2.window_export_counts` bounds from above. The builder's exact stack is
    therefore never larger than this estimate.
    """

    def __init__(self, k, cfg: PlanConfig, roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent):
        self.k, self.cfg = k, cfg
        self.args = (roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent)

    def bytes(self, shared: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(full int64 [M], recomputed-window exports int64 [M]) in bytes."""
        roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent = self.args
        group = self.k.window_groups(mb_parent, shared)
        attn, conv, kern, states = self.k.window_export_counts(
            roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent, shared, group,
            self.cfg.chunk_size, self.cfg.conv_kernel, self.cfg.replay,
        )
        sizes = self.cfg.sizes
        return sizes.full_bytes(rows), sizes.export_bytes(attn, conv, kern, states)


def _fit_memory(k, cfg, est: _Exports, mb_parent, shared, recompute, can_dup, rows_now, *, minimal: bool = False,
                crossing: np.ndarray | None = None, imp_now=None):
    """Keep every live window stack within M (bytes): mark recomputation where it saves memory,
    then duplicate edges (deepest first along a violating stack). Returns live int64 [M] bytes.

    A violating stack marks every window on it; with `minimal` (lock-step plans, where each
    recomputed window's backward needs a PHASE_RECOMPUTE) only the root-most ones that cover its
    excess. With windows across ranks (`crossing`: bool [M] the parent runs on another rank), a
    stack is a rank's: it starts at a microbatch whose window crosses ranks, which holds the
    exports it receives (`imp_now()`, int64 [M]) while it runs and while it is open.

    Raises:
        PlanningError: a microbatch whose own activations plus the exports of its open windows,
            every one of them recomputed and no edge left to duplicate, exceed M; the message
            gives the numbers and a sufficient budget.
    """
    budget = cfg.memory_bytes
    sizes = cfg.sizes
    M = mb_parent.shape[0]
    crossing = np.zeros(M, np.bool_) if crossing is None else crossing

    def local() -> np.ndarray:  # window edges inside one rank's stack
        return shared & ~crossing

    def live_now():  # (live, running bytes, kept bytes of an open window, exports of a recomputed one)
        rows = rows_now()
        full, exports = est.bytes(shared, rows)
        kept = sizes.kept_bytes(rows)
        imp = imp_now() if imp_now is not None else 0
        return k.live_stack(mb_parent, local(), full + imp, np.where(recompute, exports, kept) + imp)[0], full, kept, exports

    def chain_of(m: int) -> list[int]:  # the open windows below which m runs on its rank, nearest first
        chain = []
        c = m
        on = local()
        while mb_parent[c] >= 0 and on[c]:
            c = int(mb_parent[c])
            chain.append(c)
        return chain

    live, full, kept, exports = live_now()
    if (live <= budget).all():
        return live
    for m in np.flatnonzero(live > budget).tolist():
        chain = chain_of(m)
        if not minimal:
            for c in chain:
                recompute[c] = exports[c] < kept[c]
            continue
        over = int(live[m]) - budget
        for c in reversed(chain):  # root-most first: one mark covers every stack below it
            if over <= 0:
                break
            if not recompute[c] and exports[c] < kept[c]:
                recompute[c] = True
                over -= int(kept[c] - exports[c])
    live, full, kept, exports = live_now()
    # Enough M without any duplication: under a larger M the violators are a subset of these and
    # their ancestors get the same marks.
    need = int(live.max())
    while (live > budget).any():
        changed = False
        for m in np.flatnonzero(live > budget).tolist():
            on = local()
            c = m
            while mb_parent[c] >= 0 and on[c]:
                if can_dup[c]:
                    shared[c] = False
                    changed = True
                    break
                c = int(mb_parent[c])
            if changed:
                break
        if not changed:
            worst = int(np.argmax(live))
            chain = chain_of(worst)
            held = int(live[worst] - full[worst])
            raise PlanningError(
                f"memory_tokens: microbatch {worst} holds {int(live[worst])} bytes ({sizes.tokens(int(live[worst]))} "
                f"row-equivalents) while it runs, expected <= {budget} ({cfg.memory_tokens} x "
                f"{sizes.row_bytes} bytes per row): its own activations ({int(full[worst])} bytes) plus "
                f"the exports of its {len(chain)} open windows ({held} bytes, every one recomputed) along one "
                f"root-to-leaf path, and no edge on it can duplicate its prefix within microbatch_tokens; raise "
                f"memory_tokens to >= {sizes.tokens(need)}, or raise microbatch_tokens so that deep edges can duplicate "
                f"their prefix"
            )
        live, full, kept, exports = live_now()
    has_kids = np.zeros(mb_parent.shape[0], np.bool_)
    has_kids[mb_parent[(mb_parent >= 0) & shared]] = True
    recompute &= has_kids & (exports < kept)  # only lowers live costs
    return live_now()[0]


def _specs(unit_seg, unit_off, unit_len, unit_mb, M: int, select: np.ndarray) -> list[np.ndarray]:
    """Token ranges (segment, start, end) of every microbatch over the units `select` (bool [n]),
    merging units of one segment that follow each other in the rank forest."""
    idx = np.flatnonzero(select)
    if idx.shape[0] == 0:
        return [np.zeros((0, 3), np.int64) for _ in range(M)]
    order = idx[np.argsort(unit_mb[idx], kind="stable")]
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
        policy_version=forest.policy_version,
    )
