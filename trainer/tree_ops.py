"""Sequence-coupled operators over packed tree rows (DESIGN §5.2-§5.3), each beside a plain reference.

The per-token operators of the model run once per packed row; these three couple rows along
root-to-leaf paths through the plan's ancestry:

- `ancestry_conv`: the depthwise causal short convolution, gathering the K-1 ancestor rows of each
  row and summing in the fixed order (oldest first) that a linear sequence uses;
- `tiled_attention` (`ancestor_attention`): per segment, queries attend to the segment's ancestor
  rows (all visible) and causally to the segment's own rows; never a dense mask over the
  microbatch; computed in fixed-shape, depth-aligned tiles so that a query's result does not
  depend on the segment's extent. The tile plan (`attention_tiles`, built once per microbatch by
  the layout) batches every segment's query tiles into a few groups of equal key-tile count, so
  the cost follows the (query tile, key tile) pairs, not the number of segments; the per-segment
  `ancestor_attention_segments` is its bitwise reference;
- `linear_attention`: the linear-attention call schedule: per call, gather replay + range rows
  differentiably, run the kernel from the state-table initial states, keep range outputs, discard
  replay outputs, store exported states without detaching.

Legend: R rows, C channels, K conv kernel, J = K-1 ancestors, H heads, Hkv kv heads, hd head dim,
Kd/Vd linear key/value dims, n gathered rows of one call, N sequences, E exports, S segments,
NQ query tiles, NKT distinct key tiles, nb query tiles of a group, nk key tiles each folds over.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kernels.gated_delta_rule import prepare_layout

#: StateSource kinds (proto/harts/v1/plan.proto).
ZERO, LOCAL, IMPORTED = 0, 1, 2


@dataclass(slots=True, kw_only=True)
class AttnSegment:
    """Queries q_start:q_start+q_len attend to kv_idx (ancestors first, then the segment's own rows)."""

    q_start: int
    q_len: int
    kv_idx: torch.Tensor
    """long [A + q_len] rows: A ancestor rows (visible to every query), then the q_len own rows."""


@dataclass(slots=True, kw_only=True)
class LinearCall:
    """One varlen kernel launch of the schedule."""

    gather_idx: torch.Tensor
    """long [n] rows in kernel order: per sequence its replay rows then its range rows."""
    cu_seqlens: torch.Tensor
    """long [N+1] sequence offsets into gather_idx."""
    init_kind: list[int]
    """[N] ZERO / LOCAL / IMPORTED."""
    init_state: list[int]
    """[N] state-table id (LOCAL) or import id (IMPORTED); ignored for ZERO."""
    keep_idx: torch.Tensor
    """long [k] positions of the kernel output that are kept (range rows), in row-kept order."""
    export_seq: torch.Tensor
    """long [E] sequence of each export."""
    export_pos: torch.Tensor
    """long [E] rows of that sequence done at the export (a chunk multiple or its length)."""
    export_state: list[int]
    """[E] state-table id each export fills."""
    kernel_layout: object | None = None
    """The kernel's chunk layout of this call (`prepare_layout`), built on first use and shared by
    every linear-attention layer of the microbatch."""


def ancestry_conv(x_NC: torch.Tensor, w_CK: torch.Tensor, conv_src_RJ: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv through the conv ancestry (no activation).

    Args:
        x_NC: [N, C] inputs: the R local rows first, then any imported rows (sharing windows).
        w_CK: [C, K] weights, w[:, K-1] multiplies the row itself.
        conv_src_RJ: long [R, K-1] ancestor rows (into x_NC) oldest first; N means zero padding.
    Returns:
        [R, C] outputs of the local rows.
    """
    R = conv_src_RJ.shape[0]
    C = x_NC.shape[1]
    K = w_CK.shape[1]
    x_ext = torch.cat([x_NC, x_NC.new_zeros(1, C)], dim=0)
    acc = None
    for j in range(K - 1):
        term = x_ext.index_select(0, conv_src_RJ[:, j]) * w_CK[:, j]
        acc = term if acc is None else acc + term
    term = x_NC[:R] * w_CK[:, K - 1]
    return term if acc is None else acc + term


def causal_conv_ref(x_LC: torch.Tensor, w_CK: torch.Tensor) -> torch.Tensor:
    """Reference: one linear sequence through F.conv1d with left zero padding."""
    L, C = x_LC.shape
    K = w_CK.shape[1]
    y = F.conv1d(x_LC.t()[None], w_CK[:, None, :], padding=K - 1, groups=C)[0, :, :L]
    return y.t()


#: query and key tile sizes of the batch-invariant attention.
TILE_Q = 16
TILE_K = 16


class _FoldTiles(torch.autograd.Function):
    """`x.cumsum(dim=1)[:, -1]` of a float32 tensor, bitwise, without the cumsum.

    torch's CPU cumsum of float32 adds left to right in a float64 accumulator and rounds each
    prefix to float32; its last prefix is therefore float32(((x_0 + x_1) + x_2) + ...) in float64,
    which this computes with one contiguous in-place add per slice instead of a strided scan of
    the whole tensor (20x faster at [20, 40, 4, 16, 16]). The gradient is the cumsum's: every
    slice receives the output's gradient unchanged."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[1]
        acc = x[:, 0].to(torch.float64 if x.dtype == torch.float32 else x.dtype, copy=True)
        for j in range(1, x.shape[1]):
            acc.add_(x[:, j])
        return acc.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(1).expand(g.shape[0], ctx.n, *g.shape[1:])


def fold_tiles(x: torch.Tensor) -> torch.Tensor:
    """Left-to-right sum over dim 1, bitwise `x.cumsum(dim=1)[:, -1]` (`fold_tiles_ref`) on CPU;
    elsewhere (other accumulators) the cumsum itself."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return _FoldTiles.apply(x)
    return fold_tiles_ref(x)


def fold_tiles_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain reference of `fold_tiles`."""
    return x.cumsum(dim=1)[:, -1]


def _attend(q_LHd, k_AHd, v_AHd, n_anc: int, scale: float) -> torch.Tensor:
    """Attention of one segment's queries, bitwise independent of the segment's extent.

    Keys are the rows at depths 0, 1, ... in order (ancestors root first, then the segment), so key
    tile t always holds the same depths whatever else is in the run. Scores and P@V are same-shape
    [TILE_Q, hd] x [hd, TILE_K] products, row sums are over one TILE_K tile, and tiles are folded
    left to right (cumsum); keys a query cannot see are exact zeros, so a query gets the same bits
    in a tree segment and in its expanded trajectory (whose later keys are all masked).
    """
    Lq, H, hd = q_LHd.shape
    rep = H // k_AHd.shape[1]
    k = k_AHd.repeat_interleave(rep, dim=1)
    v = v_AHd.repeat_interleave(rep, dim=1)
    Lk = k.shape[0]
    nq, nk = -(-Lq // TILE_Q), -(-Lk // TILE_K)
    q_t = F.pad(q_LHd, (0, 0, 0, 0, 0, nq * TILE_Q - Lq)).view(nq, TILE_Q, H, hd).permute(0, 2, 1, 3)
    k_t = F.pad(k, (0, 0, 0, 0, 0, nk * TILE_K - Lk)).view(nk, TILE_K, H, hd).permute(0, 2, 3, 1)
    v_t = F.pad(v, (0, 0, 0, 0, 0, nk * TILE_K - Lk)).view(nk, TILE_K, H, hd).permute(0, 2, 1, 3)
    s = torch.matmul(q_t[:, None], k_t[None]) * scale  # [nq, nk, H, TQ, TK]
    qi = torch.arange(nq * TILE_Q, device=s.device).view(nq, 1, 1, TILE_Q, 1)
    kj = torch.arange(nk * TILE_K, device=s.device).view(1, nk, 1, 1, TILE_K)
    hidden = (kj >= Lk) | ((kj >= n_anc) & (kj - n_anc > qi))
    s = s.masked_fill(hidden, float("-inf"))
    m = s.amax(dim=(1, 4), keepdim=True).clamp_min(torch.finfo(s.dtype).min)  # padded query rows: finite
    p = torch.exp(s - m)  # [nq, nk, H, TQ, TK]
    l = p.sum(dim=-1).cumsum(dim=1)[:, -1]  # [nq, H, TQ]
    o = torch.matmul(p, v_t[None]).cumsum(dim=1)[:, -1]  # [nq, H, TQ, hd]
    o = o / l[..., None]
    return o.permute(0, 2, 1, 3).reshape(nq * TILE_Q, H, hd)[:Lq].to(q_LHd.dtype)


@dataclass(slots=True, kw_only=True)
class AttnTileGroup:
    """Query tiles that all fold over the same number of key tiles (one batched computation)."""

    q_rows: torch.Tensor
    """long [nb, TILE_Q] rows of each tile's queries; R = padding (a zero row)."""
    kv_tiles: torch.Tensor
    """long [nb, nk] key tiles (ids into AttnTiles.key_rows) each query tile folds over, in depth
    order (the segment's ancestors root first, then its own rows); padding is the all-padding tile."""
    visible: torch.Tensor
    """long [nb, TILE_Q] keys visible to each query: key slot j of the tile's key list is seen iff
    j < visible (ancestors, then the segment's rows up to the query itself)."""


@dataclass(slots=True, kw_only=True)
class AttnTiles:
    """Every segment's query tiles, grouped by key-tile count (built once per microbatch)."""

    key_rows: torch.Tensor
    """long [NKT, TILE_K] rows of each distinct key tile (a segment's depths 16t..16t+15; tiles of
    a shared ancestry are stored once), into the key table; the last tile is all padding (row
    num_kv_rows of `attention_tiles`)."""
    groups: list[AttnTileGroup]
    row_slot: torch.Tensor
    """long [R] row -> position in the concatenation of all groups' query slots."""

    def to(self, device: torch.device) -> "AttnTiles":
        for g in self.groups:
            g.q_rows, g.kv_tiles, g.visible = g.q_rows.to(device), g.kv_tiles.to(device), g.visible.to(device)
        self.key_rows, self.row_slot = self.key_rows.to(device), self.row_slot.to(device)
        return self


#: most (query tile, key tile) pairs in one batched computation (bounds the score tensor).
MAX_TILE_PAIRS = 16384


def _bucket(nk: np.ndarray) -> np.ndarray:
    """Group width of query tiles that need nk key tiles: nk itself up to 16, beyond that rounded
    up to a multiple of 2^(floor(log2 nk) - 3) (<= 12.5% padding, 8 widths per octave).

    Padding pairs cost as much as real ones, a group costs little: exact widths measured fastest
    at CPU scale (27 ms vs 35 ms for 1.5x rounding, percall forward + backward)."""
    nk = np.maximum(np.asarray(nk, np.int64), 1)
    e = np.maximum(np.floor(np.log2(nk)).astype(np.int64) - 3, 0)
    return -(-nk >> e) << e


def _distinct_tiles(krows: np.ndarray, n_valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows of krows [T, TILE_K], index of each row among them).

    In a tree a row's ancestry is unique, so a key tile is named by its last valid row and its
    number of valid rows: one int64 key per tile (np.unique over rows sorts void records, 20x
    slower at 1M tiles). The naming is checked against the rows and the exact row-wise unique is
    used whenever it does not hold (ancestries that are not a tree)."""
    if krows.shape[0] == 0:
        return krows.reshape(0, TILE_K), np.zeros(0, np.int64)
    last = krows[np.arange(krows.shape[0]), n_valid - 1]
    _, first, inv = np.unique(last * (TILE_K + 1) + n_valid, return_index=True, return_inverse=True)
    key_rows = krows[first]
    if (key_rows[inv] == krows).all():
        return key_rows, inv.reshape(-1)
    key_rows, inv = np.unique(krows, axis=0, return_inverse=True)
    return key_rows, inv.reshape(-1)


def attention_tiles(q_start_S: np.ndarray, q_len_S: np.ndarray, kv_idx_S: list[np.ndarray], num_rows: int,
                    *, num_kv_rows: int | None = None) -> AttnTiles:
    """Tile plan of `ancestor_attention` for segments given as numpy arrays (vectorised over tiles).

    Segment s's queries are rows q_start_S[s] + 0..q_len_S[s]-1 (< num_rows); its keys are
    kv_idx_S[s] (A ancestors, then the q_len own rows), rows of a key table of num_kv_rows rows
    (default num_rows; a window child's table appends its imported rows after its own, and key
    padding is row num_kv_rows). Query tile i of a segment folds over the key tiles
    that hold a key visible to one of its queries (later key tiles are all hidden: they add exact
    zeros at the end of the fold, so leaving them out changes no bit); tiles are grouped by that
    count rounded up (`_bucket`), padded with hidden key tiles.
    """
    R = int(num_rows)
    NK = R if num_kv_rows is None else int(num_kv_rows)
    S = len(kv_idx_S)
    q_start = np.asarray(q_start_S, np.int64).reshape(S)
    q_len = np.asarray(q_len_S, np.int64).reshape(S)
    Lk = np.array([len(x) for x in kv_idx_S], np.int64)
    n_anc = Lk - q_len
    kv_all = np.concatenate([np.asarray(x, np.int64) for x in kv_idx_S] + [np.full(1, NK, np.int64)])
    kv_off = np.concatenate([[0], np.cumsum(Lk)[:-1]]).astype(np.int64)
    nq = -(-q_len // TILE_Q)
    seg = np.repeat(np.arange(S), nq)  # [NQ] segment of each query tile
    first = np.repeat(np.cumsum(nq) - nq, nq)
    qi0 = (np.arange(seg.shape[0]) - first) * TILE_Q  # [NQ] first query position of the tile
    c = np.arange(TILE_Q)
    qpos = qi0[:, None] + c[None, :]  # [NQ, TQ]
    q_rows = np.where(qpos < q_len[seg, None], q_start[seg, None] + qpos, R)
    visible = np.minimum(Lk[seg, None], n_anc[seg, None] + qpos + 1)
    need = -(-visible.max(axis=1) // TILE_K)  # [NQ] key tiles with a visible key
    # every segment's key tiles, then the distinct ones (ancestor tiles recur in every descendant)
    nkt = -(-Lk // TILE_K)
    tile_seg = np.repeat(np.arange(S), nkt)
    tile_t = np.arange(tile_seg.shape[0]) - np.repeat(np.cumsum(nkt) - nkt, nkt)
    kpos = tile_t[:, None] * TILE_K + np.arange(TILE_K)[None, :]
    kvalid = kpos < Lk[tile_seg, None]
    krows = np.where(kvalid, kv_all[np.where(kvalid, kv_off[tile_seg, None] + kpos, kv_all.shape[0] - 1)], NK)
    key_rows, tile_id = _distinct_tiles(krows, np.minimum(Lk[tile_seg] - tile_t * TILE_K, TILE_K))
    key_rows = np.concatenate([key_rows, np.full((1, TILE_K), NK, np.int64)])
    pad_tile = key_rows.shape[0] - 1
    tile_id = np.append(tile_id.reshape(-1), pad_tile)
    first_tile = np.cumsum(nkt) - nkt
    width = _bucket(need)
    groups, slot_rows = [], []
    for nk in np.unique(width):
        tiles = np.nonzero(width == nk)[0]
        step = max(1, MAX_TILE_PAIRS // int(nk))
        for lo in range(0, tiles.shape[0], step):
            t = tiles[lo : lo + step]
            s_ = seg[t]
            tt = np.arange(int(nk))[None, :]
            ids = np.where(tt < nkt[s_, None], tile_id[np.where(tt < nkt[s_, None], first_tile[s_, None] + tt, -1)], pad_tile)
            groups.append(AttnTileGroup(
                q_rows=torch.from_numpy(q_rows[t]), kv_tiles=torch.from_numpy(ids), visible=torch.from_numpy(visible[t]),
            ))
            slot_rows.append(q_rows[t].reshape(-1))
    slot_rows = np.concatenate(slot_rows) if slot_rows else np.zeros(0, np.int64)
    row_slot = np.full(R, -1, np.int64)
    real = slot_rows < R
    row_slot[slot_rows[real]] = np.nonzero(real)[0]
    if (row_slot < 0).any():
        raise ValueError(f"attention segments: expected the segments' queries to cover rows 0..{R}, row {int(np.argmin(row_slot))} is not a query")
    return AttnTiles(key_rows=torch.from_numpy(key_rows), groups=groups, row_slot=torch.from_numpy(row_slot))


def tiles_from_segments(segments: list[AttnSegment], num_rows: int) -> AttnTiles:
    """`attention_tiles` of AttnSegment objects (tests, and callers without a layout)."""
    return attention_tiles(
        np.array([s.q_start for s in segments], np.int64), np.array([s.q_len for s in segments], np.int64),
        [s.kv_idx.cpu().numpy() for s in segments], num_rows,
    )


def tiled_attention(q_RHd, k_NHd, v_NHd, tiles: AttnTiles, *, scale: float) -> torch.Tensor:
    """Tree attention of every segment at once, bitwise equal to `ancestor_attention_segments`.

    Per tile group, one batched computation of the same [TILE_Q, hd] x [hd, TILE_K] score tiles,
    [TILE_K]-wide row sums and left-to-right `cumsum` folds over key tiles that `_attend` runs per
    segment; a query sees the same key tiles in the same order (padding tiles are hidden, so they
    only append exact zeros to the fold).

    Args:
        q_RHd: [R, H, hd] queries (RoPE applied). k_NHd, v_NHd: [N, Hkv, hd] the key table: the R
            local rows, then any imported rows (sharing windows).
        tiles: the microbatch's `AttnTiles` (`attention_tiles` with num_kv_rows = N).
    Returns:
        [R, H, hd].
    """
    R, H, hd = q_RHd.shape
    if not tiles.groups:
        return q_RHd.new_zeros(R, H, hd)
    rep = H // k_NHd.shape[1]
    zero = q_RHd.new_zeros(1, H, hd)
    q_ext = torch.cat([q_RHd, zero])
    NKT = tiles.key_rows.shape[0]
    kr = tiles.key_rows.reshape(-1)
    # distinct key tiles, laid out as the score and P@V matmuls read them
    k_tab = torch.cat([k_NHd, zero[:, : k_NHd.shape[1]]]).index_select(0, kr).repeat_interleave(rep, dim=1)
    k_tab = k_tab.view(NKT, TILE_K, H, hd).permute(0, 2, 3, 1).contiguous()  # [NKT, H, hd, TK]
    v_tab = torch.cat([v_NHd, zero[:, : v_NHd.shape[1]]]).index_select(0, kr).repeat_interleave(rep, dim=1)
    v_tab = v_tab.view(NKT, TILE_K, H, hd).permute(0, 2, 1, 3).contiguous()  # [NKT, H, TK, hd]
    outs = []
    for g in tiles.groups:
        nb, nk = g.kv_tiles.shape
        q_t = q_ext.index_select(0, g.q_rows.reshape(-1)).view(nb, TILE_Q, H, hd).permute(0, 2, 1, 3)
        kv = g.kv_tiles.reshape(-1)
        k_t = k_tab.index_select(0, kv).view(nb, nk, H, hd, TILE_K)
        v_t = v_tab.index_select(0, kv).view(nb, nk, H, TILE_K, hd)
        s = torch.matmul(q_t[:, None], k_t).mul_(scale)  # [nb, nk, H, TQ, TK]; in place: same bits, no copy
        kj = torch.arange(nk * TILE_K, device=s.device).view(1, nk, 1, 1, TILE_K)
        s = s.masked_fill_(kj >= g.visible.view(nb, 1, 1, TILE_Q, 1), float("-inf"))
        # the row max only shifts the exponent (softmax is invariant to it): no gradient through it
        m = s.detach().amax(dim=-1, keepdim=True).amax(dim=1, keepdim=True).clamp_min(torch.finfo(s.dtype).min)
        p = (s - m).exp_()
        l = fold_tiles(p.sum(dim=-1))  # [nb, H, TQ]
        o = fold_tiles(torch.matmul(p, v_t))  # [nb, H, TQ, hd]
        o = o / l[..., None]
        outs.append(o.permute(0, 2, 1, 3).reshape(nb * TILE_Q, H, hd))
    return torch.cat(outs).index_select(0, tiles.row_slot).to(q_RHd.dtype)


def ancestor_attention(q_RHd, k_RHd, v_RHd, segments: list[AttnSegment] | AttnTiles, *, scale: float) -> torch.Tensor:
    """Tree attention: `tiled_attention` over `segments` (AttnSegments are tiled first).

    Args:
        q_RHd: [R, H, hd] queries (RoPE applied). k_RHd, v_RHd: [R, Hkv, hd].
        segments: the layout's AttnTiles, or AttnSegment per segment covering rows 0..R.
    Returns:
        [R, H, hd].
    """
    tiles = segments if isinstance(segments, AttnTiles) else tiles_from_segments(segments, q_RHd.shape[0])
    return tiled_attention(q_RHd, k_RHd, v_RHd, tiles, scale=scale)


def ancestor_attention_segments(q_RHd, k_RHd, v_RHd, segments: list[AttnSegment], *, scale: float) -> torch.Tensor:
    """Plain reference of `tiled_attention`: segment by segment, all key tiles of the segment."""
    outs = []
    for seg in sorted(segments, key=lambda s: s.q_start):
        q = q_RHd[seg.q_start : seg.q_start + seg.q_len]
        k = k_RHd.index_select(0, seg.kv_idx)
        v = v_RHd.index_select(0, seg.kv_idx)
        outs.append(_attend(q, k, v, seg.kv_idx.shape[0] - seg.q_len, scale))
    return torch.cat(outs, dim=0)


def ancestor_attention_ref(q_RHd, k_RHd, v_RHd, visible_RR: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Reference with a dense [R, R] visibility mask (tests only: quadratic memory)."""
    rep = q_RHd.shape[1] // k_RHd.shape[1]
    k = k_RHd.repeat_interleave(rep, dim=1)
    v = v_RHd.repeat_interleave(rep, dim=1)
    s = torch.einsum("qhd,khd->hqk", q_RHd, k) * scale
    s = s.masked_fill(~visible_RR[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32)).to(q_RHd.dtype), v)


def linear_attention(
    q_NHK: torch.Tensor,
    k_NHK: torch.Tensor,
    v_NHV: torch.Tensor,
    g_NH: torch.Tensor,
    beta_NH: torch.Tensor,
    calls: list[LinearCall],
    row_from_kept: torch.Tensor,
    num_states: int,
    *,
    fn,
    chunk_size: int,
    imported_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Run the linear-attention call schedule of one microbatch for one layer.

    Args:
        q_NHK, k_NHK: [N, Hk, Kd] kernel-input table: the local rows, then any imported rows
            (sharing windows); q/k are repeated to the value heads after the gather.
        v_NHV: [N, Hv, Vd]. g_NH: [N, Hv] log decay (fp32, float64 in a float64 model). beta_NH: [N, Hv].
        calls: the schedule, in order (gather indices into the table). row_from_kept: long [R] row ->
            index in the concatenation of all calls' kept outputs. num_states: size of the
            microbatch's state table.
        fn: chunk_gated_delta_rule-compatible kernel. chunk_size: C.
        imported_states: [Q, Hv, Kd, Vd] states (fp32, or float64) imported from other microbatches.
    Returns:
        ([R, Hv, Vd] outputs, every row from the sequence that keeps it; the state table, id ->
        [Hv, Kd, Vd] state or None). States are never detached, so gradients of later calls (and of
        importers) flow into the calls and replay rows that produced them.
    """
    rep = v_NHV.shape[1] // q_NHK.shape[1]
    H, Kd, Vd = v_NHV.shape[1], q_NHK.shape[2], v_NHV.shape[2]
    states: list[torch.Tensor | None] = [None] * num_states
    zero = torch.zeros(H, Kd, Vd, dtype=torch.promote_types(q_NHK.dtype, torch.float32), device=q_NHK.device)
    imported = imported_states.unbind(0) if imported_states is not None else None
    kept = []
    # One gather for all calls (replay rows appear in several): its backward is one index_add into
    # one zero-filled gradient, where a gather per call zero-fills a full [N, ...] gradient each.
    sizes = [int(call.gather_idx.shape[0]) for call in calls]
    idx_all = calls[0].gather_idx if len(calls) == 1 else torch.cat([call.gather_idx for call in calls])
    gathered = [x.index_select(0, idx_all) for x in (q_NHK, k_NHK, v_NHV, g_NH, beta_NH)]
    gathered[0] = gathered[0].repeat_interleave(rep, dim=1)
    gathered[1] = gathered[1].repeat_interleave(rep, dim=1)
    gathered = [x.split(sizes) for x in gathered]
    for c, call in enumerate(calls):
        inits = []
        for kind, sid in zip(call.init_kind, call.init_state):
            if kind == ZERO:
                inits.append(zero)
            elif kind == LOCAL:
                if states[sid] is None:
                    raise ValueError(f"linear_calls[{c}]: state {sid} is read before any earlier call exported it")
                inits.append(states[sid])
            else:
                if imported is None:
                    raise ValueError(f"linear_calls[{c}]: imported state {sid} but no imports were given")
                inits.append(imported[sid])
        if call.kernel_layout is None:
            call.kernel_layout = prepare_layout(call.cu_seqlens, call.export_seq, call.export_pos, chunk_size,
                                                device=q_NHK.device)
        o, st = fn(
            *(x[c] for x in gathered),
            cu_seqlens=call.cu_seqlens, initial_state=torch.stack(inits), export_seq=call.export_seq,
            export_pos=call.export_pos, chunk_size=chunk_size, scale=None, use_qk_l2norm=True,
            layout=call.kernel_layout,
        )
        for sid, state in zip(call.export_state, st.unbind(0)):  # one unbind: its backward stacks
            states[sid] = state
        kept.append(o.index_select(0, call.keep_idx))
    return torch.cat(kept, dim=0).index_select(0, row_from_kept), states
