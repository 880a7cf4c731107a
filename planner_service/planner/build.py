"""The plan builder: from a Forest and a Partition to the wire plan (DESIGN §4.3-§4.4, §5.5).

`build_plan(forest, cfg, partition)` lays out, for every microbatch, its rows (packed depth-first,
the continuing child first), segment table, occurrence counts, conv and attention ancestry, the
minimum-call linear-attention schedule (min_calls.py), sharing-window imports/exports, the log-prob
map with its trajectory-space fields, then the global normalisers, header, execution steps and the
report. `PlanStats.plan_seconds` is left to `plan_step`.

`build_plan` runs named stages, in order: `_check_layouts` (the partition's tokens, ranks and
windows), `_context` (root paths and what window children need), `_lay_out` (rows of every
microbatch), `_windows` (imports and exports), `_schedules` (linear-attention calls),
`_state_sources` (every sequence's initial state), `_logprob_map`, `_rank_orders` (execution
steps), `_serialise` (one wire microbatch), `_cross_edges` (windows across ranks, lock-step plans
with cfg.crossing: a window parent or a state's exporter on another rank) and `_fill_steps` /
`_fill_stats`.

The passes over tokens, rows, sequences and log-prob entries are Numba kernels over flat arrays
(`build_kernels.py`, `min_calls.py`, `linear_calls_codec.py`), picked once per plan as a namespace
(`_KERNELS`, like the partitioner's): `impl="ref"` runs their plain-Python twins instead, and the
two modes produce byte-identical plans. What stays here is per-microbatch glue and checks.

Rows of a microbatch m:
- kept rows: the forest tokens m keeps (MicrobatchSpec.ranges);
- context: every forest token on the root-to-piece paths of m's pieces, plus the context its
  shared children need, that m does not keep. A shared (window) child imports its context from its
  parent's extended rows (the parent re-exports rows it imported itself); any other microbatch with
  a parent duplicates it as local rows (occurrence 0, no log-prob entries).
A linear-attention state consumed across microbatches comes straight from the microbatch whose
sequence computed it (an ancestor in the same window), which lists it in export_states.

Cost model (Microbatch.cost, PlanStats.rank_costs): `cfg.cost_model` (cost_model.py) over the
microbatch's computed rows, attended (query, key) pairs (a row at depth d attends to d + 1 keys),
linear-attention calls and distinct log-prob rows. The makespan statistics compare the largest
rank cost with max(total / W, the longest trajectory computed alone).

Live memory (PlanStats.peak_live_bytes): plan.memory_model.rank_live_bytes over the decoded
microbatches, the same function the validator checks with (with windows across ranks: the
exporters' remote needs and the exports an importer holds, plan.cross_edges). Transfers:
CostModel.transfer_byte x each rank's exchanged bytes in PlanStats.rank_transfer_costs (added to
the makespan) and, per phase, in lockstep_makespan.

Legend: N_u forest tokens, N_e expanded positions, T trajectories, R local rows, I imported rows,
S local segments, K conv kernel, C chunk size.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace

import numpy as np

import planner_service.planner.build_kernels as bk
import planner_service.planner.linear_calls_codec as codec
import planner_service.planner.min_calls as mc
from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.cost_model import microbatch_features
from planner_service.planner.logprob_map import loss_per_trajectory
from planner_service.planner.spec import MicrobatchSpec, Partition
from proto.arrays import pack as pk
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.cross_edges import CrossEdgeArrays, edge_bytes, held_bytes, remote_imports, sent_needs, transfer_bytes
from plan.memory_model import rank_live_bytes
from plan.phases import PHASE_BACKWARD, PHASE_FORWARD, phase_counts, step_cost
from plan.microbatch import LinearCallArrays, MicrobatchArrays
from plan.seal import PLAN_VERSION
from plan.window_exports import ATTN, CONV, KERNEL, export_needs, import_needs

_KERNEL_NAMES = ("token_index", "expand_ranges", "local_segments", "local_rows_layout", "ext_parent_depth",
                 "sorted_union", "attn_ranges", "conv_ancestors", "subtree_occurrence", "row_occurrence", "lp_grouped")
_KERNELS = {
    "numba": SimpleNamespace(**{n: getattr(bk, n) for n in _KERNEL_NAMES}, pack=partial(mc.pack, use_numba=True),
                             schedule=mc.schedule, fill_linear_calls=codec.fill_linear_calls),
    "ref": SimpleNamespace(**{n: getattr(bk, n + "_ref") for n in _KERNEL_NAMES}, pack=partial(mc.pack, use_numba=False),
                           schedule=mc.schedule_ref, fill_linear_calls=codec.fill_linear_calls_ref),
}


@dataclass(slots=True)
class _Layout:
    """Everything the builder computes for one microbatch before serialising it."""

    mb: int
    spec: MicrobatchSpec
    kept_tok: np.ndarray  # int64 [n] forest tokens kept here
    dup_tok: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sorted explicit duplicated tokens
    ctx_tok: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sorted context tokens
    local_tok: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [R] packed order
    dup_sorted_tok: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # duplicated rows' tokens, sorted
    dup_sorted_row: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # and their local rows
    kept_mb: np.ndarray | None = None  # int32 [N_u] microbatch keeping each token (shared by all layouts)
    kept_row: np.ndarray | None = None  # int64 [N_u] its local row there (filled once laid out)
    packed: dict = field(default_factory=dict)
    seg_forest: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    seg_forest_offset: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    seg_dup: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    sched: tuple = ()
    states: dict = field(default_factory=dict)  # local row -> state id
    state_imports: list = field(default_factory=list)  # (exporter mb, state id)
    export_states: set = field(default_factory=set)
    export_parts: list = field(default_factory=list)  # int arrays of exported extended rows
    export_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # sorted, unique
    import_row: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    @property
    def shared(self) -> bool:
        return self.spec.parent >= 0 and self.spec.shared

    @property
    def num_rows(self) -> int:
        return int(self.local_tok.shape[0])

    def owns(self, toks: np.ndarray, kept_mb: np.ndarray) -> np.ndarray:
        """bool: the token is one of this microbatch's own rows, kept (kept_mb int32 [N_u]: the
        microbatch keeping each token) or explicitly duplicated."""
        toks = np.asarray(toks, np.int64)
        out = kept_mb[toks] == self.mb
        if self.dup_tok.shape[0]:
            i = np.minimum(np.searchsorted(self.dup_tok, toks), self.dup_tok.shape[0] - 1)
            out |= self.dup_tok[i] == toks
        return out

    def local_rows(self, toks: np.ndarray) -> np.ndarray:
        """int64 local row of each token, -1 where the token is not a local row (kept rows through
        the step-wide kept_mb/kept_row tables, duplicated ones by search)."""
        toks = np.asarray(toks, np.int64)
        if self.num_rows == 0:
            return np.full(toks.shape, -1, np.int64)
        rows = np.where(self.kept_mb[toks] == self.mb, self.kept_row[toks], -1)
        n = self.dup_sorted_tok.shape[0]
        if n:
            i = np.minimum(np.searchsorted(self.dup_sorted_tok, toks), n - 1)
            rows = np.where((rows < 0) & (self.dup_sorted_tok[i] == toks), self.dup_sorted_row[i], rows)
        return rows

    def ext_rows(self, toks: np.ndarray) -> np.ndarray:
        """int64 extended row of each token (local, else imported), -1 when absent."""
        rows = self.local_rows(toks)
        if self.shared and self.ctx_tok.shape[0]:
            j = np.minimum(np.searchsorted(self.ctx_tok, toks), self.ctx_tok.shape[0] - 1)
            rows = np.where((rows < 0) & (self.ctx_tok[j] == toks), self.num_rows + j, rows)
        return rows


class _TokenIndex:
    """Per forest token: segment, offset, depth, predecessor (flat int32 arrays [N_u])."""

    def __init__(self, forest: Forest, k: SimpleNamespace = _KERNELS["numba"]):
        self.seg, self.off, self.depth, self.pred = k.token_index(forest.seg_parent, forest.seg_offset, forest.seg_length,
                                                                  forest.seg_depth)
        self.forest = forest


def _topological(specs: list[MicrobatchSpec]) -> list[int]:
    """Microbatch ids, parents before children; raises on unknown parents or cycles."""
    n = len(specs)
    kids: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for m, sp in enumerate(specs):
        if sp.parent >= n or sp.parent < -1 or sp.parent == m:
            raise PlanningError(f"partition.microbatches[{m}].parent: expected -1 or another id < {n}, got {sp.parent}")
        (kids[sp.parent] if sp.parent >= 0 else roots).append(m)
    order = []
    stack = roots[::-1]
    while stack:
        m = stack.pop()
        order.append(m)
        stack.extend(kids[m][::-1])
    if len(order) != n:
        raise PlanningError("partition: microbatch parents form a cycle")
    return order


def _kept_tokens(forest: Forest, spec: MicrobatchSpec, m: int, k: SimpleNamespace, what: str = "ranges") -> np.ndarray:
    """int64 forest tokens of `spec.<what>` (kept ranges, or dup_ranges), in range order."""
    rng = np.asarray(getattr(spec, what), np.int64).reshape(-1, 3)
    if rng.shape[0] == 0:
        return np.zeros(0, np.int64)
    s, a, b = rng[:, 0], rng[:, 1], rng[:, 2]
    bad = (s < 0) | (s >= forest.num_segments)
    if not bad.any():
        bad = (a < 0) | (b <= a) | (b > forest.seg_length[s])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanningError(f"partition.microbatches[{m}].{what}[{i}]: expected a non-empty range inside its segment, got {rng[i].tolist()}")
    return k.expand_ranges(forest.seg_offset[s] + a, b - a)


def _path_need(tix: _TokenIndex, toks, need: dict[int, int]) -> None:
    """Add the root paths of `toks` (inclusive) to `need` (forest segment -> prefix length)."""
    f = tix.forest
    for x in toks:
        s = int(tix.seg[x])
        n = int(tix.off[x]) + 1
        while s >= 0:
            if need.get(s, 0) >= n:
                break
            need[s] = n
            s = int(f.seg_parent[s])
            n = int(f.seg_length[s]) if s >= 0 else 0


def _need_tokens(forest: Forest, need: dict[int, int], k: SimpleNamespace) -> np.ndarray:
    """Sorted forest tokens of the prefixes in `need` (forest segment -> prefix length)."""
    if not need:
        return np.zeros(0, np.int64)
    segs = sorted(need)
    return k.expand_ranges(forest.seg_offset[np.array(segs, np.int64)], np.array([need[s] for s in segs], np.int64))


def _lay_out(L: _Layout, tix: _TokenIndex, cfg: PlanConfig, k: SimpleNamespace, kept_row: np.ndarray) -> None:
    """Local forest of one microbatch (kept ranges plus duplicated context), packed; fills
    kept_row[t] (int64 [N_u]) with the local row of every forest token t it keeps."""
    dup_tok = L.dup_tok if L.shared else np.union1d(L.dup_tok, L.ctx_tok)
    toks = np.concatenate([L.kept_tok, dup_tok])  # distinct: context and duplicated rows are never kept here
    dup = np.concatenate([np.zeros(L.kept_tok.shape[0], np.uint8), np.ones(dup_tok.shape[0], np.uint8)])
    order = np.argsort(toks, kind="stable")
    first, lens, sdup, parent, attach, bad = k.local_segments(toks[order], dup[order], tix.seg, tix.pred, L.ctx_tok, L.shared)
    if bad >= 0:
        raise PlanningError(
            f"partition.microbatches[{L.mb}]: expected the predecessor of forest token {int(first[bad])} "
            f"(segment {int(tix.seg[first[bad]])}) to be a row of this microbatch or of its context, got none"
        )
    P = k.pack(parent, tix.depth[first].astype(np.int32), lens.astype(np.int32), attach, cfg.chunk_size)
    L.packed = P
    L.seg_forest, L.seg_forest_offset, L.seg_dup, L.local_tok = k.local_rows_layout(
        P["order"], first, sdup, P["row_seg"], P["seg_start"], tix.seg, tix.off, kept_row,
    )
    dup_rows = np.flatnonzero(L.seg_dup[P["row_seg"]] == 1) if L.num_rows else np.zeros(0, np.int64)
    L.dup_sorted_row = dup_rows[np.argsort(L.local_tok[dup_rows], kind="stable")]
    L.dup_sorted_tok = L.local_tok[L.dup_sorted_row]
    L.kept_row = kept_row


def _ext_parent_depth(L: _Layout, tix: _TokenIndex, k: SimpleNamespace) -> tuple[np.ndarray, np.ndarray]:
    """int32 [R + I] predecessor extended row and depth of every extended row."""
    imp = L.ctx_tok if L.shared else np.zeros(0, np.int64)
    return k.ext_parent_depth(L.packed["row_parent"], L.packed["row_depth"], imp, tix.pred, tix.depth)


def _owners(layouts: list[_Layout], m: int, toks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(microbatch, local row) that computes each token for microbatch m: m or a window ancestor
    (int64 [n] each)."""
    toks = np.asarray(toks, np.int64)
    own = np.full(toks.shape[0], -1, np.int64)
    row = np.full(toks.shape[0], -1, np.int64)
    todo = np.arange(toks.shape[0])
    while todo.shape[0]:
        L = layouts[m]
        r = L.local_rows(toks[todo])
        hit = r >= 0
        own[todo[hit]] = m
        row[todo[hit]] = r[hit]
        todo = todo[~hit]
        if todo.shape[0] and not L.shared:
            raise PlanningError(f"microbatch {m}: forest token {int(toks[todo[0]])} is neither a local row nor imported")
        m = L.spec.parent
    return own, row


def _default_steps(specs: list[MicrobatchSpec], world: int) -> list[list[tuple[str, int]]]:
    """Depth-first per rank over the microbatch forest: F on entry, B after every dependent."""
    kids: list[list[int]] = [[] for _ in specs]
    for m, sp in enumerate(specs):
        if sp.parent >= 0 and specs[sp.parent].rank == sp.rank and sp.shared:
            kids[sp.parent].append(m)
    steps: list[list[tuple[str, int]]] = [[] for _ in range(world)]

    def visit(m: int) -> None:
        steps[specs[m].rank].append(("F", m))
        for c in kids[m]:
            visit(c)
        steps[specs[m].rank].append(("B", m))

    for m, sp in enumerate(specs):
        if not (sp.parent >= 0 and specs[sp.parent].rank == sp.rank and sp.shared):
            visit(m)
    return steps


def build_plan(forest: Forest, cfg: PlanConfig, partition: Partition, *, impl: str = "numba") -> plan_pb2.Plan:
    """Lay out and serialise the plan of one step (the stages of the module docstring).

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
    tix = _TokenIndex(forest, k)
    layouts, kept_mb, topo = _check_layouts(forest, cfg, partition, k)
    _context(forest, tix, layouts, kept_mb, topo, k)
    kept_row = np.empty(forest.unique_tokens, np.int64)  # every token is kept once: all filled
    for m in topo:
        _lay_out(layouts[m], tix, cfg, k, kept_row)
    _windows(layouts, topo, k)
    ext = _schedules(layouts, tix, cfg, topo, k)
    sources = _state_sources(layouts)
    lp = _logprob_map(forest, cfg, k, kept_mb, kept_row, len(layouts))
    steps, rank_order = _rank_orders(partition, cfg)
    phases = _phases(partition, cfg, steps)

    plan = plan_pb2.Plan()
    _fill_header(plan.header, forest, cfg)
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
            arrays[m] = _serialise(msg, layouts[m], forest, cfg, k, ext[m], sources[m], lp, occ_seg)
            mbs[m] = msg
    edges = _cross_edges(plan, cfg, arrays, steps, topo)
    rank_costs, peak = _fill_steps(plan, cfg, steps, rank_order, mbs, arrays, edges)
    _fill_stats(plan.header.stats, forest, cfg, layouts, mbs, rank_costs, peak, edges)
    if phases is not None:
        _fill_lockstep_stats(plan, phases, edges)
    return plan


def _check_layouts(forest: Forest, cfg: PlanConfig, partition: Partition, k: SimpleNamespace
                   ) -> tuple[list[_Layout], np.ndarray, list[int]]:
    """One _Layout per microbatch with its kept and duplicated tokens, after checking that the
    partition keeps every forest token once, places microbatches on existing ranks and keeps
    sharing windows on one rank.

    Returns:
        layouts, kept_mb int32 [N_u] (the microbatch keeping each token), topological order.
    """
    specs = partition.microbatches
    layouts = [_Layout(mb=m, spec=sp, kept_tok=_kept_tokens(forest, sp, m, k)) for m, sp in enumerate(specs)]
    for L in layouts:
        dup = _kept_tokens(forest, L.spec, L.mb, k, "dup_ranges")
        L.dup_tok = np.unique(dup)
        if L.dup_tok.shape[0] != dup.shape[0]:
            raise PlanningError(f"partition.microbatches[{L.mb}].dup_ranges: expected distinct tokens, got a repeat")
    kept_mb = np.full(forest.unique_tokens, -1, np.int32)
    for L in layouts:
        kept_mb[L.kept_tok] = L.mb
        L.kept_mb = kept_mb
    if sum(L.kept_tok.shape[0] for L in layouts) != forest.unique_tokens or (kept_mb < 0).any():
        for L in layouts:  # slow path, only to name the culprit
            if (kept_mb[L.kept_tok] != L.mb).any() or np.unique(L.kept_tok).shape[0] != L.kept_tok.shape[0]:
                raise PlanningError(f"partition.microbatches[{L.mb}].ranges: expected each forest token kept once, got a repeat")
        raise PlanningError(f"partition: expected every forest token kept, token {int(np.flatnonzero(kept_mb < 0)[0])} is in no microbatch")
    for m, sp in enumerate(specs):
        if not 0 <= sp.rank < cfg.world_size:
            raise PlanningError(f"partition.microbatches[{m}].rank: expected 0 <= rank < {cfg.world_size}, got {sp.rank}")
    topo = _topological(specs)
    for m, sp in enumerate(specs):
        if sp.parent >= 0 and sp.shared and not cfg.windows:
            raise PlanningError(f"partition.microbatches[{m}].shared: expected False with windows off, got True")
        if sp.parent >= 0 and sp.shared and specs[sp.parent].rank != sp.rank and not cfg.crossing:
            raise PlanningError(
                f"partition.microbatches[{m}].rank: expected {specs[sp.parent].rank} (a sharing window stays on "
                f"its parent's rank without cross_rank_windows in a lock-step plan), got {sp.rank}"
            )
    return layouts, kept_mb, topo


def _context(forest: Forest, tix: _TokenIndex, layouts: list[_Layout], kept_mb: np.ndarray, topo: list[int],
             k: SimpleNamespace) -> None:
    """Fill every layout's ctx_tok, children first: the root paths of its piece roots and what
    its shared children need that it does not hold itself."""
    needs: list[dict[int, int]] = [dict() for _ in layouts]
    for m in reversed(topo):
        L = layouts[m]
        if L.dup_tok.shape[0] and (kept_mb[L.dup_tok] == m).any():
            raise PlanningError(f"partition.microbatches[{m}].dup_ranges: expected tokens the microbatch does not keep, got a kept one")
        pred = tix.pred[np.concatenate([L.kept_tok, L.dup_tok])]
        pred = pred[pred >= 0]
        attach = pred[~L.owns(pred, kept_mb)]
        _path_need(tix, np.unique(attach).tolist(), needs[m])
        ctx = _need_tokens(forest, needs[m], k)
        L.ctx_tok = ctx[~L.owns(ctx, kept_mb)] if ctx.shape[0] else ctx
        if L.ctx_tok.shape[0] and L.spec.parent < 0:
            raise PlanningError(f"partition.microbatches[{m}]: has pieces below other microbatches' rows, expected a parent")
        if L.shared:  # the parent provides this context: its own rows, else context it imports too
            rest = L.ctx_tok[~layouts[L.spec.parent].owns(L.ctx_tok, kept_mb)]
            if rest.shape[0]:
                seg = tix.seg[rest]
                last = np.flatnonzero(np.append(seg[1:] != seg[:-1], True))  # deepest token per segment
                _path_need(tix, rest[last].tolist(), needs[L.spec.parent])


def _windows(layouts: list[_Layout], topo: list[int], k: SimpleNamespace) -> None:
    """Sharing windows: every window child's import rows in its parent's extended rows, and every
    parent's sorted export rows."""
    for m in topo:
        L = layouts[m]
        if not L.shared:
            continue
        P = layouts[L.spec.parent]
        rows = P.ext_rows(L.ctx_tok)
        if (rows < 0).any():
            raise PlanningError(f"microbatch {m}: parent {P.mb} lacks context token {int(L.ctx_tok[np.flatnonzero(rows < 0)[0]])}")
        L.import_row = rows.astype(np.int32)
        P.export_parts.append(rows)
    for L in layouts:
        if L.export_parts:
            L.export_rows = k.sorted_union(np.concatenate(L.export_parts).astype(np.int64), L.num_rows + L.ctx_tok.shape[0])


def _schedules(layouts: list[_Layout], tix: _TokenIndex, cfg: PlanConfig, topo: list[int], k: SimpleNamespace
               ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Fill every layout's linear-attention schedule (min_calls.schedule); returns each
    microbatch's (extended-row parent, depth) int32 [R + I]."""
    # Ablation: states consumed at unaligned depths by window children split the owner's sequence.
    state_after = [np.zeros(L.num_rows, np.uint8) for L in layouts]
    if not cfg.replay:
        for L in layouts:
            if L.shared:
                pred = tix.pred[L.local_tok[L.packed["seg_start"]]]
                hang = pred[(pred >= 0) & (L.local_rows(np.maximum(pred, 0)) < 0)]
                for o, r in zip(*(x.tolist() for x in _owners(layouts, L.spec.parent, hang))):
                    state_after[o][r] = 1
    ext = {}
    for m in topo:
        L = layouts[m]
        ext_parent, ext_depth = _ext_parent_depth(L, tix, k)
        ext[m] = (ext_parent, ext_depth)
        P = L.packed
        L.sched = k.schedule(
            P["seg_start"], P["seg_length"], P["seg_parent"], P["seg_continues"],
            ext_parent, ext_depth, state_after[m], cfg.chunk_size, cfg.replay,
        )
    return ext


def _state_sources(layouts: list[_Layout]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every sequence's initial state, resolved to the microbatch that computes it: (StateSource
    kind, state) int32 [Q] per microbatch. Local states get ids in order of first use (after any
    already handed out to importers); imported ones are listed in the importer's state_imports
    and the exporter's export_states."""
    sources = []
    for L in layouts:
        R = L.num_rows
        inits = L.sched[3]
        kinds = np.where(inits < 0, plan_pb2.StateSource.ZERO,
                         np.where(inits < R, plan_pb2.StateSource.LOCAL, plan_pb2.StateSource.IMPORTED)).astype(np.int32)
        sids = np.zeros(inits.shape[0], np.int32)
        loc = np.flatnonzero((inits >= 0) & (inits < R))
        if loc.shape[0]:
            u, first, inv = np.unique(inits[loc], return_index=True, return_inverse=True)
            ids = np.empty(u.shape[0], np.int64)
            for j in np.argsort(first, kind="stable").tolist():  # first use order
                ids[j] = L.states.setdefault(int(u[j]), len(L.states))
            sids[loc] = ids[inv]
        imp = np.flatnonzero(inits >= R)
        if imp.shape[0]:
            imp_index: dict[tuple[int, int], int] = {}
            owners = _owners(layouts, L.spec.parent, L.ctx_tok[inits[imp] - R])
            for q, o, r in zip(imp.tolist(), *(x.tolist() for x in owners)):
                O = layouts[o]
                sid = O.states.setdefault(r, len(O.states))
                O.export_states.add(sid)
                key = (o, sid)
                if key not in imp_index:
                    imp_index[key] = len(L.state_imports)
                    L.state_imports.append(key)
                sids[q] = imp_index[key]
        sources.append((kinds, sids))
    return sources


@dataclass(slots=True)
class _LogprobMap:
    """The step's log-prob entries grouped by microbatch (`build_kernels.lp_grouped`)."""

    bounds: list[int]
    """Entries bounds[m]:bounds[m+1] belong to microbatch m."""
    columns: tuple
    """lp_grouped's output: bounds, row, label, traj, pos, loss mask, advantage, old, ref."""
    fields: tuple
    """(Microbatch field, dtype, column) of every log-prob field the plan carries."""


def _logprob_map(forest: Forest, cfg: PlanConfig, k: SimpleNamespace, kept_mb, kept_row, M: int) -> _LogprobMap:
    """Log-prob map, grouped by the microbatch keeping each entry's logits row."""
    none = np.zeros(0, np.float32)
    lp = k.lp_grouped(
        forest.traj_offset, forest.traj_seg, forest.seg_parent, forest.seg_offset, forest.seg_depth,
        forest.seg_length, forest.loss_mask, cfg.all_positions, kept_mb, kept_row, forest.tokens, M,
        forest.advantages, none if forest.old_logprobs is None else forest.old_logprobs,
        none if forest.ref_logprobs is None else forest.ref_logprobs,
    )
    fields = (
        ("lp_row", "int32", 1), ("lp_label", "int32", 2), ("lp_traj", "int32", 3), ("lp_pos", "int32", 4),
        ("lp_loss_mask", "uint8", 5), ("lp_advantage", "float32", 6),
    ) + (("lp_old_logprob", "float32", 7),) * (forest.old_logprobs is not None) + (
        ("lp_ref_logprob", "float32", 8),) * (forest.ref_logprobs is not None)
    return _LogprobMap(bounds=lp[0].tolist(), columns=lp, fields=fields)


def _rank_orders(partition: Partition, cfg: PlanConfig) -> tuple[list[list[tuple[str, int]]], list[list[int]]]:
    """Every rank's steps (the partition's, else depth-first) and its microbatches in order of
    first step, after checking that each microbatch has one F and one B step on its own rank."""
    specs = partition.microbatches
    M = len(specs)
    steps = partition.rank_steps if any(partition.rank_steps) else _default_steps(specs, cfg.world_size)
    if len(steps) != cfg.world_size:
        raise PlanningError(f"partition.rank_steps: expected {cfg.world_size} ranks, got {len(steps)}")
    placed = np.zeros(M, np.int64)
    rank_order: list[list[int]] = []
    for r in range(cfg.world_size):
        order: list[int] = []
        for kind, m in steps[r]:
            if m == -1:  # a stand-in (checked against the phases in `_phases`)
                if not cfg.lockstep:
                    raise PlanningError(f"partition.rank_steps[{r}]: expected no stand-ins (microbatch -1) in a free plan "
                                        f"(cfg.lockstep false)")
                continue
            if not 0 <= m < M or specs[m].rank != r:
                raise PlanningError(f"partition.rank_steps[{r}]: microbatch {m} is not placed on rank {r}")
            if kind not in ("F", "B"):
                raise PlanningError(f"partition.rank_steps[{r}]: expected step kind 'F' or 'B', got {kind!r}")
            if placed[m] == 0:
                order.append(m)
            placed[m] += 1
        rank_order.append(order)
    if (placed != 2).any():
        raise PlanningError(f"partition.rank_steps: microbatch {int(np.flatnonzero(placed != 2)[0])} must have one F and one B step")
    return steps, rank_order


def _serialise(msg: plan_pb2.Microbatch, L: _Layout, forest: Forest, cfg: PlanConfig, k: SimpleNamespace,
               ext: tuple[np.ndarray, np.ndarray], source: tuple[np.ndarray, np.ndarray], lp: _LogprobMap,
               occ_seg: np.ndarray) -> MicrobatchArrays:
    """Write microbatch L into `msg`; returns the MicrobatchArrays that decoding `msg` gives."""
    P = L.packed
    R = L.num_rows
    ext_parent, ext_depth = ext
    msg.id, msg.num_rows, msg.recompute = L.mb, R, bool(L.spec.recompute)
    tokens_R = forest.tokens[L.local_tok]
    occ_R = k.row_occurrence(P["row_seg"], L.seg_forest, L.seg_dup, occ_seg)
    conv_RJ = k.conv_ancestors(ext_parent, R, cfg.conv_kernel)
    offs, ranges = k.attn_ranges(P["seg_start"], P["seg_length"], P["seg_parent"], P["row_parent"], ext_parent)
    seg_tree = forest.seg_tree[L.seg_forest]
    for name, a, dtype in (
        ("tokens", tokens_R, "int32"), ("depth", P["row_depth"], "int32"), ("occurrence", occ_R, "int32"),
        ("seg_start", P["seg_start"], "int32"), ("seg_length", P["seg_length"], "int32"),
        ("seg_parent", P["seg_parent"], "int32"), ("seg_tree", seg_tree, "int32"), ("seg_forest", L.seg_forest, "int32"),
        ("seg_forest_offset", L.seg_forest_offset, "int32"), ("seg_duplicated", L.seg_dup, "uint8"),
        ("conv_ancestors", conv_RJ, "int32"), ("attn_offsets", offs, "int32"), ("attn_ranges", ranges, "int32"),
    ):
        setattr(msg, name, pk(a, dtype))

    _, _, _, _, q_call, _, r_rows, seq_of_row = L.sched
    n_calls = int(q_call.max()) + 1 if q_call.shape[0] else 0
    # state exports: (sequence, depth, state) of every state this microbatch computes
    st_rows = np.fromiter(L.states.keys(), np.int64, len(L.states))
    st_ids = np.fromiter(L.states.values(), np.int64, len(L.states))
    ex_seq = seq_of_row[st_rows].astype(np.int64)
    ex_depth = ext_depth[st_rows].astype(np.int64) + 1
    o = np.lexsort((st_ids, ex_depth, ex_seq))
    ex_seq, ex_depth, ex_state = ex_seq[o], ex_depth[o], st_ids[o]
    src_kind, src_state = source
    k.fill_linear_calls(msg, L.sched, src_kind, src_state, ex_seq, ex_depth, ex_state, n_calls)
    msg.num_states = len(L.states)

    if L.shared:
        msg.import_microbatch = pk(np.full(L.ctx_tok.shape[0], L.spec.parent), "int32")
        msg.import_row = pk(L.import_row, "int32")
    for e, sid in L.state_imports:
        msg.state_imports.add(microbatch=e, state=sid)
    msg.export_rows = pk(L.export_rows, "int32")
    msg.export_states = pk(sorted(L.export_states), "int32")

    a, b = lp.bounds[L.mb], lp.bounds[L.mb + 1]
    for name, dtype, col in lp.fields:
        setattr(msg, name, pk(lp.columns[col][a:b], dtype))

    replay = int(r_rows.shape[0])
    msg.replay_tokens = replay
    msg.duplicated_tokens = int(P["seg_length"][L.seg_dup == 1].sum())
    feats = microbatch_features(R, replay, P["row_depth"], ext_depth[r_rows], n_calls, lp.columns[1][a:b])
    msg.cost = float(cfg.cost_model.cost(*feats))
    return _arrays(msg, L, P, tokens_R, occ_R, conv_RJ, offs, ranges, src_kind, src_state, ex_seq, ex_depth,
                   ex_state, n_calls, seg_tree, {name: lp.columns[col][a:b] for name, _, col in lp.fields})


def _cross_edges(plan: plan_pb2.Plan, cfg: PlanConfig, arrays: dict[int, MicrobatchArrays], steps,
                 topo: list[int]) -> list[CrossEdgeArrays]:
    """Windows across ranks (plan.cross_edges): one CrossEdge per (exporter, importer) on different
    ranks, with the rows and states the importer and its own importers read of the exporter
    (`plan.window_exports.import_needs` over the step's export needs), sent at the end of the phase
    before the importer's FORWARD, their gradients at the end of the importer's BACKWARD phase
    (so the importer holds the received exports exactly while its window is open); ids in order of
    (importer, exporter), written to both ranks' cross_edges. Empty in a plan without them."""
    rank_of = {m: r for r, rs in enumerate(steps) for _, m in rs if m >= 0}
    pairs = []
    for m in topo:
        a = arrays[m]
        for x in sorted(set(a.import_microbatch.tolist()) | set(a.state_import_microbatch.tolist())):
            if rank_of[x] != rank_of[m]:
                pairs.append((m, x))
    if not pairs:
        return []
    phase_of: dict[tuple[str, int], int] = {}
    for rs in steps:
        for i, (kind, m) in enumerate(rs):
            if m >= 0:
                phase_of[kind, m] = i
    needs = export_needs(arrays, topo)  # every exporter's needs, its importers on every rank included
    edges = []
    reads: dict[int, dict] = {}
    for i, x in sorted(pairs):
        if i not in reads:
            reads[i] = import_needs(arrays[i], needs.get(i))
        nd = reads[i][x]
        edges.append(CrossEdgeArrays(
            id=len(edges), exporter=x, exporter_rank=rank_of[x], importer=i, importer_rank=rank_of[i], rows=nd.rows,
            states=nd.states, send_phase=phase_of["F", i] - 1, grad_phase=phase_of["B", i], bytes=edge_bytes(cfg.sizes, nd)))
    for e in edges:
        for r in (e.exporter_rank, e.importer_rank):
            plan.ranks[r].cross_edges.add(
                id=e.id, exporter=e.exporter, exporter_rank=e.exporter_rank, importer=e.importer,
                importer_rank=e.importer_rank, attn_rows=pk(e.rows[ATTN], "int32"), conv_rows=pk(e.rows[CONV], "int32"),
                kernel_rows=pk(e.rows[KERNEL], "int32"), states=pk(e.states, "int32"), send_phase=e.send_phase,
                grad_phase=e.grad_phase, bytes=e.bytes)
    return edges


def _phases(partition: Partition, cfg: PlanConfig, steps) -> np.ndarray | None:
    """The lock-step phases (uint8 [P]) of a cfg.lockstep partition, after checking that every
    rank has one step per phase of its kind; None for a free plan."""
    if partition.phases is None:
        if cfg.lockstep and any(steps):
            raise PlanningError("partition.phases: expected the phases of a lock-step plan (cfg.lockstep), got none")
        return np.zeros(0, np.uint8) if cfg.lockstep else None
    if not cfg.lockstep:
        raise PlanningError("partition.phases: expected none in a free plan (cfg.lockstep false)")
    phases = np.asarray(partition.phases, np.uint8)
    want = ["F" if ph == PHASE_FORWARD else "B" for ph in phases.tolist()]
    for r, rs in enumerate(steps):
        if [kind for kind, _ in rs] != want:
            raise PlanningError(f"partition.rank_steps[{r}]: expected one step per phase of partition.phases, of its kind")
    return phases


def _fill_steps(plan: plan_pb2.Plan, cfg: PlanConfig, steps, rank_order: list[list[int]],
                mbs: dict[int, plan_pb2.Microbatch], arrays: dict[int, MicrobatchArrays],
                edges: list[CrossEdgeArrays]) -> tuple[list[float], int]:
    """Write every rank's execution steps; returns the rank costs and the peak live bytes (with
    windows across ranks: the exporters' remote needs and the exports an importer holds).

    Stand-ins (microbatch -1, lock-step plans) pair up last in, first out: a BACKWARD stand-in in
    a PHASE_BACKWARD phase takes the latest unpaired FORWARD stand-in's graph (a fresh id k > 0
    for both); other FORWARD stand-ins, and those of PHASE_RECOMPUTE phases, get id 0.
    """
    phases = unpack(plan.header.lockstep_phases, "uint8").tolist()
    rank_costs = []
    peak = 0
    for r in range(cfg.world_size):
        rp = plan.ranks[r]
        local = {m: i for i, m in enumerate(rank_order[r])}
        unpaired: list[plan_pb2.ExecStep] = []
        for i, (kind, m) in enumerate(steps[r]):
            step = rp.steps.add(kind=plan_pb2.ExecStep.FORWARD if kind == "F" else plan_pb2.ExecStep.BACKWARD,
                                microbatch=local[m] if m >= 0 else -1)
            if m >= 0:
                continue
            if phases[i] == PHASE_FORWARD:
                unpaired.append(step)
            elif phases[i] == PHASE_BACKWARD:
                if not unpaired:
                    raise PlanningError(f"partition.rank_steps[{r}][{i}]: a BACKWARD stand-in without an earlier FORWARD stand-in")
                step.standin = unpaired.pop().standin = len(rp.steps)  # unique on the rank, > 0
        rank_costs.append(float(sum(mbs[m].cost for m in rank_order[r])))
        real = [(kind == "F", m) for kind, m in steps[r] if m >= 0]
        held = held_bytes(edges, r, len(steps[r]))[[i for i, (_, m) in enumerate(steps[r]) if m >= 0]] if edges else None
        _, rank_peak = rank_live_bytes(cfg.sizes, {m: arrays[m] for m in rank_order[r]}, real,
                                       sent=sent_needs(edges, r), remote=remote_imports(edges, r), held=held)
        peak = max(peak, rank_peak)
    return rank_costs, peak


def _fill_lockstep_stats(plan: plan_pb2.Plan, phases: np.ndarray, edges: list[CrossEdgeArrays]) -> None:
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


def _fill_stats(st: plan_pb2.PlanStats, forest: Forest, cfg: PlanConfig, layouts: list[_Layout],
                mbs: dict[int, plan_pb2.Microbatch], rank_costs: list[float], peak: int,
                edges: list[CrossEdgeArrays]) -> None:
    """The plan report (DESIGN §4.2): token counts, compression, costs, makespan, live memory,
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


def _arrays(msg, L: _Layout, P: dict, tokens_R, occ_R, conv_RJ, offs, ranges, src_kind, src_state, ex_seq, ex_depth,
            ex_state, n_calls: int, seg_tree, lp_cols: dict) -> MicrobatchArrays:
    """The MicrobatchArrays that `plan.decode.decode_microbatch(msg)` returns, from the
    builder's own arrays (no decoding pass; tests/planner_service/test_plan_builder.py compares the two)."""
    q_start, q_end, q_depth, _, q_call, r_off, r_rows, _ = L.sched
    calls = []
    ex_seq = np.asarray(ex_seq, np.int64)
    for c in range(n_calls):
        seqs = np.flatnonzero(q_call == c)
        lens = r_off[seqs + 1] - r_off[seqs]
        pos = np.full(q_call.shape[0], -1, np.int64)
        pos[seqs] = np.arange(seqs.shape[0])
        sel = np.flatnonzero(pos[ex_seq] >= 0) if ex_seq.shape[0] else np.zeros(0, np.int64)
        calls.append(LinearCallArrays(
            row_start=q_start[seqs].astype(np.int64), row_end=q_end[seqs].astype(np.int64),
            start_depth=q_depth[seqs].astype(np.int64), init_kind=np.asarray(src_kind, np.int64)[seqs],
            init_state=np.asarray(src_state, np.int64)[seqs],
            replay_offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            replay_rows=np.concatenate([r_rows[r_off[q]:r_off[q + 1]] for q in seqs]).astype(np.int64) if seqs.shape[0] else np.zeros(0, np.int64),
            export_seq=pos[ex_seq[sel]], export_depth=np.asarray(ex_depth, np.int64)[sel],
            export_state=np.asarray(ex_state, np.int64)[sel],
        ))
    I = L.ctx_tok.shape[0] if L.shared else 0
    return MicrobatchArrays(
        id=int(msg.id), num_rows=L.num_rows, num_imports=I, num_states=len(L.states), recompute=bool(L.spec.recompute),
        tokens=tokens_R, depth=P["row_depth"], occurrence=occ_R, seg_start=P["seg_start"], seg_length=P["seg_length"],
        seg_parent=P["seg_parent"], seg_tree=seg_tree, seg_forest=L.seg_forest, seg_forest_offset=L.seg_forest_offset,
        seg_duplicated=L.seg_dup, conv_ancestors=conv_RJ, attn_offsets=offs, attn_ranges=ranges, linear_calls=calls,
        import_microbatch=np.full(I, L.spec.parent, np.int32), import_row=L.import_row if I else np.zeros(0, np.int32),
        state_import_microbatch=np.array([o for o, _ in L.state_imports], np.int32),
        state_import_state=np.array([sid for _, sid in L.state_imports], np.int32),
        export_rows=L.export_rows, export_states=np.array(sorted(L.export_states), np.int32),
        lp_row=lp_cols["lp_row"], lp_label=lp_cols["lp_label"], lp_traj=lp_cols["lp_traj"], lp_pos=lp_cols["lp_pos"],
        lp_loss_mask=lp_cols["lp_loss_mask"], lp_advantage=lp_cols["lp_advantage"],
        lp_old_logprob=_optional(lp_cols, "lp_old_logprob"), lp_ref_logprob=_optional(lp_cols, "lp_ref_logprob"),
        replay_tokens=int(msg.replay_tokens), duplicated_tokens=int(msg.duplicated_tokens), cost=float(msg.cost),
    )


def _optional(lp_cols: dict, name: str) -> np.ndarray | None:
    """An optional log-prob column as decode_microbatch reads it: None when absent from entries."""
    a = lp_cols.get(name, np.zeros(0, np.float32))
    return a if a.shape[0] or not lp_cols["lp_row"].shape[0] else None


def _fill_header(h: plan_pb2.PlanHeader, forest: Forest, cfg: PlanConfig) -> None:
    h.version = PLAN_VERSION
    h.step_id = forest.batch_id
    p = h.params
    p.world_size = cfg.world_size
    p.microbatch_tokens = cfg.microbatch_tokens
    p.memory_tokens = cfg.memory_tokens
    p.chunk_size = cfg.chunk_size
    p.conv_kernel = cfg.conv_kernel
    p.vocab_size = forest.vocab_size
    p.sharing = cfg.sharing
    p.windows = cfg.windows
    p.replay = cfg.replay
    p.logprob_positions = plan_pb2.LOGPROB_POSITIONS_ALL if cfg.all_positions else plan_pb2.LOGPROB_POSITIONS_LOSS
    p.lockstep = cfg.lockstep
    p.cross_rank_windows = cfg.crossing
    cfg.sizes.fill(p.memory, cfg.memory_tokens)
    p.memory.model = cfg.model_name
    p.memory.dtype = cfg.dtype
    # the defaults stay unset, so that plans without checkpointing are the bytes they were
    p.memory.activation_checkpointing = "" if cfg.activation_checkpointing == "none" else cfg.activation_checkpointing
    p.memory.head = "" if cfg.head == "full" else cfg.head
    cfg.cost_model.fill(p.cost_model, transfer=cfg.crossing)
    n = h.normalizers
    T = forest.num_trajectories
    per_traj = loss_per_trajectory(forest.traj_offset, forest.loss_mask).astype(np.float64)
    n.total_loss_tokens = float(per_traj.sum())
    n.num_trajectories = T
    n.traj_loss_tokens = pk(per_traj, "float32")
    weight = forest.weight if forest.weight.shape[0] == T else np.ones(T, np.float32)
    n.traj_weight = pk(weight, "float32")
    h.trajectory_ids.extend(forest.traj_ids)
    h.trajectory_lengths = pk(forest.traj_length(), "int32")
    h.tree_ids.extend(forest.tree_ids)
    if forest.policy_version is not None:
        h.policy_version = forest.policy_version
    reward = forest.reward if forest.reward.shape[0] == T else np.zeros(T, np.float32)
    h.trajectory_rewards = pk(reward, "float32")
