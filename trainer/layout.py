"""Turn a decoded plan microbatch into the torch index tensors the model runs on.

    layout = layout_from_arrays(arrays, needs, chunk_size=64)  # plan.microbatch.MicrobatchArrays -> RowLayout
    layout = layout_from_sequences(seqs, conv_kernel=4, chunk_size=64)  # one segment each (parity, tests)

The layout keeps, per window kind, only the imported rows that kind reads and renumbers the plan's
extended rows `R + i` into compact tables (`WindowIO`): docs/design/execution.md ("From a slice
to tensors"), docs/design/windows.md.
Legend: R rows, S segments, J = K-1 conv ancestors, P log-prob entries, I imported rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from plan.microbatch import MicrobatchArrays, PlanValidationError
from plan.window_exports import KINDS, ExportNeeds, used_imports
from kernels.devices import to_device
from kernels.tree_attention import TreeLayout, prepare_tree_layout
from trainer.tree_ops import LinearCall


@dataclass(slots=True, kw_only=True)
class LogprobMap:
    """Per trajectory position with a log-prob entry: the row holding token i-1 and the label."""

    row: torch.Tensor
    """long [P] local row whose logits predict the position."""
    label: torch.Tensor
    """long [P] token id at the position."""
    traj: torch.Tensor
    """long [P] trajectory index (PlanHeader.trajectory_ids)."""
    pos: torch.Tensor
    """long [P] position in the trajectory (1..L-1)."""
    loss_mask: torch.Tensor
    """float32 [P] 1 where the position has a loss term."""
    advantage: torch.Tensor
    """float32 [P]."""
    old_logprob: torch.Tensor | None = None
    """float32 [P] rollout-policy log-probs, None when the batch has none."""
    ref_logprob: torch.Tensor | None = None
    """float32 [P] reference-policy log-probs, None when the batch has none."""
    rows_U: torch.Tensor | None = None
    """long [U] distinct rows of `row`, sorted: the rows whose logits the forward computes."""
    inv_P: torch.Tensor | None = None
    """long [P] index of each entry's row in rows_U."""

    def __post_init__(self) -> None:
        if self.rows_U is None:
            rows_U, inv_P = np.unique(self.row.numpy(), return_inverse=True)
            self.rows_U, self.inv_P = _long(rows_U), _long(inv_P.reshape(-1))


@dataclass(slots=True, kw_only=True)
class ImportSource:
    """Where the imported rows (or states) of one kind come from, in the importer's order."""

    exporter: np.ndarray
    """int64 [n] exporting microbatch id of each."""
    position: np.ndarray
    """int64 [n] its index in that exporter's export table of the kind (`WindowIO.export_rows`)."""


@dataclass(slots=True, kw_only=True)
class WindowIO:
    """A microbatch's sharing-window boundary: what it imports and exports (docs/design/windows.md)."""

    import_rows: dict[str, np.ndarray] = field(default_factory=lambda: {k: np.zeros(0, np.int64) for k in KINDS})
    """kind -> int64 sorted imported rows (indices into [0, I)) that the kind's consumers read."""
    import_from: dict[str, ImportSource] = field(default_factory=dict)
    """kind -> source of each of those rows; "state" -> source of each state import."""
    export_rows: dict[str, torch.Tensor] | None = None
    """kind -> long [n] rows of the kind's compact table this microbatch exports (None: no importer)."""
    export_states: torch.Tensor | None = None
    """long [n] state-table ids this microbatch exports."""

    def num_imports(self, kind: str) -> int:
        return int(self.import_rows[kind].shape[0])

    @property
    def imports_anything(self) -> bool:
        return any(self.import_rows[k].shape[0] for k in KINDS) or "state" in self.import_from


@dataclass(slots=True, kw_only=True)
class RowLayout:
    """Everything the model needs to run one microbatch's rows."""

    tokens: torch.Tensor
    """long [R] token ids."""
    depth: torch.Tensor
    """long [R] depth (RoPE position)."""
    occurrence: torch.Tensor
    """float32 [R] trajectories through each row (0 for duplicated context rows)."""
    conv_src: torch.Tensor
    """long [R, J] conv ancestor rows oldest first, in the conv table (R + conv imports = zero padding)."""
    attention: TreeLayout
    """The segments' compact ancestor ranges in the attention table (`kernels.tree_attention`),
    built once per microbatch and shared by every attention layer (and backend)."""
    linear_calls: list[LinearCall]
    """The call schedule; gather indices address the kernel-input table."""
    row_from_kept: torch.Tensor
    """long [R] row -> index into the concatenated kept outputs of all calls."""
    num_states: int
    logprobs: LogprobMap
    window: WindowIO = field(default_factory=WindowIO)

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device | str) -> "RowLayout":
        """The layout with its index tensors on `device` (in place; returns self). Call offsets and
        export positions stay on the CPU: the kernel plans its chunks from them on the host."""
        dev = torch.device(device)
        if dev.type == "cpu":
            return self
        mv = lambda t: None if t is None else to_device(t, dev)  # noqa: E731
        self.tokens, self.depth, self.occurrence = mv(self.tokens), mv(self.depth), mv(self.occurrence)
        self.conv_src, self.row_from_kept = mv(self.conv_src), mv(self.row_from_kept)
        self.attention = self.attention.to(dev)
        for call in self.linear_calls:
            call.gather_idx, call.keep_idx = mv(call.gather_idx), mv(call.keep_idx)
        lp = self.logprobs
        for name in ("row", "label", "traj", "pos", "loss_mask", "advantage", "old_logprob", "ref_logprob", "rows_U", "inv_P"):
            setattr(lp, name, mv(getattr(lp, name)))
        w = self.window
        if w.export_rows is not None:
            w.export_rows = {k: mv(v) for k, v in w.export_rows.items()}
        w.export_states = mv(w.export_states)
        return self


def _long(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.int64).copy())


def _compact(ext: np.ndarray, R: int, rows: np.ndarray, where: str) -> np.ndarray:
    """Extended rows (local < R, imported R + i, -1 = padding) -> the compact table of one kind
    (local rows, then `rows` (sorted imported indices), then the padding row)."""
    ext = np.asarray(ext, np.int64)
    out = ext.copy()
    imp = ext >= R
    if imp.any():
        i = ext[imp] - R
        j = np.minimum(np.searchsorted(rows, i), max(rows.shape[0] - 1, 0))
        if rows.shape[0] == 0 or (rows[j] != i).any():
            raise PlanValidationError(f"{where}: imported row {int(i[0]) if rows.shape[0] == 0 else int(i[rows[j] != i][0])} "
                                      "is read but not among the microbatch's imports of that kind")
        out[imp] = R + j
    out[ext < 0] = R + rows.shape[0]
    return out


def _inverse_kept(kept_rows: np.ndarray, R: int, where: str) -> torch.Tensor:
    count = np.bincount(kept_rows, minlength=R) if kept_rows.size else np.zeros(R, np.int64)
    if (count != 1).any():
        bad = int(np.nonzero(count != 1)[0][0])
        raise PlanValidationError(f"{where}: expected every row kept by exactly one linear sequence, row {bad} is kept {int(count[bad])} times")
    inv = np.empty(R, np.int64)
    inv[kept_rows] = np.arange(R)
    return torch.from_numpy(inv)


def _window_io(a: MicrobatchArrays, needs: dict[int, ExportNeeds]) -> WindowIO:
    own = needs.get(a.id)
    io = WindowIO()
    if a.num_imports:
        used = used_imports(a, own)
        for k in KINDS:
            rows = np.flatnonzero(used[k]).astype(np.int64)
            io.import_rows[k] = rows
            if rows.shape[0]:
                io.import_from[k] = _sources(a.import_microbatch[rows], a.import_row[rows], needs, k, a.where)
    if a.state_import_microbatch.shape[0]:
        io.import_from["state"] = _sources(a.state_import_microbatch, a.state_import_state, needs, "state", a.where)
    if own is not None:
        io.export_rows = {k: _long(_compact(own.rows[k], a.num_rows, io.import_rows[k], f"{a.where}.export_rows"))
                          for k in KINDS}
        io.export_states = _long(own.states)
    return io


def _sources(exporter: np.ndarray, ids: np.ndarray, needs: dict[int, ExportNeeds], kind: str, where: str) -> ImportSource:
    exporter = exporter.astype(np.int64)
    pos = np.empty(exporter.shape[0], np.int64)
    for e in np.unique(exporter).tolist():
        sel = exporter == e
        if e not in needs:
            raise PlanValidationError(f"{where}: imports from microbatch {e}, which is not an earlier microbatch of this rank")
        table = needs[e].states if kind == "state" else needs[e].rows[kind]
        want = ids[sel].astype(np.int64)
        j = np.minimum(np.searchsorted(table, want), max(table.shape[0] - 1, 0))
        if table.shape[0] == 0 or (table[j] != want).any():
            raise PlanValidationError(f"{where}: microbatch {e} does not export the {kind} rows this microbatch imports")
        pos[sel] = j
    return ImportSource(exporter=exporter, position=pos)


def layout_from_arrays(a: MicrobatchArrays, needs: dict[int, ExportNeeds] | None = None, *, chunk_size: int,
                       batch_invariant: bool = False) -> RowLayout:
    """Tensors of one decoded microbatch.

    Args:
        a: the microbatch (`plan.decode.decode_microbatch`).
        needs: the rank's `plan.window_exports.export_needs` (required when a imports or exports).
        chunk_size: C (state exports must sit at chunk boundaries of their sequence or at its end).
        batch_invariant: prepare the tree attention's depth-tiled mode (`prepare_tree_layout`).

    Raises:
        PlanValidationError: a schedule that does not keep every row exactly once, an export that
            is not at a chunk boundary, imports that no exporter provides.
    """
    where = a.where
    R, I = a.num_rows, a.num_imports
    needs = needs or {}
    if (I or a.state_import_microbatch.shape[0]) and not needs:
        raise PlanValidationError(f"{where}: imports from other microbatches but no export table was given")
    io = _window_io(a, needs)
    conv = _compact(a.conv_ancestors, R, io.import_rows["conv"], f"{where}.conv_ancestors")

    attn_rows = io.import_rows["attn"]
    ranges = a.attn_ranges.astype(np.int64)
    if ranges.shape[0]:  # imported ranges into the attention table (covered rows are contiguous there)
        lo = _compact(ranges[:, 0], R, attn_rows, f"{where}.attn_ranges")
        hi = _compact(ranges[:, 1] - 1, R, attn_rows, f"{where}.attn_ranges") + 1
        ranges = np.stack([lo, hi], axis=1)
    attention = prepare_tree_layout(a.seg_start, a.seg_length, a.attn_offsets, ranges, num_rows=R,
                                    num_kv_rows=R + attn_rows.shape[0], batch_invariant=batch_invariant)

    kern_rows = io.import_rows["kernel"]
    calls, kept_rows = [], []
    for c, call in enumerate(a.linear_calls):
        N = call.num_sequences
        replay_n = np.diff(call.replay_offsets)
        range_n = call.row_end - call.row_start
        length = replay_n + range_n
        cu = np.concatenate([[0], np.cumsum(length)]).astype(np.int64)
        gather = np.empty(int(cu[-1]), np.int64)
        keep = []
        for n in range(N):
            rep = call.replay_rows[call.replay_offsets[n] : call.replay_offsets[n + 1]]
            if rep.shape[0] >= chunk_size:
                raise PlanValidationError(f"{where}.linear_calls[{c}].sequences[{n}].replay_rows: expected <= {chunk_size - 1} rows, got {rep.shape[0]}")
            b = int(cu[n])
            gather[b : b + rep.shape[0]] = rep
            gather[b + rep.shape[0] : cu[n + 1]] = np.arange(call.row_start[n], call.row_end[n])
            keep.append(np.arange(b + rep.shape[0], cu[n + 1]))
            kept_rows.append(np.arange(call.row_start[n], call.row_end[n]))
        pos = call.export_depth - call.start_depth[call.export_seq] if call.export_seq.shape[0] else np.zeros(0, np.int64)
        seq_len = length[call.export_seq] if call.export_seq.shape[0] else np.zeros(0, np.int64)
        bad = np.flatnonzero((pos <= 0) | (pos > seq_len) | ((pos % chunk_size != 0) & (pos != seq_len)))
        if bad.shape[0]:
            e = int(bad[0])
            raise PlanValidationError(
                f"{where}.linear_calls[{c}].sequences[{int(call.export_seq[e])}].exports: expected a depth at a chunk "
                f"boundary of the sequence or its end, got {int(call.export_depth[e])}")
        calls.append(LinearCall(
            gather_idx=_long(_compact(gather, R, kern_rows, f"{where}.linear_calls[{c}].replay_rows")),
            cu_seqlens=_long(cu), init_kind=call.init_kind.tolist(), init_state=call.init_state.tolist(),
            keep_idx=_long(np.concatenate(keep) if keep else []), export_seq=_long(call.export_seq),
            export_pos=_long(pos), export_state=call.export_state.tolist(),
        ))
    row_from_kept = _inverse_kept(np.concatenate(kept_rows) if kept_rows else np.zeros(0, np.int64), R, f"{where}.linear_calls")

    P = a.num_logprobs
    f32 = lambda x: None if x is None else torch.from_numpy(np.array(x, np.float32))  # noqa: E731
    lp = LogprobMap(
        row=_long(a.lp_row), label=_long(a.lp_label), traj=_long(a.lp_traj), pos=_long(a.lp_pos),
        loss_mask=torch.from_numpy(a.lp_loss_mask.astype(np.float32)), advantage=f32(a.lp_advantage),
        old_logprob=f32(a.lp_old_logprob), ref_logprob=f32(a.lp_ref_logprob),
    )
    assert lp.row.shape[0] == P
    return RowLayout(
        tokens=_long(a.tokens), depth=_long(a.depth), occurrence=torch.from_numpy(a.occurrence.astype(np.float32)),
        conv_src=torch.from_numpy(conv), attention=attention, linear_calls=calls,
        row_from_kept=row_from_kept, num_states=a.num_states, logprobs=lp, window=io,
    )


def layout_from_sequences(seqs: list, *, conv_kernel: int, chunk_size: int) -> RowLayout:
    """Plain packed sequences: one segment and one zero-state linear sequence each, one call.

    The log-prob map has every position 1..L-1 of every sequence (trajectory index = list index).
    """
    seqs = [np.asarray(s, dtype=np.int64) for s in seqs]
    lengths = np.array([len(s) for s in seqs], np.int64)
    if (lengths < 1).any():
        raise ValueError(f"seqs: expected non-empty sequences, got lengths {lengths.tolist()}")
    R = int(lengths.sum())
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    depth = np.concatenate([np.arange(n) for n in lengths])
    rows = np.arange(R)
    J = conv_kernel - 1
    conv = np.stack([np.where(depth >= J - j, rows - (J - j), R) for j in range(J)], axis=1) if J else np.zeros((R, 0), np.int64)
    attention = prepare_tree_layout(starts, lengths, np.zeros(len(seqs) + 1, np.int64), np.zeros((0, 2), np.int64), num_rows=R)
    call = LinearCall(
        gather_idx=_long(rows), cu_seqlens=_long(np.concatenate([[0], np.cumsum(lengths)])),
        init_kind=[0] * len(seqs), init_state=[0] * len(seqs), keep_idx=_long(rows),
        export_seq=_long([]), export_pos=_long([]), export_state=[],
    )
    lp_row = np.concatenate([a + np.arange(n - 1) for a, n in zip(starts, lengths)])
    lp_label = np.concatenate([s[1:] for s in seqs])
    lp_traj = np.concatenate([np.full(n - 1, t) for t, n in enumerate(lengths)])
    lp_pos = np.concatenate([np.arange(1, n) for n in lengths])
    P = lp_row.shape[0]
    lp = LogprobMap(
        row=_long(lp_row), label=_long(lp_label), traj=_long(lp_traj), pos=_long(lp_pos),
        loss_mask=torch.ones(P), advantage=torch.zeros(P),
    )
    return RowLayout(
        tokens=_long(np.concatenate(seqs)), depth=_long(depth), occurrence=torch.ones(R),
        conv_src=torch.from_numpy(conv.astype(np.int64)), attention=attention, linear_calls=[call],
        row_from_kept=_long(rows), num_states=0, logprobs=lp,
    )


__all__ = ["LogprobMap", "ImportSource", "WindowIO", "RowLayout", "layout_from_arrays", "layout_from_sequences"]
