"""Independent checker of HARTS plans (the wire contract of proto/harts/v1/plan.proto).

The test oracle of the planner's plans, and what `harts plan` and a trainer's `validate="full"`
run (the service and a trainer's default run the linear-time `plan.slice_check` instead); it never
imports the planner. Numpy plus plain Python, written from the contract, not from the builder.

    validate_plan(plan, forest_like=None)   # the whole step (all ranks)
    validate_slice(slice_)                  # one rank's slice: what a trainer can check alone

Both raise `PlanValidationError` (a ValueError) naming the microbatch and field at fault.

`forest_like` (optional) is any object with `path_tokens(t) -> int array`, `traj_offset` [T+1]
and `loss_mask` [N_e] (a planner Forest qualifies); with it the validator also checks that every
log-prob row's token chain reproduces the trajectory prefix, every label, the loss mask, and that
the plan keeps every distinct token of the batch. Token chains are compared through 64-bit
polynomial prefix hashes (wrap-around arithmetic), so a mismatch can only slip through by a hash
collision.

Lock-step plans (params.lockstep): every rank has exactly one step per phase of
header.lockstep_phases, of the phase's kind, with the stand-in pairing and recompute rules of
`plan.phases`, so every rank has the same phase count and kinds; the lock-step statistics follow
from the steps. Stand-ins are skipped by the window-order and memory rules.

Windows across ranks (lock-step plans, RankPlan.cross_edges): every rank's edges pass the
one-rank rules of `plan.cross_edges` (rows and states exactly what the importer and its own
importers read, phase order, bytes); the whole plan lists each edge identically on both of its
ranks with ids 0..E-1, its statistics count them, and rows resolve across ranks by forward phase
(an exporter before its importers), so token chains, ancestry and states are checked through the
edge as through a local window. `validate_slice` cannot see the other rank: it checks the
one-rank rules and leaves the rows that come from there to `validate_plan`.

Live memory (what must fit params.memory.memory_bytes): `plan.memory_model.rank_live_bytes`, the
function the planner uses: while microbatch m runs, its activations (with activation checkpointing
plus one recomputed block's) plus, for every open window below which it runs, the activations that
window keeps, or, when it is marked `recompute`, only the export tensors of its own rows that
`plan.window_exports.export_needs` lists (those its remote importers read included), plus the
exports it has received over cross edges and not yet answered.

Legend: R local rows, I imported rows, S segments, P log-prob entries, K conv kernel, C chunk size.
"""
from __future__ import annotations

import numpy as np

from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.cross_edges import (CrossEdgeArrays, check_plan_edges, check_rank_edges, decode_edges, held_bytes,
                              remote_imports, sent_needs, transfer_bytes)
from plan.memory_model import CHECKPOINTING, HEADS, RowSizes, rank_live_bytes
from plan.microbatch import MicrobatchArrays, PlanValidationError, decode_microbatch
from plan.header import check_header
from plan.phases import check_rank_phases, lockstep_phases, phase_counts, step_cost

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


def _hash_terms(tokens: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """Per-token terms of the prefix hash H(prefix) = sum_i (token_i + 1) * BASE**-i (mod 2**64)."""
    with np.errstate(over="ignore"):
        return (tokens.astype(np.uint64) + np.uint64(1)) * _inv_pow(depth)


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")


class _MB:
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


def _first_preds(mb: "_MB") -> np.ndarray:
    """int64 [S] `_MB.first_pred` of every segment, vectorised (same checks, same messages)."""
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


class _Step:
    """Cross-microbatch facts: extended-row predecessors, depths, hashes, forest identities."""

    def __init__(self, mbs: dict[int, _MB]):
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
        S = mb.S
        if S:
            with np.errstate(over="ignore"):
                csum = np.cumsum(_hash_terms(tok[:R], depth[:R]), dtype=np.uint64)
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
        self.pred[m], self.edepth[m], self.etok[m], self.hash[m], self.ident[m] = pred, depth, tok, h, ident
        if (depth[:R] < 0).any():
            _fail(f"{mb.where}.depth", "expected depths >= 0")


def _check_ancestry(mb: _MB, pred: np.ndarray, K: int) -> None:
    R = mb.R
    cur = pred[:R].copy()
    for j in range(K - 2, -1, -1):
        if not np.array_equal(mb.conv[:, j], cur):
            r = int(np.flatnonzero(mb.conv[:, j] != cur)[0])
            _fail(f"{mb.where}.conv_ancestors[{r}, {j}]", f"expected {int(cur[r])}, got {int(mb.conv[r, j])}")
        cur = np.where(cur >= 0, pred[np.maximum(cur, 0)], -1)
    def canonical(ranges) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for a, b in ranges:
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    got = [canonical(mb.attn_ranges[mb.attn_offsets[s] : mb.attn_offsets[s + 1]].tolist()) for s in range(mb.S)]
    chains: dict[int, list[tuple[int, int]]] = {}
    for s in range(mb.S):
        p = int(mb.seg_parent[s])
        if p >= 0:
            a = int(mb.seg_start[p])
            want = canonical(got[p] + [(a, a + int(mb.seg_length[p]))])
        else:
            x = int(pred[mb.seg_start[s]])
            if x not in chains:
                rows = []
                y = x
                while y >= 0:
                    rows.append(y)
                    y = int(pred[y])
                chains[x] = canonical((r, r + 1) for r in reversed(rows))
            want = chains[x]
        if got[s] != want:
            _fail(f"{mb.where}.attn_ranges", f"segment {s}: expected its ancestor rows {want[:4]}..., got {got[s][:4]}...")


def _check_linear(mb: _MB, st: _Step, params: plan_pb2.PlanParams, states_of: dict[int, dict[int, tuple[int, int]]]) -> None:
    """Sequences: contiguous owned ranges, replay chains, aligned starts, states available in time."""
    w, R, C = mb.where, mb.R, params.chunk_size
    pred, depth, ident = st.pred[mb.id], st.edepth[mb.id], st.ident[mb.id]
    owned = np.zeros(R, np.int64)
    exported: dict[int, tuple[int, int, int]] = {}  # state -> (call, depth, extended row before it)
    replay_total = 0
    for ci, call in enumerate(mb.msg.linear_calls):
        decoded = mb.arrays.linear_calls[ci]
        for qi, seq in enumerate(call.sequences):
            where = f"{w}.linear_calls[{ci}].sequences[{qi}]"
            reps = decoded.replay_rows[decoded.replay_offsets[qi] : decoded.replay_offsets[qi + 1]]
            if not 0 <= seq.row_start < seq.row_end <= R:
                _fail(where, f"expected 0 <= row_start < row_end <= {R}, got [{seq.row_start}, {seq.row_end})")
            if params.replay and len(reps) > C - 1:
                _fail(f"{where}.replay_rows", f"expected <= C-1 = {C - 1} rows, got {len(reps)}")
            if not params.replay and len(reps):
                _fail(f"{where}.replay_rows", f"expected none with replay off, got {len(reps)}")
            if ((reps < 0) | (reps >= R + mb.I)).any():
                _fail(f"{where}.replay_rows", f"expected extended rows in [0, {R + mb.I})")
            replay_total += len(reps)
            chain = np.concatenate([reps.astype(np.int64), np.arange(seq.row_start, seq.row_end)])
            if (pred[chain[1:]] != chain[:-1]).any():
                _fail(where, "expected replay rows then the range to be consecutive rows of one path")
            if depth[chain[0]] != seq.start_depth:
                _fail(f"{where}.start_depth", f"expected {int(depth[chain[0]])} (depth of its first row), got {seq.start_depth}")
            if params.replay and seq.start_depth % C:
                _fail(f"{where}.start_depth", f"expected a multiple of C = {C} with replay on, got {seq.start_depth}")
            owned[seq.row_start : seq.row_end] += 1
            before = int(pred[chain[0]])
            src = seq.init_state
            if src.kind == plan_pb2.StateSource.ZERO:
                if seq.start_depth != 0:
                    _fail(f"{where}.init_state", f"zero state at depth {seq.start_depth}, expected depth 0")
            elif src.kind == plan_pb2.StateSource.LOCAL:
                got = exported.get(src.state)
                if got is None:
                    _fail(f"{where}.init_state", f"local state {src.state} is not exported by an earlier call")
                if got[1] != seq.start_depth or got[2] != before:
                    _fail(f"{where}.init_state", f"state {src.state} is the state at depth {got[1]} of another path, expected depth {seq.start_depth} on this one")
            else:
                if not 0 <= src.state < len(mb.msg.state_imports):
                    _fail(f"{where}.init_state", f"expected an index into state_imports (< {len(mb.msg.state_imports)}), got {src.state}")
                imp = mb.msg.state_imports[src.state]
                table = states_of.get(imp.microbatch)
                if table is None or imp.state not in table:
                    _fail(f"{w}.state_imports[{src.state}]", f"microbatch {imp.microbatch} does not export state {imp.state} "
                          f"earlier (on this rank, or across a cross edge)")
                if imp.state not in set(st.mbs[imp.microbatch].export_states.tolist()):
                    _fail(f"{w}.state_imports[{src.state}]", f"state {imp.state} is not in microbatch {imp.microbatch}'s export_states")
                e_depth, e_ident = table[imp.state]
                if e_depth != seq.start_depth or before < 0 or ident[before] != e_ident:
                    _fail(f"{where}.init_state", f"imported state is at depth {e_depth} of another path, expected depth {seq.start_depth} on this one")
            end_depth = int(depth[seq.row_end - 1]) + 1
            for ex in seq.exports:
                if not seq.start_depth < ex.depth <= end_depth:
                    _fail(f"{where}.exports", f"expected a depth in ({seq.start_depth}, {end_depth}], got {ex.depth}")
                aligned = (ex.depth - seq.start_depth) % C == 0
                if not (aligned or (not params.replay and ex.depth == end_depth)):
                    _fail(f"{where}.exports", f"state at depth {ex.depth} is not at a chunk boundary of the sequence")
                if ex.state in exported or not 0 <= ex.state < mb.msg.num_states:
                    _fail(f"{where}.exports", f"state id {ex.state} repeated or outside [0, {mb.msg.num_states})")
                k = ex.depth - seq.start_depth - 1
                exported[ex.state] = (ci, ex.depth, int(chain[k]))
        # a state is readable only by later calls: register after the whole call
    if (owned != 1).any():
        r = int(np.flatnonzero(owned != 1)[0])
        _fail(f"{w}.linear_calls", f"expected every local row in exactly one sequence range, row {r} is in {int(owned[r])}")
    if len(exported) != mb.msg.num_states:
        _fail(f"{w}.num_states", f"expected {len(exported)} (exported states), got {mb.msg.num_states}")
    if replay_total != mb.msg.replay_tokens:
        _fail(f"{w}.replay_tokens", f"expected {replay_total}, got {mb.msg.replay_tokens}")
    states_of[mb.id] = {s: (d, int(ident[r])) for s, (_, d, r) in exported.items()}
    for s in mb.export_states.tolist():
        if s not in exported:
            _fail(f"{w}.export_states", f"state {s} is not exported by any sequence")
    for ci, call in enumerate(mb.msg.linear_calls):  # local states must come from strictly earlier calls
        for seq in call.sequences:
            if seq.init_state.kind == plan_pb2.StateSource.LOCAL and exported[seq.init_state.state][0] >= ci:
                _fail(f"{w}.linear_calls[{ci}]", f"reads local state {seq.init_state.state} produced in call {exported[seq.init_state.state][0]}")


def _memory_sizes(params: plan_pb2.PlanParams) -> RowSizes:
    try:
        sizes = RowSizes.from_proto(params.memory)
    except ValueError as exc:
        raise PlanValidationError(f"header.params.memory: expected the memory model's byte sizes ({exc})") from None
    want = params.memory_tokens * sizes.row_bytes
    if params.memory.memory_bytes != want:
        _fail("header.params.memory.memory_bytes", f"expected memory_tokens x (activation_row_bytes + recompute_row_bytes) = "
                                                   f"{want}, got {params.memory.memory_bytes}")
    for name, known in (("activation_checkpointing", CHECKPOINTING), ("head", HEADS)):
        value = getattr(params.memory, name)
        if value and value not in known:
            _fail(f"header.params.memory.{name}", f"expected empty or one of {', '.join(known)}, got {value!r}")
    return sizes


def _check_live_memory(where: str, params: plan_pb2.PlanParams, rank: plan_pb2.RankPlan, ids: list[int],
                       mbs: dict[int, "_MB"], edges: list[CrossEdgeArrays]) -> int:
    """Live window stack at every step under the memory model (plan.memory_model), with the
    exporters' remote needs and the received exports of cross edges (plan.cross_edges); returns
    the peak bytes."""
    sizes = _memory_sizes(params)
    arrays = {m: mb.arrays for m, mb in mbs.items()}
    real = [(i, s) for i, s in enumerate(rank.steps) if s.microbatch >= 0]  # stand-ins hold no activations
    held = held_bytes(edges, rank.rank, len(rank.steps))[[i for i, _ in real]] if edges else None
    live, peak = rank_live_bytes(sizes, arrays, [(s.kind == plan_pb2.ExecStep.FORWARD, ids[s.microbatch]) for _, s in real],
                                 sent=sent_needs(edges, rank.rank), remote=remote_imports(edges, rank.rank), held=held)
    budget = params.memory.memory_bytes
    for (i, _), x in zip(real, live):
        if x > budget:
            _fail(f"{where}.steps[{i}]", f"live window stack {x} bytes ({sizes.tokens(x)} row-equivalents) exceeds memory_bytes {budget} (memory_tokens {params.memory_tokens})")
    return peak


def _check_rank(header: plan_pb2.PlanHeader, rank: plan_pb2.RankPlan
                ) -> tuple[dict[int, _MB], list[int], int, list[CrossEdgeArrays]]:
    """One rank's tables, execution order, live memory and the one-rank rules of its cross edges.

    Returns:
        (its microbatches by id, their ids in forward order, its peak live bytes, its decoded edges).
    """
    params = header.params
    where = f"rank {rank.rank}"
    mbs: dict[int, _MB] = {}
    for mb in rank.microbatches:
        if mb.id in mbs:
            _fail(f"{where}.microbatches", f"microbatch id {mb.id} appears twice")
        mbs[mb.id] = _MB(mb, params, len(header.tree_ids))
        computed = mb.num_rows + mb.replay_tokens
        if computed > params.microbatch_tokens:
            _fail(f"microbatch {mb.id}", f"computed rows {computed} exceed microbatch_tokens {params.microbatch_tokens}")
        if int(mbs[mb.id].row_dup.sum()) != mb.duplicated_tokens:
            _fail(f"microbatch {mb.id}.duplicated_tokens", f"expected {int(mbs[mb.id].row_dup.sum())}, got {mb.duplicated_tokens}")
        if mbs[mb.id].I and not params.windows:
            _fail(f"microbatch {mb.id}.import_row", "expected no imports with windows off")
    # Execution order: each microbatch forward once then backward once, properly nested; in a
    # lock-step plan one step per phase of the phase's kind, stand-ins paired (plan.phases).
    ids = [mb.id for mb in rank.microbatches]
    phases = lockstep_phases(header)
    if params.lockstep:
        check_rank_phases(where, phases, [(s.kind, s.microbatch, s.standin) for s in rank.steps],
                          [mb.recompute for mb in rank.microbatches])
    else:
        for i, step in enumerate(rank.steps):
            if step.standin:
                _fail(f"{where}.steps[{i}]", f"expected standin 0 in a free plan (params.lockstep false), got {step.standin}")
    edges = decode_edges(rank)
    remote = remote_imports(edges, rank.rank)
    seen_f: dict[int, int] = {}
    seen_b: dict[int, int] = {}
    stack: list[int] = []
    order: list[int] = []
    for i, step in enumerate(rank.steps):
        if params.lockstep and step.microbatch == -1:
            continue
        if not 0 <= step.microbatch < len(ids):
            _fail(f"{where}.steps[{i}]", f"expected an index < {len(ids)}, got {step.microbatch}")
        m = ids[step.microbatch]
        if step.kind == plan_pb2.ExecStep.FORWARD:
            if m in seen_f:
                _fail(f"{where}.steps[{i}]", f"microbatch {m} forwarded twice")
            seen_f[m] = i
            for e in set(mbs[m].import_mb.tolist()) | {s.microbatch for s in mbs[m].msg.state_imports}:
                if e not in stack and not ((e, m) in remote and e not in mbs):  # another rank's: its edge says when
                    _fail(f"{where}.steps[{i}]", f"microbatch {m} imports from {e}, which is not an open window here")
            stack.append(m)
            order.append(m)
        else:
            if m not in seen_f or m in seen_b:
                _fail(f"{where}.steps[{i}]", f"backward of microbatch {m} without one prior forward")
            if not stack or stack[-1] != m:
                _fail(f"{where}.steps[{i}]", f"backward of {m} is not depth-first (open: {stack})")
            seen_b[m] = i
            stack.pop()
    for m in ids:
        if m not in seen_f or m not in seen_b:
            _fail(f"{where}.steps", f"microbatch {m} is not forwarded and backwarded exactly once")
    # in a lock-step plan the step index is the phase
    check_rank_edges(header, rank.rank, edges, [mbs[m].arrays for m in ids], {m: i for i, m in enumerate(ids)},
                     [(s.kind, s.microbatch) for s in rank.steps])
    peak = _check_live_memory(where, params, rank, ids, mbs, edges)
    return mbs, order, peak, edges


def _check_rows(header: plan_pb2.PlanHeader, mbs: dict[int, _MB], order: list[int], st: _Step,
                states_of: dict[int, dict[int, tuple[int, int]]]) -> None:
    """Resolve the microbatches of `order` (exporters first) and check what depends on their
    rows: ancestry, linear-attention schedules, the log-prob map's rows, export rows."""
    params = header.params
    for m in order:
        st.resolve(m, order)
        _check_ancestry(mbs[m], st.pred[m], params.conv_kernel)
        _check_linear(mbs[m], st, params, states_of)
        mb = mbs[m]
        if mb.P:
            r = mb.lp_row
            if ((r < 0) | (r >= mb.R)).any():
                _fail(f"{mb.where}.lp_row", f"expected local rows in [0, {mb.R})")
            if (mb.row_dup[r] == 1).any():
                _fail(f"{mb.where}.lp_row", "expected kept rows, got a duplicated context row")
            if not np.array_equal(mb.depth[r].astype(np.int64), mb.lp_pos.astype(np.int64) - 1):
                i = int(np.flatnonzero(mb.depth[r] != mb.lp_pos - 1)[0])
                _fail(f"{mb.where}.lp_row[{i}]", f"expected a row at depth {int(mb.lp_pos[i]) - 1} (position - 1), got depth {int(mb.depth[r[i]])}")
            if ((mb.lp_traj < 0) | (mb.lp_traj >= len(header.trajectory_ids))).any():
                _fail(f"{mb.where}.lp_traj", f"expected indices into header.trajectory_ids (< {len(header.trajectory_ids)})")
            if header.params.logprob_positions == plan_pb2.LOGPROB_POSITIONS_LOSS and (mb.lp_loss_mask != 1).any():
                _fail(f"{mb.where}.lp_loss_mask", "expected only loss positions (mask 1) in a loss-positions plan")
        rows = mb.export_rows
        if rows.shape[0] and ((rows < 0) | (rows >= mb.R + mb.I)).any():
            _fail(f"{mb.where}.export_rows", f"expected extended rows in [0, {mb.R + mb.I})")


def validate_slice(slice_: plan_pb2.PlanSlice) -> None:
    """Check one rank's slice: tables, ancestry, schedule, imports, budgets, execution order and
    the one-rank rules of its cross edges (plan.cross_edges).

    A microbatch whose rows come, directly or through its window ancestors, from another rank
    (a cross edge) cannot have its token chains, ancestry and states checked without that rank:
    validate_plan checks them.

    Raises:
        PlanValidationError: the first violated rule, naming the microbatch and field.
    """
    check_header(slice_.header)
    mbs, order, _, edges = _check_rank(slice_.header, slice_.rank)
    remote = {x for x, _ in remote_imports(edges, slice_.rank.rank)}
    alone: list[int] = []
    for m in order:
        mb = mbs[m]
        sources = set(mb.import_mb.tolist()) | {s.microbatch for s in mb.msg.state_imports}
        if sources & remote:
            remote.add(m)  # its importers depend on another rank too
        else:
            alone.append(m)
    _check_rows(slice_.header, mbs, alone, _Step(mbs), {})


def validate_plan(plan: plan_pb2.Plan, forest_like=None) -> None:
    """Check a whole plan: every rank slice, then the step-wide rules.

    Step-wide rules: microbatch ids 0..M-1 each placed exactly once; every forest token kept
    (non-duplicated) exactly once; every trajectory position with a loss term (or every position
    1..L-1 for LOGPROB_POSITIONS_ALL) has exactly one log-prob entry whose row ends the
    trajectory's prefix and whose label is the next token (through `forest_like` when given;
    otherwise consecutive entries of a trajectory must chain); normalisers and stats consistent.

    Raises:
        PlanValidationError: the first violated rule.
    """
    header = plan.header
    if header.local_tables:
        _fail("header.local_tables", "expected the step's tables in a whole plan (local tables are for slices)")
    check_header(header)
    p = header.params
    if len(plan.ranks) != p.world_size:
        _fail("ranks", f"expected {p.world_size} rank plans, got {len(plan.ranks)}")
    all_mbs: dict[int, _MB] = {}
    peak = 0
    forward: list[tuple[int, int, int]] = []  # (forward step = phase in a lock-step plan, rank, microbatch)
    edges: list[CrossEdgeArrays] = []
    for i, rank in enumerate(plan.ranks):
        if rank.rank != i:
            _fail(f"ranks[{i}].rank", f"expected {i}, got {rank.rank}")
        mbs, order, rank_peak, rank_edges = _check_rank(header, rank)
        peak = max(peak, rank_peak)
        edges += rank_edges
        for m, mb in mbs.items():
            if m in all_mbs:
                _fail(f"microbatch {m}", "placed on more than one rank")
            all_mbs[m] = mb
        ids = [mb.id for mb in rank.microbatches]
        forward += [(j, i, ids[s.microbatch]) for j, s in enumerate(rank.steps)
                    if s.microbatch >= 0 and s.kind == plan_pb2.ExecStep.FORWARD]
    M = len(all_mbs)
    if sorted(all_mbs) != list(range(M)):
        _fail("ranks", f"expected microbatch ids 0..{M - 1}, got {sorted(all_mbs)[:5]}...")
    _check_cross_edges(plan, edges)
    # Rows resolve exporters first: rank by rank in a free plan, by forward phase in a lock-step
    # plan (a cross edge's exporter forwards in an earlier phase than its importer).
    order = [m for _, _, m in (sorted(forward) if p.lockstep else sorted(forward, key=lambda x: (x[1], x[0])))]
    st_all = _Step(all_mbs)
    _check_rows(header, all_mbs, order, st_all, {})
    # Kept tokens: each forest identity once over non-duplicated rows.
    kept = [st_all.ident[m][: mb.R][mb.row_dup == 0] for m, mb in all_mbs.items()]
    kept_all = np.concatenate(kept) if kept else np.zeros(0, np.int64)
    uniq, counts = np.unique(kept_all, return_counts=True)
    if (counts > 1).any():
        x = int(uniq[np.flatnonzero(counts > 1)[0]])
        _fail("ranks", f"forest token (segment {x >> 32}, offset {x & 0xFFFFFFFF}) is kept in more than one microbatch")
    st = header.stats
    if st.unique_tokens != kept_all.shape[0]:
        _fail("header.stats.unique_tokens", f"expected {kept_all.shape[0]} kept rows, got {st.unique_tokens}")
    replay = sum(mb.msg.replay_tokens for mb in all_mbs.values())
    dup = sum(mb.msg.duplicated_tokens for mb in all_mbs.values())
    if (st.replay_tokens, st.duplicated_tokens, st.computed_tokens, st.microbatches) != (replay, dup, kept_all.shape[0] + replay + dup, M):
        _fail("header.stats", "expected replay/duplicated/computed tokens and microbatches to match the microbatches")
    if st.peak_live_bytes != peak:
        _fail("header.stats.peak_live_bytes", f"expected {peak} (live stack along the execution order), got {st.peak_live_bytes}")
    if st.peak_live_tokens != _memory_sizes(p).tokens(peak):
        _fail("header.stats.peak_live_tokens", f"expected {_memory_sizes(p).tokens(peak)} (peak_live_bytes in row-equivalents), got {st.peak_live_tokens}")
    _check_costs(plan, all_mbs)
    _check_lockstep_stats(plan)
    windows = sum(1 for mb in all_mbs.values() if mb.I)
    if st.windows != windows:
        _fail("header.stats.windows", f"expected {windows} (microbatches with imports), got {st.windows}")
    # Every copy of a forest token (kept or duplicated) carries the same token id and depth.
    ident = np.concatenate([st_all.ident[m][: mb.R] for m, mb in all_mbs.items()]) if M else np.zeros(0, np.int64)
    tok_depth = np.concatenate([np.stack([mb.tokens, mb.depth], 1) for mb in all_mbs.values()]) if M else np.zeros((0, 2), np.int32)
    order = np.argsort(ident, kind="stable")
    same = ident[order][1:] == ident[order][:-1]
    differs = (tok_depth[order][1:] != tok_depth[order][:-1]).any(axis=1)
    if (same & differs).any():
        x = int(ident[order][1:][np.flatnonzero(same & differs)[0]])
        _fail("ranks", f"copies of forest token (segment {x >> 32}, offset {x & 0xFFFFFFFF}) disagree on token id or depth")
    calls = max((len(mb.msg.linear_calls) for mb in all_mbs.values()), default=0)
    if st.linear_attention_calls != calls:
        _fail("header.stats.linear_attention_calls", f"expected {calls}, got {st.linear_attention_calls}")
    _check_logprobs(header, all_mbs, st_all, forest_like)
    if forest_like is not None:
        expect = getattr(forest_like, "unique_tokens", None)
        if expect is not None and int(expect) != kept_all.shape[0]:
            _fail("ranks", f"expected {int(expect)} distinct forest tokens kept, got {kept_all.shape[0]}")


def _check_cross_edges(plan: plan_pb2.Plan, edges: list[CrossEdgeArrays]) -> None:
    """Step-wide rules of windows across ranks: every edge listed identically by its exporter's
    and its importer's rank, ids 0..E-1 (`plan.cross_edges.check_plan_edges`), and the statistics
    that count them."""
    check_plan_edges(list(plan.ranks))
    by_id = {e.id: e for e in edges}
    E = len(by_id)
    st = plan.header.stats
    moved = np.zeros(len(plan.ranks), np.int64)
    for e in by_id.values():
        moved[[e.exporter_rank, e.importer_rank]] += 2 * e.bytes
    want = (E, 2 * sum(e.bytes for e in by_id.values()), int(moved.max()) if E else 0)
    got = (st.cross_edges, st.exchanged_bytes, st.max_rank_exchanged_bytes)
    if got != want:
        _fail("header.stats.cross_edges", f"expected (cross_edges, exchanged_bytes, max_rank_exchanged_bytes) = {want} "
              f"from the edges, got {got}")


def _rank_transfer(plan: plan_pb2.Plan) -> list[float]:
    """transfer_byte x the bytes each rank sends plus receives over its cross edges."""
    tb = plan.header.params.cost_model.transfer_byte
    return [tb * sum(2 * e.bytes for e in rank.cross_edges) for rank in plan.ranks]


def _check_costs(plan: plan_pb2.Plan, all_mbs: dict[int, "_MB"]) -> None:
    """rank_costs sum their microbatches' costs, rank_transfer_costs price their cross edges; the
    makespan statistics follow from both."""
    st, W = plan.header.stats, len(plan.ranks)
    costs = [sum(mb.cost for mb in rank.microbatches) for rank in plan.ranks]
    if len(st.rank_costs) != W or any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(st.rank_costs, costs)):
        _fail("header.stats.rank_costs", f"expected the sums of each rank's microbatch costs {costs[:4]}..., got {list(st.rank_costs)[:4]}...")
    if any(mb.msg.cost < 0 for mb in all_mbs.values()):
        _fail("microbatch cost", "expected costs >= 0")
    transfer = _rank_transfer(plan)
    got = list(st.rank_transfer_costs) or [0.0] * W
    if len(got) != W or any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(got, transfer)):
        _fail("header.stats.rank_transfer_costs", f"expected transfer_byte x each rank's exchanged bytes {transfer[:4]}..., "
              f"got {list(st.rank_transfer_costs)[:4]}...")
    top = max((c + t for c, t in zip(costs, transfer)), default=0.0)
    if abs(st.makespan - top) > 1e-9 * max(1.0, top):
        _fail("header.stats.makespan", f"expected the largest rank cost (with its transfers) {top}, got {st.makespan}")
    # a rank computes the longest trajectory's rows unless windows cross ranks; a lock-step plan's
    # phases run them in sequence either way
    step = _lockstep_makespan(plan, lockstep_phases(plan.header)) if plan.header.params.lockstep else top
    if st.makespan_lower_bound < sum(costs) / W * (1 - 1e-9) or st.makespan_lower_bound > step * (1 + 1e-9) + 1e-9:
        _fail("header.stats.makespan_lower_bound", f"expected between total / world_size = {sum(costs) / W} and the "
              f"{'lock-step makespan' if plan.header.params.lockstep else 'makespan'} {step}, got {st.makespan_lower_bound}")
    want = top / st.makespan_lower_bound if st.makespan_lower_bound > 0 else 1.0
    if abs(st.makespan_ratio - want) > 1e-9 * max(1.0, want):
        _fail("header.stats.makespan_ratio", f"expected makespan / makespan_lower_bound = {want}, got {st.makespan_ratio}")


def _lockstep_makespan(plan: plan_pb2.Plan, phases: np.ndarray) -> float:
    """The sum over phases of the slowest rank's step cost, its transfers included (plan.phases)."""
    slowest = np.zeros(phases.shape[0], np.float64)
    tb = plan.header.params.cost_model.transfer_byte
    for rank in plan.ranks:
        cost = np.zeros(phases.shape[0], np.float64)
        for i, (step, phase) in enumerate(zip(rank.steps, phases.tolist())):
            if step.microbatch >= 0:
                cost[i] = step_cost(phase, rank.microbatches[step.microbatch].cost)
        if len(rank.cross_edges):
            cost += tb * transfer_bytes(decode_edges(rank), rank.rank, phases.shape[0])
        slowest = np.maximum(slowest, cost)
    return float(slowest.sum())


def _check_lockstep_stats(plan: plan_pb2.Plan) -> None:
    """PlanStats.lockstep_*: the phase counts, and the makespan and ratio of plan.phases' cost
    model over the ranks' steps (all 0 in a free plan)."""
    st = plan.header.stats
    phases = lockstep_phases(plan.header)
    if not plan.header.params.lockstep:
        got = (st.lockstep_phases, st.lockstep_makespan, st.lockstep_ratio, st.lockstep_forward_phases,
               st.lockstep_backward_phases, st.lockstep_recompute_phases)
        if any(got):
            _fail("header.stats.lockstep_phases", f"expected no lock-step statistics in a free plan, got {got}")
        return
    counts = phase_counts(phases)
    got = (st.lockstep_forward_phases, st.lockstep_backward_phases, st.lockstep_recompute_phases)
    if st.lockstep_phases != phases.shape[0] or got != counts:
        _fail("header.stats.lockstep_phases", f"expected {phases.shape[0]} phases ({counts} forward, backward, recompute), "
              f"got {st.lockstep_phases} ({got})")
    want = _lockstep_makespan(plan, phases)
    if abs(st.lockstep_makespan - want) > 1e-9 * max(1.0, want):
        _fail("header.stats.lockstep_makespan", f"expected the sum over phases of the slowest rank's step cost (with its "
              f"transfers) {want}, "
              f"got {st.lockstep_makespan}")
    ratio = want / st.makespan if st.makespan > 0 else 1.0
    if abs(st.lockstep_ratio - ratio) > 1e-9 * max(1.0, ratio):
        _fail("header.stats.lockstep_ratio", f"expected lockstep_makespan / makespan = {ratio}, got {st.lockstep_ratio}")


def _check_logprobs(header, all_mbs: dict[int, _MB], st: _Step, forest_like) -> None:
    lengths = unpack(header.trajectory_lengths, "int32").astype(np.int64)
    T = lengths.shape[0]
    parts = [(m, mb) for m, mb in sorted(all_mbs.items()) if mb.P]
    if not parts:
        traj = pos = row_hash = label = mask = np.zeros(0, np.int64)
    else:
        traj = np.concatenate([mb.lp_traj for _, mb in parts]).astype(np.int64)
        pos = np.concatenate([mb.lp_pos for _, mb in parts]).astype(np.int64)
        label = np.concatenate([mb.lp_label for _, mb in parts]).astype(np.int64)
        mask = np.concatenate([mb.lp_loss_mask for _, mb in parts]).astype(np.int64)
        row_hash = np.concatenate([st.hash[m][mb.lp_row] for m, mb in parts])
    if ((traj < 0) | (traj >= T)).any():
        _fail("lp_traj", f"expected trajectory indices in [0, {T})")
    if ((pos < 1) | (pos >= lengths[traj] if T else pos >= 0)).any():
        _fail("lp_pos", "expected positions in [1, L) of their trajectory")
    key = traj * (int(lengths.max()) + 1 if T else 1) + pos
    order = np.argsort(key, kind="stable") if forest_like is None else None  # the chain check needs the order
    skey = key[order] if order is not None else np.sort(key)
    if (np.diff(skey) == 0).any():
        if order is None:
            order = np.argsort(key, kind="stable")
        i = int(order[np.flatnonzero(np.diff(key[order]) == 0)[0]])
        _fail("lp_pos", f"trajectory {int(traj[i])} position {int(pos[i])} has more than one log-prob entry")
    all_pos = header.params.logprob_positions == plan_pb2.LOGPROB_POSITIONS_ALL
    if all_pos and key.shape[0] != int(np.maximum(lengths - 1, 0).sum()):
        _fail("lp_pos", f"expected an entry for every position 1..L-1 ({int(np.maximum(lengths - 1, 0).sum())}), got {key.shape[0]}")
    if forest_like is None:
        # consecutive entries of one trajectory must chain: hash(row at p+1) = hash(row at p) extended by label p
        t, p, h, lab = traj[order], pos[order], row_hash[order], label[order]
        nxt = (t[1:] == t[:-1]) & (p[1:] == p[:-1] + 1)
        want = h[:-1] + _hash_terms(lab[:-1], p[:-1])  # the label at position p sits at depth p
        if (nxt & (h[1:] != want)).any():
            i = int(np.flatnonzero(nxt & (h[1:] != want))[0])
            _fail("lp_label", f"trajectory {int(t[i])} position {int(p[i])}: label or row does not chain with position {int(p[i]) + 1}")
        return
    offs = np.asarray(forest_like.traj_offset, np.int64)
    loss = np.asarray(forest_like.loss_mask).astype(np.int64)
    if offs.shape[0] != T + 1 or not np.array_equal(np.diff(offs), lengths):
        _fail("header.trajectory_lengths", "expected the forest's trajectory lengths")
    want_n = key.shape[0] if all_pos else int(loss.sum() - loss[offs[:-1]].sum()) if T else 0
    if key.shape[0] != want_n:
        _fail("lp_pos", f"expected {want_n} log-prob entries (every loss position >= 1), got {key.shape[0]}")
    g = offs[traj] + pos
    if (mask != loss[g]).any():
        _fail("lp_loss_mask", "expected the trajectory's loss mask at each entry")
    toks = np.concatenate([np.asarray(forest_like.path_tokens(t), np.int64) for t in range(T)]) if T else np.zeros(0, np.int64)
    if toks.shape[0] != offs[-1]:
        _fail("forest_like", f"expected {int(offs[-1])} trajectory tokens, got {toks.shape[0]}")
    at = np.arange(toks.shape[0]) - np.repeat(offs[:-1], lengths)
    with np.errstate(over="ignore"):
        cs = np.cumsum(_hash_terms(toks, at), dtype=np.uint64)
        start = np.where(offs[:-1] > 0, cs[np.maximum(offs[:-1] - 1, 0)], np.uint64(0)) if T else cs[:0]
        want_hash = cs[g - 1] - start[traj]
    bad = np.flatnonzero(row_hash != want_hash)
    if bad.shape[0]:
        i = int(bad[0])
        _fail("lp_row", f"trajectory {int(traj[i])} position {int(pos[i])}: the row's token chain does not reproduce the trajectory prefix")
    bad = np.flatnonzero(label != toks[g])
    if bad.shape[0]:
        i = int(bad[0])
        _fail("lp_label", f"trajectory {int(traj[i])} position {int(pos[i])}: expected label {int(toks[g[i]])}, got {int(label[i])}")
