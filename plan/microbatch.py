"""Decode a plan microbatch once into numpy arrays, with the bounds checks that make them safe to index.

    arrays = decode_microbatch(mb, params)      # MicrobatchArrays, or PlanValidationError naming the field

Linear in the microbatch's size, it guarantees only what indexing needs: every array has the
length its table implies, row indices in range (local [0, R), extended [0, R + I)), state
references to existing entries, token ids in the vocabulary. A whole slice: `plan.decode`; the
semantics: `plan.slice_check`, `plan.validator` (docs/design/plan-contract.md).
Legend: R local rows, I imported rows, S segments, P log-prob entries, N sequences of a call,
E state exports of a call, Q imported states, K conv kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.slice_kernels import (BAD_EXPORT_STATE, BAD_REPLAY_ROW, BAD_ROW_RANGE, BAD_STATE_ID, BAD_STATE_KIND, LOCAL,
                                 call_bounds, outside)


class PlanValidationError(ValueError):
    """A plan that breaks the contract; the message names the offending microbatch and field."""


def _fail(where: str, msg: str):
    raise PlanValidationError(f"{where}: {msg}")


@dataclass(slots=True, kw_only=True)
class LinearCallArrays:
    """One varlen linear-attention call, its sequences as columns."""

    row_start: np.ndarray
    """int64 [N] first kept local row of each sequence."""
    row_end: np.ndarray
    """int64 [N] end (exclusive) of its kept rows."""
    start_depth: np.ndarray
    """int64 [N] depth of its first token (first replay row, else row_start)."""
    init_kind: np.ndarray
    """int64 [N] ZERO / LOCAL / IMPORTED."""
    init_state: np.ndarray
    """int64 [N] local state id (LOCAL) or index into the state imports (IMPORTED)."""
    replay_offsets: np.ndarray
    """int64 [N+1] sequence n's replay rows are replay_rows[replay_offsets[n]:replay_offsets[n+1]]."""
    replay_rows: np.ndarray
    """int64 [*] extended rows re-run at the head of each sequence (outputs discarded)."""
    export_seq: np.ndarray
    """int64 [E] sequence of each exported state."""
    export_depth: np.ndarray
    """int64 [E] depth of the boundary (the state after all tokens of depth < it)."""
    export_state: np.ndarray
    """int64 [E] state-table id each export fills."""

    @property
    def num_sequences(self) -> int:
        return int(self.row_start.shape[0])


@dataclass(slots=True, kw_only=True)
class MicrobatchArrays:
    """Every array of one plan microbatch, decoded and bounds-checked."""

    id: int
    num_rows: int
    num_imports: int
    num_states: int
    recompute: bool
    tokens: np.ndarray
    """int32 [R]."""
    depth: np.ndarray
    """int32 [R]."""
    occurrence: np.ndarray
    """int32 [R]."""
    seg_start: np.ndarray
    """int32 [S]; seg_length, seg_parent, seg_tree, seg_forest, seg_forest_offset likewise."""
    seg_length: np.ndarray
    seg_parent: np.ndarray
    seg_tree: np.ndarray
    seg_forest: np.ndarray
    seg_forest_offset: np.ndarray
    seg_duplicated: np.ndarray
    """uint8 [S]."""
    conv_ancestors: np.ndarray
    """int32 [R, K-1] extended rows, -1 = zero padding."""
    attn_offsets: np.ndarray
    """int32 [S+1]."""
    attn_ranges: np.ndarray
    """int32 [n, 2] half-open extended-row ranges."""
    linear_calls: list[LinearCallArrays]
    import_microbatch: np.ndarray
    """int32 [I] exporter of each imported row."""
    import_row: np.ndarray
    """int32 [I] its extended row in the exporter."""
    state_import_microbatch: np.ndarray
    """int32 [Q] exporter of each imported state."""
    state_import_state: np.ndarray
    """int32 [Q] its id in the exporter's state table."""
    export_rows: np.ndarray
    """int32 [*] extended rows later microbatches import."""
    export_states: np.ndarray
    """int32 [*] states later microbatches import."""
    lp_row: np.ndarray
    """int32 [P] local row whose logits predict the entry."""
    lp_label: np.ndarray
    lp_traj: np.ndarray
    lp_pos: np.ndarray
    lp_loss_mask: np.ndarray
    """uint8 [P]."""
    lp_advantage: np.ndarray
    """float32 [P]."""
    lp_old_logprob: np.ndarray | None
    """float32 [P], None when the batch has none."""
    lp_ref_logprob: np.ndarray | None
    replay_tokens: int
    duplicated_tokens: int
    cost: float

    @property
    def where(self) -> str:
        return f"microbatch {self.id}"

    @property
    def num_segments(self) -> int:
        return int(self.seg_start.shape[0])

    @property
    def num_logprobs(self) -> int:
        return int(self.lp_row.shape[0])

    @property
    def num_replay_rows(self) -> int:
        """Replay rows of all linear calls (the computed rows beyond num_rows)."""
        return sum(int(c.replay_rows.shape[0]) for c in self.linear_calls)


def _outside(a: np.ndarray, lo: int, hi: int) -> bool:
    return outside(a.reshape(-1), lo, hi)


def _decode_calls(calls, where: str, R: int, I: int, Q: int, num_states: int) -> list[LinearCallArrays]:
    """Every linear call of a microbatch: one pass over the repeated messages (Python attribute
    reads), one bounds check over all sequences, then each call's columns as views."""
    rows, raw, exports, seq_offsets = [], [], [], [0]
    for call in calls:
        for q in call.sequences:
            st = q.init_state
            if q.exports:
                n = len(rows)
                exports.extend((n, e.depth, e.state) for e in q.exports)
            rows.append((q.row_start, q.row_end, q.start_depth, st.kind, st.state))
            raw.append(q.replay_rows)
        seq_offsets.append(len(rows))
    N = len(rows)
    row_start, row_end, start_depth, kind, state = np.array(rows, np.int64).reshape(N, 5).T.copy()
    nbytes = np.fromiter(map(len, raw), np.int64, N)
    seq_offsets = np.array(seq_offsets, np.int64)

    def name(n: int) -> str:  # sequence n of the microbatch, as its call and index in it
        c = int(np.searchsorted(seq_offsets, n, side="right")) - 1
        return f"{where}.linear_calls[{c}].sequences[{n - int(seq_offsets[c])}]"

    if (nbytes % 4).any():
        n = int(np.flatnonzero(nbytes % 4)[0])
        _fail(f"{name(n)}.replay_rows", f"expected a multiple of 4 bytes (int32 x 1), got {int(nbytes[n])}")
    replay_offsets = np.zeros(N + 1, np.int64)
    np.cumsum(nbytes // 4, out=replay_offsets[1:])
    replay_rows = unpack(b"".join(raw), "int32").astype(np.int64)
    ex = np.array(exports, np.int64).reshape(-1, 3)
    export_seq, export_depth, export_state = ex.T.copy()
    code, n, value = call_bounds(row_start, row_end, kind, state, replay_offsets, replay_rows, export_seq, export_state,
                                 R, R + I, num_states, Q)
    if code == BAD_ROW_RANGE:
        _fail(name(n), f"expected 0 <= row_start < row_end <= {R}, got [{row_start[n]}, {row_end[n]})")
    if code == BAD_REPLAY_ROW:
        _fail(f"{name(n)}.replay_rows", f"expected extended rows in [0, {R + I}), got {value}")
    if code == BAD_STATE_KIND:
        _fail(f"{name(n)}.init_state.kind", f"expected ZERO, LOCAL or IMPORTED, got {value}")
    if code == BAD_STATE_ID:
        what, limit = ("num_states", num_states) if kind[n] == LOCAL else ("len(state_imports)", Q)
        _fail(f"{name(n)}.init_state", f"expected a state id < {what} = {limit}, got {value}")
    if code == BAD_EXPORT_STATE:
        _fail(f"{name(n)}.exports", f"expected state ids in [0, {num_states}), got {value}")
    out = []
    e_offsets = np.searchsorted(export_seq, seq_offsets)
    for c in range(len(seq_offsets) - 1):
        q0, q1, e0, e1 = int(seq_offsets[c]), int(seq_offsets[c + 1]), int(e_offsets[c]), int(e_offsets[c + 1])
        r0, r1 = int(replay_offsets[q0]), int(replay_offsets[q1])
        out.append(LinearCallArrays(
            row_start=row_start[q0:q1], row_end=row_end[q0:q1], start_depth=start_depth[q0:q1],
            init_kind=kind[q0:q1], init_state=state[q0:q1], replay_offsets=replay_offsets[q0 : q1 + 1] - r0,
            replay_rows=replay_rows[r0:r1], export_seq=export_seq[e0:e1] - q0, export_depth=export_depth[e0:e1],
            export_state=export_state[e0:e1]))
    return out


def decode_microbatch(mb: plan_pb2.Microbatch, params: plan_pb2.PlanParams) -> MicrobatchArrays:
    """Unpack and bounds-check one microbatch (linear time).

    Raises:
        PlanValidationError: a field of the wrong byte length or table size, or an index outside
            its table, naming the microbatch and field.
    """
    w = f"microbatch {mb.id}"
    R = int(mb.num_rows)
    if R < 0:
        _fail(f"{w}.num_rows", f"expected >= 0, got {R}")

    def arr(name: str, dtype: str, n: int | None, width: int = 1) -> np.ndarray:
        try:
            a = unpack(getattr(mb, name), dtype, width=width, name=f"{w}.{name}")
        except ValueError as exc:
            raise PlanValidationError(str(exc)) from None
        if width > 1 and a.ndim == 1:
            a = a.reshape(0, width)
        if n is not None and a.shape[0] != n:
            _fail(f"{w}.{name}", f"expected {n} entries, got {a.shape[0]}")
        return a

    tokens = arr("tokens", "int32", R)
    seg_start = arr("seg_start", "int32", None)
    S = seg_start.shape[0]
    import_mb = arr("import_microbatch", "int32", None)
    I = import_mb.shape[0]
    J = params.conv_kernel - 1
    if J > 0:
        conv = arr("conv_ancestors", "int32", R, width=J).reshape(R, J)
    else:
        if len(mb.conv_ancestors):
            _fail(f"{w}.conv_ancestors", f"expected empty for conv_kernel {params.conv_kernel}, got {len(mb.conv_ancestors)} bytes")
        conv = np.zeros((R, 0), np.int32)
    lp_row = arr("lp_row", "int32", None)
    P = lp_row.shape[0]

    def optional(name: str) -> np.ndarray | None:
        a = arr(name, "float32", None)
        if a.shape[0] not in (0, P):
            _fail(f"{w}.{name}", f"expected {P} entries or none, got {a.shape[0]}")
        return a if a.shape[0] or not P else None

    Q = len(mb.state_imports)
    num_states = int(mb.num_states)
    if num_states < 0:
        _fail(f"{w}.num_states", f"expected >= 0, got {num_states}")
    out = MicrobatchArrays(
        id=int(mb.id), num_rows=R, num_imports=I, num_states=num_states, recompute=bool(mb.recompute),
        tokens=tokens, depth=arr("depth", "int32", R), occurrence=arr("occurrence", "int32", R),
        seg_start=seg_start, seg_length=arr("seg_length", "int32", S), seg_parent=arr("seg_parent", "int32", S),
        seg_tree=arr("seg_tree", "int32", S), seg_forest=arr("seg_forest", "int32", S),
        seg_forest_offset=arr("seg_forest_offset", "int32", S), seg_duplicated=arr("seg_duplicated", "uint8", S),
        conv_ancestors=conv, attn_offsets=arr("attn_offsets", "int32", S + 1),
        attn_ranges=arr("attn_ranges", "int32", None, width=2),
        linear_calls=_decode_calls(mb.linear_calls, w, R, I, Q, num_states),
        import_microbatch=import_mb, import_row=arr("import_row", "int32", I),
        state_import_microbatch=np.fromiter((s.microbatch for s in mb.state_imports), np.int32, Q),
        state_import_state=np.fromiter((s.state for s in mb.state_imports), np.int32, Q),
        export_rows=arr("export_rows", "int32", None), export_states=arr("export_states", "int32", None),
        lp_row=lp_row, lp_label=arr("lp_label", "int32", P), lp_traj=arr("lp_traj", "int32", P),
        lp_pos=arr("lp_pos", "int32", P), lp_loss_mask=arr("lp_loss_mask", "uint8", P),
        lp_advantage=arr("lp_advantage", "float32", P),
        lp_old_logprob=optional("lp_old_logprob"), lp_ref_logprob=optional("lp_ref_logprob"),
        replay_tokens=int(mb.replay_tokens), duplicated_tokens=int(mb.duplicated_tokens), cost=float(mb.cost),
    )
    _check_bounds(w, out, params.vocab_size)
    return out


def _check_bounds(w: str, out: MicrobatchArrays, V: int) -> None:
    """Every token id in the vocabulary, every row, state and attention range inside its table."""
    R, S, I, num_states = out.num_rows, out.num_segments, out.num_imports, out.num_states
    tokens, conv, lp_row = out.tokens, out.conv_ancestors, out.lp_row
    if _outside(tokens, 0, V):
        _fail(f"{w}.tokens", f"expected ids in [0, {V}), got {int(tokens.min())}..{int(tokens.max())}")
    if _outside(out.lp_label, 0, V):
        _fail(f"{w}.lp_label", f"expected ids in [0, {V}), got {int(out.lp_label.min())}..{int(out.lp_label.max())}")
    if _outside(conv, -1, R + I):
        _fail(f"{w}.conv_ancestors", f"expected extended rows in [0, {R + I}) or -1, got {int(conv.min())}..{int(conv.max())}")
    offs, rg = out.attn_offsets, out.attn_ranges
    if S and (offs[0] != 0 or (np.diff(offs) < 0).any() or offs[-1] != rg.shape[0]):
        _fail(f"{w}.attn_offsets", f"expected a monotone offset table from 0 to {rg.shape[0]}")
    if rg.shape[0] and ((rg[:, 0] < 0) | (rg[:, 1] <= rg[:, 0]) | (rg[:, 1] > R + I)).any():
        _fail(f"{w}.attn_ranges", f"expected non-empty ranges inside [0, {R + I})")
    if _outside(lp_row, 0, R):
        _fail(f"{w}.lp_row", f"expected local rows in [0, {R}), got {int(lp_row.min())}..{int(lp_row.max())}")
    if _outside(out.import_row, 0, np.iinfo(np.int32).max):
        _fail(f"{w}.import_row", "expected extended rows >= 0")
    if _outside(out.export_rows, 0, R + I):
        _fail(f"{w}.export_rows", f"expected extended rows in [0, {R + I})")
    if _outside(out.export_states, 0, num_states):
        _fail(f"{w}.export_states", f"expected state ids in [0, {num_states})")
