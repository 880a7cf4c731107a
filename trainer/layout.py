"""Decode a plan Microbatch into the torch index tensors the model runs on (DESIGN §4.4, §5.2).

`layout_from_microbatch` turns the wire arrays of one `plan_pb2.Microbatch` into a `RowLayout`;
`layout_from_sequences` builds the same structure for plain sequences (one segment each, one
linear call from zero states), used for parity with transformers and by tests.

Errors are `ValueError`s naming the microbatch and field. Microbatches that import rows or states
from other microbatches (sharing windows) are rejected: this trainer runs plans made with
windows=False.

Legend: R rows, S segments, J = K-1 conv ancestors, P log-prob entries.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from proto.arrays import unpack
from trainer.tree_ops import IMPORTED, AttnSegment, AttnTiles, LinearCall, attention_tiles


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
    """long [R, J] conv ancestor rows oldest first; R = zero padding."""
    attn_segments: list[AttnSegment]
    """Per segment, its queries and keys (host tensors, for `tree_ops.ancestor_attention_segments`,
    the reference; the model runs `attn_tiles`)."""
    attn_tiles: AttnTiles
    """The segments' attention tile plan (`tree_ops.attention_tiles`), built once per microbatch."""
    linear_calls: list[LinearCall]
    row_from_kept: torch.Tensor
    """long [R] row -> index into the concatenated kept outputs of all calls."""
    num_states: int
    logprobs: LogprobMap

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device: torch.device | str) -> "RowLayout":
        """The layout with its index tensors on `device` (in place; returns self). Call offsets and
        export positions stay on the CPU: the kernel plans its chunks from them on the host; so do
        the per-segment `attn_segments` (the reference's; one copy per segment would cost more than
        the tile plan's few)."""
        dev = torch.device(device)
        if dev.type == "cpu":
            return self
        mv = lambda t: None if t is None else t.to(dev, non_blocking=True)  # noqa: E731
        self.tokens, self.depth, self.occurrence = mv(self.tokens), mv(self.depth), mv(self.occurrence)
        self.conv_src, self.row_from_kept = mv(self.conv_src), mv(self.row_from_kept)
        self.attn_tiles.to(dev)
        for call in self.linear_calls:
            call.gather_idx, call.keep_idx = mv(call.gather_idx), mv(call.keep_idx)
        lp = self.logprobs
        for name in ("row", "label", "traj", "pos", "loss_mask", "advantage", "old_logprob", "ref_logprob"):
            setattr(lp, name, mv(getattr(lp, name)))
        return self


def _long(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, dtype=np.int64).copy())


def _inverse_kept(kept_rows: np.ndarray, R: int, where: str) -> torch.Tensor:
    count = np.bincount(kept_rows, minlength=R) if kept_rows.size else np.zeros(R, np.int64)
    if kept_rows.size and (kept_rows.min() < 0 or kept_rows.max() >= R):
        raise ValueError(f"{where}: linear sequence ranges must lie in [0, {R}), got rows {kept_rows.min()}..{kept_rows.max()}")
    if (count != 1).any():
        bad = int(np.nonzero(count != 1)[0][0])
        raise ValueError(f"{where}: expected every row kept by exactly one linear sequence, row {bad} is kept {int(count[bad])} times")
    inv = np.empty(R, np.int64)
    inv[kept_rows] = np.arange(R)
    return torch.from_numpy(inv)


def layout_from_microbatch(mb, *, conv_kernel: int, chunk_size: int, vocab_size: int) -> RowLayout:
    """Decode one `plan_pb2.Microbatch` (validated by proto.plan_validator beforehand).

    Raises:
        ValueError: imports (sharing windows), inconsistent array lengths, tokens outside the
            vocabulary, a schedule that does not keep every row exactly once.
    """
    where = f"microbatch {mb.id}"
    if len(mb.import_row) or len(mb.state_imports):
        raise ValueError(
            f"{where}: expected no imports, got {len(mb.import_row) // 4} imported rows and "
            f"{len(mb.state_imports)} imported states; this trainer does not run sharing windows yet, "
            "plan the step with windows=False"
        )
    R = int(mb.num_rows)
    tokens = unpack(mb.tokens, "int32", name=f"{where}.tokens")
    depth = unpack(mb.depth, "int32", name=f"{where}.depth")
    occ = unpack(mb.occurrence, "int32", name=f"{where}.occurrence")
    for name, arr in (("tokens", tokens), ("depth", depth), ("occurrence", occ)):
        if arr.shape[0] != R:
            raise ValueError(f"{where}.{name}: expected {R} entries (num_rows), got {arr.shape[0]}")
    if R and (tokens.min() < 0 or tokens.max() >= vocab_size):
        raise ValueError(f"{where}.tokens: expected ids in [0, {vocab_size}), got {tokens.min()}..{tokens.max()}")
    J = conv_kernel - 1
    if J:
        conv = unpack(mb.conv_ancestors, "int32", width=J, name=f"{where}.conv_ancestors").reshape(-1, J)
    else:
        conv = np.zeros((R, 0), np.int32)
    if conv.shape[0] != R:
        raise ValueError(f"{where}.conv_ancestors: expected [{R}, {J}], got {list(conv.shape)}")
    conv = np.where(conv < 0, R, conv).astype(np.int64)
    if conv.size and conv.max() > R:
        raise ValueError(f"{where}.conv_ancestors: expected rows < {R} (imports are not supported), got {conv.max()}")

    seg_start = unpack(mb.seg_start, "int32", name=f"{where}.seg_start")
    seg_len = unpack(mb.seg_length, "int32", name=f"{where}.seg_length")
    offsets = unpack(mb.attn_offsets, "int32", name=f"{where}.attn_offsets")
    ranges = unpack(mb.attn_ranges, "int32", width=2, name=f"{where}.attn_ranges").reshape(-1, 2)
    S = seg_start.shape[0]
    if seg_len.shape[0] != S or offsets.shape[0] != S + 1:
        raise ValueError(f"{where}: expected seg_length [{S}] and attn_offsets [{S + 1}], got {seg_len.shape[0]} and {offsets.shape[0]}")
    order = np.argsort(seg_start, kind="stable")
    if S and (seg_start[order[0]] != 0 or (seg_start[order][1:] != (seg_start + seg_len)[order][:-1]).any()
              or seg_start[order[-1]] + seg_len[order[-1]] != R):
        raise ValueError(f"{where}: expected segments to tile rows 0..{R} contiguously")
    segments, seg_kv = [], []
    for s in order:
        a, b = int(seg_start[s]), int(seg_start[s] + seg_len[s])
        anc = [np.arange(lo, hi) for lo, hi in ranges[offsets[s] : offsets[s + 1]]]
        idx = np.concatenate(anc + [np.arange(a, b)])
        if idx.size and (idx.min() < 0 or idx.max() >= R):
            raise ValueError(f"{where}.attn_ranges: segment {s} expected rows in [0, {R}), got {idx.min()}..{idx.max()}")
        segments.append(AttnSegment(q_start=a, q_len=b - a, kv_idx=_long(idx)))
        seg_kv.append(idx)
    tiles = attention_tiles(seg_start[order], seg_len[order], seg_kv, R)

    calls, kept_rows = [], []
    n_states = int(mb.num_states)
    for c, call in enumerate(mb.linear_calls):
        gather, cu, kinds, sids, keep = [], [0], [], [], []
        ex_seq, ex_pos, ex_state = [], [], []
        for n, seq in enumerate(call.sequences):
            replay = unpack(seq.replay_rows, "int32", name=f"{where}.linear_calls[{c}].sequences[{n}].replay_rows")
            if replay.size and (replay.min() < 0 or replay.max() >= R):
                raise ValueError(f"{where}.linear_calls[{c}].sequences[{n}].replay_rows: expected local rows < {R}, got {replay.max()}")
            if not 0 <= seq.row_start < seq.row_end <= R:
                raise ValueError(f"{where}.linear_calls[{c}].sequences[{n}]: expected 0 <= row_start < row_end <= {R}, got {seq.row_start}, {seq.row_end}")
            if len(replay) >= chunk_size:
                raise ValueError(f"{where}.linear_calls[{c}].sequences[{n}].replay_rows: expected <= {chunk_size - 1} rows, got {len(replay)}")
            base = cu[-1]
            rng = np.arange(seq.row_start, seq.row_end)
            gather += [replay, rng]
            keep.append(np.arange(base + len(replay), base + len(replay) + len(rng)))
            kept_rows.append(rng)
            length = len(replay) + len(rng)
            cu.append(base + length)
            if seq.init_state.kind == IMPORTED:
                raise ValueError(f"{where}.linear_calls[{c}].sequences[{n}].init_state: imported states need sharing windows; plan with windows=False")
            kinds.append(int(seq.init_state.kind))
            sids.append(int(seq.init_state.state))
            for ex in seq.exports:
                pos = ex.depth - seq.start_depth
                if not (0 < pos <= length) or (pos % chunk_size and pos != length):
                    raise ValueError(
                        f"{where}.linear_calls[{c}].sequences[{n}].exports: expected a depth at a chunk boundary "
                        f"(start {seq.start_depth} + j*{chunk_size}) or the sequence end ({seq.start_depth + length}), got {ex.depth}"
                    )
                if not 0 <= ex.state < n_states:
                    raise ValueError(f"{where}.linear_calls[{c}].sequences[{n}].exports: expected state < num_states {n_states}, got {ex.state}")
                ex_seq.append(n)
                ex_pos.append(pos)
                ex_state.append(int(ex.state))
        calls.append(LinearCall(
            gather_idx=_long(np.concatenate(gather) if gather else []), cu_seqlens=_long(cu),
            init_kind=kinds, init_state=sids, keep_idx=_long(np.concatenate(keep) if keep else []),
            export_seq=_long(ex_seq), export_pos=_long(ex_pos), export_state=ex_state,
        ))
    row_from_kept = _inverse_kept(np.concatenate(kept_rows) if kept_rows else np.zeros(0, np.int64), R, where)

    lp_row = unpack(mb.lp_row, "int32", name=f"{where}.lp_row")
    P = lp_row.shape[0]
    if P and (lp_row.min() < 0 or lp_row.max() >= R):
        raise ValueError(f"{where}.lp_row: expected local rows < {R}, got {lp_row.min()}..{lp_row.max()}")

    def f32(data, name: str, required: bool) -> torch.Tensor | None:
        arr = unpack(data, "float32", name=f"{where}.{name}")
        if arr.shape[0] == 0 and P and not required:
            return None
        if arr.shape[0] != P:
            raise ValueError(f"{where}.{name}: expected {P} entries (lp_row), got {arr.shape[0]}")
        return torch.from_numpy(arr.copy())

    label = unpack(mb.lp_label, "int32", name=f"{where}.lp_label")
    if P and (label.min() < 0 or label.max() >= vocab_size):
        raise ValueError(f"{where}.lp_label: expected ids in [0, {vocab_size}), got {label.min()}..{label.max()}")
    mask = unpack(mb.lp_loss_mask, "uint8", name=f"{where}.lp_loss_mask")
    lp = LogprobMap(
        row=_long(lp_row), label=_long(label), traj=_long(unpack(mb.lp_traj, "int32")), pos=_long(unpack(mb.lp_pos, "int32")),
        loss_mask=torch.from_numpy(mask.astype(np.float32)),
        advantage=f32(mb.lp_advantage, "lp_advantage", True),
        old_logprob=f32(mb.lp_old_logprob, "lp_old_logprob", False),
        ref_logprob=f32(mb.lp_ref_logprob, "lp_ref_logprob", False),
    )
    for name in ("label", "traj", "pos", "loss_mask"):
        if getattr(lp, name).shape[0] != P:
            raise ValueError(f"{where}.lp_{name}: expected {P} entries (lp_row), got {getattr(lp, name).shape[0]}")
    return RowLayout(
        tokens=_long(tokens), depth=_long(depth), occurrence=torch.from_numpy(occ.astype(np.float32)),
        conv_src=torch.from_numpy(conv), attn_segments=segments, attn_tiles=tiles, linear_calls=calls,
        row_from_kept=row_from_kept, num_states=n_states, logprobs=lp,
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
    segments = [AttnSegment(q_start=int(a), q_len=int(n), kv_idx=_long(np.arange(a, a + n))) for a, n in zip(starts, lengths)]
    tiles = attention_tiles(starts, lengths, [np.arange(a, a + n) for a, n in zip(starts, lengths)], R)
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
        conv_src=torch.from_numpy(conv.astype(np.int64)), attn_segments=segments, attn_tiles=tiles, linear_calls=[call],
        row_from_kept=_long(rows), num_states=0, logprobs=lp,
    )
