"""The rows of every microbatch of a plan: context, local layout, windows, linear-attention calls, states.

    tix = TokenIndex(forest, k.token_index)
    lay_out(layouts[m], tix, cfg, k, kept_row)     # for m in topological order, after fill_context

The builder's stages between the partition's checks and serialisation (`build.py`); `k` is its
kernel namespace (`build._KERNELS`; docs/design/planner.md, "The builder").
Legend: N_u forest tokens, R local rows, I imported rows, Q sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

import planner_service.planner.build_kernels as bk
from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.spec import MicrobatchSpec
from proto.harts.v1 import plan_pb2


@dataclass(slots=True)
class Layout:
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


class TokenIndex:
    """Per forest token: segment, offset, depth, predecessor (flat int32 arrays [N_u])."""

    def __init__(self, forest: Forest, token_index=bk.token_index):
        self.seg, self.off, self.depth, self.pred = token_index(forest.seg_parent, forest.seg_offset, forest.seg_length,
                                                                forest.seg_depth)
        self.forest = forest


def _path_need(tix: TokenIndex, toks, need: dict[int, int]) -> None:
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


def lay_out(L: Layout, tix: TokenIndex, cfg: PlanConfig, k: SimpleNamespace, kept_row: np.ndarray) -> None:
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


def _ext_parent_depth(L: Layout, tix: TokenIndex, k: SimpleNamespace) -> tuple[np.ndarray, np.ndarray]:
    """int32 [R + I] predecessor extended row and depth of every extended row."""
    imp = L.ctx_tok if L.shared else np.zeros(0, np.int64)
    return k.ext_parent_depth(L.packed["row_parent"], L.packed["row_depth"], imp, tix.pred, tix.depth)


def _owners(layouts: list[Layout], m: int, toks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def fill_context(forest: Forest, tix: TokenIndex, layouts: list[Layout], kept_mb: np.ndarray, topo: list[int],
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


def link_windows(layouts: list[Layout], topo: list[int], k: SimpleNamespace) -> None:
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


def schedule_calls(layouts: list[Layout], tix: TokenIndex, cfg: PlanConfig, topo: list[int], k: SimpleNamespace
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


def state_sources(layouts: list[Layout]) -> list[tuple[np.ndarray, np.ndarray]]:
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


