"""The oracle validator's rows: one checked microbatch, and every extended row resolved across the step.

    mb = CheckedMicrobatch(msg, params, n_trees)    # decoded (plan.microbatch), tables checked
    st = StepRows(mbs); st.resolve(m, order)        # exporters first: pred, depth, token, hash, identity

Token chains are compared through 64-bit polynomial prefix hashes (`hash_terms`, wrap-around
arithmetic; docs/design/plan-contract.md). Legend: R local rows, I imported rows, S segments.
"""
from __future__ import annotations

import numpy as np

from proto.harts.v1 import plan_pb2
from plan.microbatch import MicrobatchArrays, PlanValidationError, decode_microbatch

_HASH_BASE = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_HASH_INV = pow(_HASH_BASE, -1, 1 << 64)
_inv_powers = np.ones(1, np.uint64)


def _inv_pow(depth: np.ndarray) -> np.ndarray:
    """uint64 BASE**-depth modulo 2**64 for every entry of `depth`."""
    global _inv_powers
    need = int(depth.max()) + 1 if depth.size else 1
    if need > _inv_powers.shape[0]:
        n = max(need, 2 * _inv_powers.shape[0])
        with np.errstate(over="ignore"):
            factors = np.full(n, _HASH_INV, np.uint64)
            factors[0] = 1
            _inv_powers = np.cumprod(factors, dtype=np.uint64)
    return _inv_powers[depth]


def hash_terms(tokens: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Per-token terms of the prefix hash H(prefix) = sum_i (token_i + 1) * BASE**-i (mod 2**64)."""
    with np.errstate(over="ignore"):
        return (tokens.astype(np.uint64) + np.uint64(1)) * _inv_pow(depth)


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")



class CheckedMicrobatch:
    """Decoded arrays of one microbatch (`plan.decode`, bounds-checked) plus derived per-row facts."""

    def __init__(self, mb: plan_pb2.Microbatch, params: plan_pb2.PlanParams, n_trees: int,
                 arrays: MicrobatchArrays | None = None):
        self.msg = mb
        self.id = mb.id
        self.where = f"microbatch {mb.id}"
        a = self.arrays = arrays if arrays is not None else decode_microbatch(mb, params)
        self.R, self.S, self.I, self.P = a.num_rows, a.num_segments, a.num_imports, a.num_logprobs
        self.tokens, self.depth, self.occurrence = a.tokens, a.depth, a.occurrence
        self.seg_start, self.seg_length, self.seg_parent, self.seg_tree = a.seg_start, a.seg_length, a.seg_parent, a.seg_tree
        self.seg_forest, self.seg_forest_offset, self.seg_dup = a.seg_forest, a.seg_forest_offset, a.seg_duplicated
        self.import_mb, self.import_row = a.import_microbatch, a.import_row
        self.conv, self.attn_offsets, self.attn_ranges = a.conv_ancestors, a.attn_offsets, a.attn_ranges
        self.export_rows, self.export_states = a.export_rows, a.export_states
        self.lp_row, self.lp_label, self.lp_traj, self.lp_pos = a.lp_row, a.lp_label, a.lp_traj, a.lp_pos
        self.lp_loss_mask, self.lp_advantage = a.lp_loss_mask, a.lp_advantage
        self._check_tables(params, n_trees)

    def _check_tables(self, params: plan_pb2.PlanParams, n_trees: int) -> None:
        w, R, S, I = self.where, self.R, self.S, self.I
        if ((self.tokens < 0) | (self.tokens >= params.vocab_size)).any():
            _fail(f"{w}.tokens", f"expected ids in [0, {params.vocab_size}), got {int(self.tokens.min())}..{int(self.tokens.max())}")
        if S and ((self.seg_tree < 0) | (self.seg_tree >= n_trees)).any():
            _fail(f"{w}.seg_tree", f"expected indices into header.tree_ids (< {n_trees})")
        if (self.seg_length < 1).any():
            _fail(f"{w}.seg_length", "expected every segment to have >= 1 row")
        expect_start = np.concatenate([[0], np.cumsum(self.seg_length)[:-1]]) if S else np.zeros(0)
        if not np.array_equal(self.seg_start, expect_start) or int(self.seg_length.sum()) != R:
            _fail(f"{w}.seg_start", "expected segments to tile rows [0, num_rows) in order")
        seg_of_row = np.repeat(np.arange(S), self.seg_length)
        self.row_seg = seg_of_row
        off = np.arange(R) - self.seg_start[seg_of_row] if R else np.zeros(0, np.int64)
        if not np.array_equal(self.depth, (self.depth[self.seg_start][seg_of_row] + off) if R else self.depth):
            _fail(f"{w}.depth", "expected consecutive depths inside every segment")
        self.row_dup = self.seg_dup[seg_of_row] if R else np.zeros(0, np.uint8)
        if ((self.seg_dup == 1) & (self.seg_parent >= 0)).any():
            bad = np.flatnonzero((self.seg_dup == 1) & (self.seg_parent >= 0))
            for s in bad.tolist():
                if self.seg_dup[self.seg_parent[s]] != 1:
                    _fail(f"{w}.seg_duplicated[{s}]", "expected a duplicated segment's parent to be duplicated too")
        if (self.occurrence[self.row_dup == 1] != 0).any():
            _fail(f"{w}.occurrence", "expected 0 on duplicated rows")
        if (self.occurrence[self.row_dup == 0] < 1).any():
            _fail(f"{w}.occurrence", "expected >= 1 on kept rows (some trajectory passes through each)")
        for s in range(S):
            p = int(self.seg_parent[s])
            if not -1 <= p < s:
                _fail(f"{w}.seg_parent[{s}]", f"expected -1 or a preceding segment, got {p}")
        if I and ((self.import_row < 0).any()):
            _fail(f"{w}.import_row", "expected extended rows >= 0")
        offs = self.attn_offsets
        if S and (offs[0] != 0 or (np.diff(offs) < 0).any() or offs[-1] != self.attn_ranges.shape[0]):
            _fail(f"{w}.attn_offsets", f"expected a monotone offset table from 0 to {self.attn_ranges.shape[0]}")
        rg = self.attn_ranges
        if rg.shape[0] and ((rg[:, 0] < 0) | (rg[:, 1] <= rg[:, 0]) | (rg[:, 1] > R + I)).any():
            _fail(f"{w}.attn_ranges", f"expected non-empty ranges inside [0, {R + I})")

    def first_pred(self, s: int) -> int:
        """Extended row before segment s's first row: parent's last row, or the attention ancestry's last row."""
        p = int(self.seg_parent[s])
        if p >= 0:
            if self.depth[self.seg_start[s]] != self.depth[self.seg_start[p] + self.seg_length[p] - 1] + 1:
                _fail(f"{self.where}.depth", f"expected segment {s} to start one below its parent's last row")
            return int(self.seg_start[p] + self.seg_length[p] - 1)
        d = int(self.depth[self.seg_start[s]])
        if d == 0:
            return -1
        a, b = int(self.attn_offsets[s]), int(self.attn_offsets[s + 1])
        if b == a:
            _fail(f"{self.where}.attn_ranges", f"expected imported ancestors for root segment {s} at depth {d}, got none")
        x = int(self.attn_ranges[b - 1, 1]) - 1
        if x < self.R:
            _fail(f"{self.where}.seg_parent[{s}]", f"root segment at depth {d} must hang below an imported row, got local row {x}")
        return x


def _first_preds(mb: "CheckedMicrobatch") -> np.ndarray:
    """int64 [S] `CheckedMicrobatch.first_pred` of every segment, vectorised (same checks, same messages)."""
    start, length, par = mb.seg_start.astype(np.int64), mb.seg_length.astype(np.int64), mb.seg_parent.astype(np.int64)
    out = np.full(mb.S, -1, np.int64)
    kid = par >= 0
    pl = np.where(kid, start[np.maximum(par, 0)] + length[np.maximum(par, 0)] - 1, -1)
    bad = np.flatnonzero(kid & (mb.depth[start] != mb.depth[np.maximum(pl, 0)] + 1))
    if bad.shape[0]:
        _fail(f"{mb.where}.depth", f"expected segment {int(bad[0])} to start one below its parent's last row")
    out[kid] = pl[kid]
    for s in np.flatnonzero(~kid & (mb.depth[start] > 0)).tolist():  # roots below imported rows
        out[s] = mb.first_pred(s)
    return out

class StepRows:
    """Cross-microbatch facts: extended-row predecessors, depths, hashes, forest identities."""

    def __init__(self, mbs: dict[int, CheckedMicrobatch]):
        self.mbs = mbs
        self.pred: dict[int, np.ndarray] = {}
        self.edepth: dict[int, np.ndarray] = {}
        self.etok: dict[int, np.ndarray] = {}
        self.hash: dict[int, np.ndarray] = {}
        self.ident: dict[int, np.ndarray] = {}  # int64 (seg_forest << 32 | offset) per extended row

    def resolve(self, m: int, order: list[int]) -> None:
        """Fill per-extended-row facts of m; exporters must be resolved first (order)."""
        mb = self.mbs[m]
        R, I = mb.R, mb.I
        pred = np.full(R + I, -1, np.int64)
        depth = np.zeros(R + I, np.int64)
        tok = np.zeros(R + I, np.int64)
        ident = np.zeros(R + I, np.int64)
        h = np.zeros(R + I, np.uint64)
        depth[:R] = mb.depth
        tok[:R] = mb.tokens
        if R:
            off = np.arange(R) - mb.seg_start[mb.row_seg]
            ident[:R] = (mb.seg_forest[mb.row_seg].astype(np.int64) << 32) | (mb.seg_forest_offset[mb.row_seg] + off)
        if I:
            self._resolve_imports(mb, pred, depth, tok, ident, h)
        if mb.S:
            _resolve_local(mb, pred, depth, tok, ident, h)
        self.pred[m], self.edepth[m], self.etok[m], self.hash[m], self.ident[m] = pred, depth, tok, h, ident
        if (depth[:R] < 0).any():
            _fail(f"{mb.where}.depth", "expected depths >= 0")

    def _resolve_imports(self, mb: CheckedMicrobatch, pred, depth, tok, ident, h) -> None:
        """The imported rows [R, R + I) of mb: copied from their exporters, predecessors among them."""
        R, I = mb.R, mb.I
        e_all = mb.import_mb.astype(np.int64)
        r_all = mb.import_row.astype(np.int64)
        pe_all = np.full(I, -1, np.int64)
        for e in np.unique(e_all).tolist():
            sel = np.flatnonzero(e_all == e)
            if e not in self.pred:
                _fail(f"{mb.where}.import_microbatch[{int(sel[0])}]", f"exporter {e} is not an earlier microbatch "
                      f"of this rank (nor the exporter of a cross edge forwarded in an earlier phase)")
            rows = r_all[sel]
            n_ext = self.pred[e].shape[0]
            bad = np.flatnonzero(rows >= n_ext)
            if bad.shape[0]:
                _fail(f"{mb.where}.import_row[{int(sel[bad[0]])}]", f"expected an extended row of microbatch {e} (< {n_ext}), got {int(rows[bad[0]])}")
            bad = np.flatnonzero(~np.isin(rows, self.mbs[e].export_rows))
            if bad.shape[0]:
                _fail(f"{mb.where}.import_row[{int(sel[bad[0]])}]", f"row {int(rows[bad[0]])} is not listed in microbatch {e}'s export_rows")
            depth[R + sel] = self.edepth[e][rows]
            tok[R + sel] = self.etok[e][rows]
            ident[R + sel] = self.ident[e][rows]
            h[R + sel] = self.hash[e][rows]
            pe_all[sel] = self.pred[e][rows]
        # predecessors: the import of (exporter, exporter's predecessor row), last one listed wins
        key = (e_all << 32) | r_all
        order = np.argsort(key, kind="stable")
        skey = key[order]
        last = np.append(skey[1:] != skey[:-1], True)
        ukey, upos = skey[last], order[last]
        has = np.flatnonzero(pe_all >= 0)
        want = (e_all[has] << 32) | pe_all[has]
        j = np.minimum(np.searchsorted(ukey, want), ukey.shape[0] - 1)
        found = ukey[j] == want
        if not found.all():
            i = int(has[np.flatnonzero(~found)[0]])
            _fail(f"{mb.where}.import_row[{i}]", f"its predecessor (row {int(pe_all[i])} of microbatch {int(e_all[i])}) is not imported")
        pred[R + has] = R + upos[j]


def _resolve_local(mb: CheckedMicrobatch, pred, depth, tok, ident, h) -> None:
    """The local rows [0, R) of mb: predecessors, their depth and identity checks, prefix hashes."""
    R, S = mb.R, mb.S
    with np.errstate(over="ignore"):
        csum = np.cumsum(hash_terms(tok[:R], depth[:R]), dtype=np.uint64)
    start, length, par = mb.seg_start.astype(np.int64), mb.seg_length.astype(np.int64), mb.seg_parent.astype(np.int64)
    first = _first_preds(mb)
    pred[:R] = np.arange(R) - 1
    pred[start] = first
    x = first
    on = x >= 0
    bad = np.flatnonzero(on & (depth[np.maximum(x, 0)] != depth[start] - 1))
    if bad.shape[0]:
        s, xx = int(bad[0]), int(x[bad[0]])
        _fail(f"{mb.where}.depth", f"segment {s} starts at depth {int(depth[start[s]])} below a row of depth {int(depth[xx])}")
    fs, fo = mb.seg_forest.astype(np.int64), mb.seg_forest_offset.astype(np.int64)
    bad = np.flatnonzero(on & (fo > 0) & (ident[np.maximum(x, 0)] != ((fs << 32) | (fo - 1))))
    if bad.shape[0]:
        _fail(f"{mb.where}.seg_forest_offset[{int(bad[0])}]", "expected the predecessor to be the previous token of the same forest segment")
    # hash of each segment's predecessor row: imported, or its local parent's last row (parents first)
    before = np.where(start > 0, csum[np.maximum(start - 1, 0)], np.uint64(0))
    seg_sum = csum[start + length - 1] - before
    base = [0] * S
    mask = (1 << 64) - 1
    hx, ssum = h[np.maximum(x, 0)].tolist(), seg_sum.tolist()
    for s, p in enumerate(par.tolist()):
        if p >= 0:
            base[s] = (base[p] + ssum[p]) & mask
        elif x[s] >= 0:
            base[s] = hx[s]
    base_u = np.array(base, np.uint64)
    with np.errstate(over="ignore"):
        h[:R] = base_u[mb.row_seg] + (csum - before[mb.row_seg])
