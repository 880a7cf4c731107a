"""Triton tree attention, flash-attention-2 style: online-softmax forward saving the log-sum-exp,
backward recomputing P from it (dq query-major, dk/dv kv-major without atomics).

Same contract and math as "ref", over the block maps of a prepared `TreeLayout`; on a layout
prepared with `batch_invariant=True` the forward and dq walk key tiles at fixed depths
(`_depth_tile_rows`). Design: docs/design/execution.md ("Tree attention"). On CPU set
`TRITON_INTERPRET=1` before triton is imported (fp32 only); float64 is rejected.
Legend: R query rows, Rk k/v rows, NB query blocks, NKB kv blocks, P kv pieces, H query heads,
Hkv kv heads, G = H / Hkv, D head dim; tiles: BM query rows, BN k/v rows, BD >= D.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.devices import same_device
from kernels.tree_attention.layout import TreeLayout
from kernels.triton_tuning import autotune, stages


@triton.jit
def _fwd_tile(
    b_m, b_l, b_acc, b_q, p_k, p_v, p_nd, n_cols, diag, o_m, o_n, m_d, scale,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """One online-softmax step of a [BM] query block against a [BN]-row k/v tile.

    p_k, p_v: the tile's first row; p_nd: int32 [BN, BD] offsets in it; n_cols: its valid rows;
    diag: first query row - first tile row (causal: column n is seen by row m iff n <= m + diag).
    """
    m_n = o_n < n_cols
    # [BN, BD]
    b_k = tl.load(p_k + p_nd, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(p_v + p_nd, mask=m_n[:, None] & m_d[None, :], other=0.0)
    # [BM, BN]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
    visible = m_n[None, :]
    if CAUSAL:
        visible = visible & (o_n[None, :] <= o_m[:, None] + diag)
    b_s = tl.where(visible, b_s, float("-inf"))
    m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
    alpha = tl.exp(b_m - m_new)
    b_p = tl.exp(b_s - m_new[:, None])
    b_l = b_l * alpha + tl.sum(b_p, axis=1)
    b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)
    return m_new, b_l, b_acc


@triton.jit
def _depth_tile_rows(attn_ranges, anc_depth, i_cur, r_hi, d0, o_n, A, bos, BN: tl.constexpr):
    """Key-table rows [BN] (int64) of the keys at depths d0 .. d0 + BN - 1 of a segment's key
    sequence: its ancestor ranges i_cur .. r_hi - 1 in depth order (range i starts at depth
    anc_depth[i]), then its own rows from depth A at row bos. Also the first range the next tile
    can overlap. Ranges are visited while they start inside the tile: O(tiles + ranges)."""
    depth = d0 + o_n
    rows = bos + (depth - A)
    j = i_cur
    go = j < r_hi
    while go:
        a = tl.load(attn_ranges + 2 * j)
        rd = tl.load(anc_depth + j)
        rows = tl.where((depth >= rd) & (depth < rd + tl.load(attn_ranges + 2 * j + 1) - a), a + (depth - rd), rows)
        j += 1
        go = (j < r_hi) & (tl.load(anc_depth + j, mask=j < r_hi, other=0) < d0 + BN)
    return rows, tl.maximum(j - 1, i_cur)


@autotune(stages(4, (2, 3)), key=["G", "D", "BM", "BN"])
@triton.jit
def _tree_attn_fwd_kernel(
    q, k, v, o, lse, qb_seg, qb_row, seg_start, seg_len, attn_offsets, attn_ranges, anc_depth, anc_len,
    scale,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, INVARIANT: tl.constexpr,
):
    HKV: tl.constexpr = H // G
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(qb_seg + i_b)
    row0 = tl.load(qb_row + i_b)
    bos = tl.load(seg_start + i_s)
    row_end = tl.minimum(row0 + BM, bos + tl.load(seg_len + i_s))
    r_lo = tl.load(attn_offsets + i_s)
    r_hi = tl.load(attn_offsets + i_s + 1)
    q += row0 * (H * D) + i_h * D
    o += row0 * (H * D) + i_h * D
    lse += row0 * H + i_h
    k += (i_h // G) * D
    v += (i_h // G) * D

    o_m = tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_rows = o_m < (row_end - row0).to(tl.int32)
    p_md = o_m[:, None] * (H * D) + o_d[None, :]
    p_nd = o_n[:, None] * (HKV * D) + o_d[None, :]
    # [BM, BD]
    b_q = tl.load(q + p_md, mask=m_rows[:, None] & m_d[None, :], other=0.0)
    # A finite start keeps exp(b_m - m_new) a number while every score so far is masked.
    b_m = tl.full([BM], -1.0e30, dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)

    if INVARIANT:
        # Key tiles at fixed depths of the segment's key sequence (ancestors, then its own rows).
        A = tl.load(anc_len + i_s)
        d_end = A + (row_end - bos)
        i_cur = r_lo
        for d0 in range(0, d_end, BN):
            rows, i_cur = _depth_tile_rows(attn_ranges, anc_depth, i_cur, r_hi, d0, o_n, A, bos, BN)
            p_rows = rows[:, None] * (HKV * D) + o_d[None, :]
            b_m, b_l, b_acc = _fwd_tile(
                b_m, b_l, b_acc, b_q, k, v, p_rows, (d_end - d0).to(tl.int32), (A + row0 - bos - d0).to(tl.int32),
                o_m, o_n, m_d, scale, CAUSAL=True, PREC=PREC,
            )
    else:
        for i_r in range(r_lo, r_hi):
            a = tl.load(attn_ranges + 2 * i_r)
            b = tl.load(attn_ranges + 2 * i_r + 1)
            for c0 in range(a, b, BN):
                b_m, b_l, b_acc = _fwd_tile(
                    b_m, b_l, b_acc, b_q, k + c0 * (HKV * D), v + c0 * (HKV * D), p_nd, (b - c0).to(tl.int32), 0,
                    o_m, o_n, m_d, scale, CAUSAL=False, PREC=PREC,
                )
        for c0 in range(bos, row_end, BN):
            b_m, b_l, b_acc = _fwd_tile(
                b_m, b_l, b_acc, b_q, k + c0 * (HKV * D), v + c0 * (HKV * D), p_nd, (row_end - c0).to(tl.int32),
                (row0 - c0).to(tl.int32), o_m, o_n, m_d, scale, CAUSAL=True, PREC=PREC,
            )

    # Every real row sees at least its own row; padding rows are not stored.
    b_l = tl.where(b_l > 0.0, b_l, 1.0)
    b_o = b_acc / b_l[:, None]
    tl.store(o + p_md, b_o.to(o.dtype.element_ty), mask=m_rows[:, None] & m_d[None, :])
    tl.store(lse + o_m * H, b_m + tl.log(b_l), mask=m_rows)


@triton.jit
def _dq_tile(
    b_dq, b_q, b_do, b_lse, b_delta, p_k, p_v, p_nd, n_cols, diag, o_m, o_n, m_d, scale,
    CAUSAL: tl.constexpr, PREC: tl.constexpr,
):
    """dq contribution of a [BN]-row k/v tile to a [BM] query block (P recomputed from the lse);
    arguments as in `_fwd_tile`."""
    m_n = o_n < n_cols
    # [BN, BD]
    b_k = tl.load(p_k + p_nd, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(p_v + p_nd, mask=m_n[:, None] & m_d[None, :], other=0.0)
    # [BM, BN]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
    visible = m_n[None, :]
    if CAUSAL:
        visible = visible & (o_n[None, :] <= o_m[:, None] + diag)
    b_p = tl.where(visible, tl.exp(b_s - b_lse[:, None]), 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    b_ds = b_p * (b_dp - b_delta[:, None])
    return b_dq + tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)


@autotune(stages(4, (2, 3)), key=["G", "D", "BM", "BN"])
@triton.jit
def _tree_attn_dq_kernel(
    q, k, v, do, lse, delta, dq, qb_seg, qb_row, seg_start, seg_len, attn_offsets, attn_ranges, anc_depth, anc_len,
    scale,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, INVARIANT: tl.constexpr,
):
    HKV: tl.constexpr = H // G
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    i_s = tl.load(qb_seg + i_b)
    row0 = tl.load(qb_row + i_b)
    bos = tl.load(seg_start + i_s)
    row_end = tl.minimum(row0 + BM, bos + tl.load(seg_len + i_s))
    r_lo = tl.load(attn_offsets + i_s)
    r_hi = tl.load(attn_offsets + i_s + 1)
    q += row0 * (H * D) + i_h * D
    do += row0 * (H * D) + i_h * D
    dq += row0 * (H * D) + i_h * D
    lse += row0 * H + i_h
    delta += row0 * H + i_h
    k += (i_h // G) * D
    v += (i_h // G) * D

    o_m = tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_rows = o_m < (row_end - row0).to(tl.int32)
    p_md = o_m[:, None] * (H * D) + o_d[None, :]
    p_nd = o_n[:, None] * (HKV * D) + o_d[None, :]
    # [BM, BD]
    b_q = tl.load(q + p_md, mask=m_rows[:, None] & m_d[None, :], other=0.0)
    b_do = tl.load(do + p_md, mask=m_rows[:, None] & m_d[None, :], other=0.0)
    # [BM]
    b_lse = tl.load(lse + o_m * H, mask=m_rows, other=0.0)
    b_delta = tl.load(delta + o_m * H, mask=m_rows, other=0.0)
    b_dq = tl.zeros([BM, BD], dtype=tl.float32)

    if INVARIANT:
        A = tl.load(anc_len + i_s)
        d_end = A + (row_end - bos)
        i_cur = r_lo
        for d0 in range(0, d_end, BN):
            rows, i_cur = _depth_tile_rows(attn_ranges, anc_depth, i_cur, r_hi, d0, o_n, A, bos, BN)
            p_rows = rows[:, None] * (HKV * D) + o_d[None, :]
            b_dq = _dq_tile(
                b_dq, b_q, b_do, b_lse, b_delta, k, v, p_rows, (d_end - d0).to(tl.int32),
                (A + row0 - bos - d0).to(tl.int32), o_m, o_n, m_d, scale, CAUSAL=True, PREC=PREC,
            )
    else:
        for i_r in range(r_lo, r_hi):
            a = tl.load(attn_ranges + 2 * i_r)
            b = tl.load(attn_ranges + 2 * i_r + 1)
            for c0 in range(a, b, BN):
                b_dq = _dq_tile(
                    b_dq, b_q, b_do, b_lse, b_delta, k + c0 * (HKV * D), v + c0 * (HKV * D), p_nd,
                    (b - c0).to(tl.int32), 0, o_m, o_n, m_d, scale, CAUSAL=False, PREC=PREC,
                )
        for c0 in range(bos, row_end, BN):
            b_dq = _dq_tile(
                b_dq, b_q, b_do, b_lse, b_delta, k + c0 * (HKV * D), v + c0 * (HKV * D), p_nd,
                (row_end - c0).to(tl.int32), (row0 - c0).to(tl.int32), o_m, o_n, m_d, scale, CAUSAL=True, PREC=PREC,
            )
    tl.store(dq + p_md, (b_dq * scale).to(dq.dtype.element_ty), mask=m_rows[:, None] & m_d[None, :])


@autotune(stages(8, (1, 2)), key=["G", "D", "BM", "BN"])
@triton.jit
def _tree_attn_dkdv_kernel(
    q, k, v, do, lse, delta, dk, dv, qb_seg, qb_row, seg_start, seg_len,
    piece_offsets, piece_qb, piece_lo, piece_hi, piece_causal,
    scale, Rk,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):
    # One program per (kv block, query head): dk, dv of that head's share ([Rk, H, D]; the host
    # sums each group of G heads), so the heavy blocks (a prompt every branch sees) spread over H
    # programs rather than walking G heads in one.
    HKV: tl.constexpr = H // G
    i_j, i_h = tl.program_id(0), tl.program_id(1)
    c0 = i_j.to(tl.int64) * BN
    k += c0 * (HKV * D) + (i_h // G) * D
    v += c0 * (HKV * D) + (i_h // G) * D
    dk += c0 * (H * D) + i_h * D
    dv += c0 * (H * D) + i_h * D
    q += i_h * D
    do += i_h * D
    lse += i_h
    delta += i_h
    o_m = tl.arange(0, BM)
    o_n = tl.arange(0, BN)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_n = o_n < (Rk - c0).to(tl.int32)
    p_nd = o_n[:, None] * (HKV * D) + o_d[None, :]
    p_md = o_m[:, None] * (H * D) + o_d[None, :]
    # [BN, BD]
    b_k = tl.load(k + p_nd, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_v = tl.load(v + p_nd, mask=m_n[:, None] & m_d[None, :], other=0.0)
    b_dk = tl.zeros([BN, BD], dtype=tl.float32)
    b_dv = tl.zeros([BN, BD], dtype=tl.float32)

    p_lo = tl.load(piece_offsets + i_j)
    p_hi = tl.load(piece_offsets + i_j + 1)
    for i_p in range(p_lo, p_hi):
        i_b = tl.load(piece_qb + i_p)
        lo = (tl.load(piece_lo + i_p) - c0).to(tl.int32)
        hi = (tl.load(piece_hi + i_p) - c0).to(tl.int32)
        causal = tl.load(piece_causal + i_p)
        i_s = tl.load(qb_seg + i_b)
        row0 = tl.load(qb_row + i_b)
        row_end = tl.minimum(row0 + BM, tl.load(seg_start + i_s) + tl.load(seg_len + i_s))
        m_rows = o_m < (row_end - row0).to(tl.int32)
        diag = (row0 - c0).to(tl.int32)
        # [BN, BM]
        visible = ((o_n >= lo) & (o_n < hi))[:, None] & m_rows[None, :]
        visible = visible & ((causal == 0) | (o_n[:, None] <= o_m[None, :] + diag))
        # [BM, BD]
        b_q = tl.load(q + row0 * (H * D) + p_md, mask=m_rows[:, None] & m_d[None, :], other=0.0)
        b_do = tl.load(do + row0 * (H * D) + p_md, mask=m_rows[:, None] & m_d[None, :], other=0.0)
        # [BM]
        b_lse = tl.load(lse + row0 * H + o_m * H, mask=m_rows, other=0.0)
        b_delta = tl.load(delta + row0 * H + o_m * H, mask=m_rows, other=0.0)
        # [BN, BM]
        b_sT = tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * scale
        b_pT = tl.where(visible, tl.exp(b_sT - b_lse[None, :]), 0.0)
        b_dv += tl.dot(b_pT.to(b_do.dtype), b_do, input_precision=PREC)
        b_dpT = tl.dot(b_v, tl.trans(b_do), input_precision=PREC)
        b_dsT = b_pT * (b_dpT - b_delta[None, :])
        b_dk += tl.dot(b_dsT.to(b_q.dtype), b_q, input_precision=PREC)
    p_out = o_n[:, None] * (H * D) + o_d[None, :]
    tl.store(dk + p_out, (b_dk * scale).to(dk.dtype.element_ty), mask=m_n[:, None] & m_d[None, :])
    tl.store(dv + p_out, b_dv.to(dv.dtype.element_ty), mask=m_n[:, None] & m_d[None, :])


@autotune(stages(4, (2,)), key=["D"])
@triton.jit
def _tree_attn_delta_kernel(o, do, delta, R, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr):
    # delta = rowsum(o * do) per (row, head), a [BD] reduction whose order depends on D only.
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    row0 = i_b.to(tl.int64) * BM
    o += row0 * (H * D) + i_h * D
    do += row0 * (H * D) + i_h * D
    delta += row0 * H + i_h
    o_m = tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_rows = o_m < (R - row0).to(tl.int32)
    m = m_rows[:, None] & (o_d < D)[None, :]
    p = o_m[:, None] * (H * D) + o_d[None, :]
    # [BM, BD]
    b_o = tl.load(o + p, mask=m, other=0.0).to(tl.float32)
    b_do = tl.load(do + p, mask=m, other=0.0).to(tl.float32)
    tl.store(delta + o_m * H, tl.sum(b_o * b_do, axis=1), mask=m_rows)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation; tests replace it with NaN-filled buffers to prove every element is written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _sum_groups(x_KHD: torch.Tensor, Hkv: int) -> torch.Tensor:
    """[Rk, H, D] -> [Rk, Hkv, D]: each kv head's G query-head shares added in head order, by
    elementwise adds (a fixed order whatever Rk; a `sum` over the head dim may pick its reduction
    strategy by the tensor's shape)."""
    Rk, H, D = x_KHD.shape
    x = x_KHD.view(Rk, Hkv, H // Hkv, D)
    out = x[:, :, 0].clone()
    for g in range(1, H // Hkv):
        out += x[:, :, g]
    return out


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (the default tf32 would miss the reference by ~1e-3).
    return "ieee" if dtype == torch.float32 else "tf32"


def _segments(layout: TreeLayout) -> dict:
    return dict(
        qb_seg=layout.blocks.seg_NB, qb_row=layout.blocks.row_NB, seg_start=layout.seg_start_S,
        seg_len=layout.seg_len_S,
    )


def _keys(layout: TreeLayout) -> dict:
    """What the query-major kernels walk: the ancestor ranges and their depths."""
    return dict(attn_offsets=layout.attn_offsets_S1, attn_ranges=layout.attn_ranges_2n, anc_depth=layout.anc_depth_n,
                anc_len=layout.anc_len_S)


class _TreeAttentionTriton(torch.autograd.Function):
    """Forward saves the fp32 log-sum-exp; backward recomputes P from it."""

    @staticmethod
    def forward(ctx, q_RHD, k_KHD, v_KHD, layout: TreeLayout, scale: float, invariant: bool):
        R, H, D = q_RHD.shape
        Hkv = k_KHD.shape[1]
        dev = q_RHD.device
        q_RHD, k_KHD, v_KHD = q_RHD.contiguous(), k_KHD.contiguous(), v_KHD.contiguous()
        o_RHD = _empty((R, H, D), q_RHD.dtype, dev)
        lse_RH = _empty((R, H), torch.float32, dev)
        consts = dict(
            H=H, G=H // Hkv, D=D, BM=layout.block_m, BN=layout.block_n, BD=max(16, triton.next_power_of_2(D)),
            PREC=_dot_precision(q_RHD.dtype),
        )
        NB = layout.blocks.seg_NB.numel()
        if NB:
            _tree_attn_fwd_kernel[(NB, H)](
                q=q_RHD, k=k_KHD, v=v_KHD, o=o_RHD, lse=lse_RH, **_segments(layout), **_keys(layout),
                scale=float(scale), **consts, INVARIANT=invariant,
            )
        ctx.save_for_backward(q_RHD, k_KHD, v_KHD, o_RHD, lse_RH)
        ctx.layout, ctx.consts, ctx.scale, ctx.invariant = layout, consts, float(scale), invariant
        return o_RHD

    @staticmethod
    def backward(ctx, do_RHD):
        q_RHD, k_KHD, v_KHD, o_RHD, lse_RH = ctx.saved_tensors
        layout, consts = ctx.layout, ctx.consts
        dev = q_RHD.device
        R, H, D = q_RHD.shape
        Rk, Hkv, _ = k_KHD.shape
        do_RHD = do_RHD.contiguous()
        delta_RH = _empty((R, H), torch.float32, dev)
        if R:
            _tree_attn_delta_kernel[(triton.cdiv(R, 64), H)](o=o_RHD, do=do_RHD, delta=delta_RH, R=R, H=H, D=D, BM=64,
                                                             BD=consts["BD"])
        dq_RHD = _empty((R, H, D), q_RHD.dtype, dev)
        # Per query head; summed over each kv head's G query heads below (in fp32 when G > 1).
        G = H // Hkv
        dk_KHD = _empty((Rk, H, D), k_KHD.dtype if G == 1 else torch.float32, dev)
        dv_KHD = _empty((Rk, H, D), v_KHD.dtype if G == 1 else torch.float32, dev)
        NB = layout.blocks.seg_NB.numel()
        if NB:
            _tree_attn_dq_kernel[(NB, H)](
                q=q_RHD, k=k_KHD, v=v_KHD, do=do_RHD, lse=lse_RH, delta=delta_RH, dq=dq_RHD, **_segments(layout),
                **_keys(layout), scale=ctx.scale, **consts, INVARIANT=ctx.invariant,
            )
        pieces = layout.pieces
        NKB = pieces.offsets_NKB1.numel() - 1
        if NKB:
            _tree_attn_dkdv_kernel[(NKB, H)](
                q=q_RHD, k=k_KHD, v=v_KHD, do=do_RHD, lse=lse_RH, delta=delta_RH, dk=dk_KHD, dv=dv_KHD,
                **_segments(layout), piece_offsets=pieces.offsets_NKB1, piece_qb=pieces.qblock_P,
                piece_lo=pieces.lo_P, piece_hi=pieces.hi_P, piece_causal=pieces.causal_P,
                scale=ctx.scale, Rk=Rk, **consts,
            )
        if G > 1:
            dk_KHD = _sum_groups(dk_KHD, Hkv).to(k_KHD.dtype)
            dv_KHD = _sum_groups(dv_KHD, Hkv).to(v_KHD.dtype)
        return dq_RHD, dk_KHD, dv_KHD, None, None, None


def tree_attention_triton(
    q_RHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, layout: TreeLayout, scale: float
) -> torch.Tensor:
    """Triton tree attention over a prepared layout; same result as `tree_attention_ref`.

    With `layout.batch_invariant` the forward and dq walk key tiles at fixed depths of each
    query's key sequence (rows gathered across its ranges): a row's output and dq get the bits of
    the same row of its path alone (the expanded run), however its ancestors are split into ranges.

    Additional requirements: inputs fp32/bf16/fp16 on the layout's device (CUDA, or CPU under
    TRITON_INTERPRET=1).
    """
    if q_RHD.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q: expected fp32/bf16/fp16 for backend='triton', got {q_RHD.dtype}; use backend='ref'")
    if not same_device(q_RHD.device, layout.device):
        raise ValueError(f"layout: expected one prepared on q's device {q_RHD.device}, got {layout.device} (use layout.to)")
    return _TreeAttentionTriton.apply(q_RHD, k_KHD, v_KHD, layout, scale, layout.batch_invariant)
