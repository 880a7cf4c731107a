"""Triton kernels of the gated delta rule's output stage and its gradients.

Per chunk slot and head: `_out_fwd_kernel` (o), `_dv_local_kernel` (the intra-chunk part of the
gradient on vnew), `_dqkwg_kernel` (dq, dk, dw and dG as NK partial sums per block of BK key
columns; with TRANS_FREE, ds^T reaches its dot through a scratch tile, `_transposed_via_memory`:
`kernels.triton_640`). Formulas: docs/design/execution.md ("The gated delta rule").
Legend: T packed rows, M chunk slots, H heads, K key dim, V value dim, NK = ceil(K / BK);
tiles: BT = C rows, BK key columns, BV value columns.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_tuning import autotune, stages


@triton.jit
def _transposed_via_memory(b_x, scratch, slot, BT: tl.constexpr):
    """b_x^T for a [BT, BT] tile, written to scratch tile `slot` (int64) and read back transposed:
    the transpose-free form of `tl.trans(b_x)` for a dot result used as a dot operand (fla #640,
    kernels/triton_640.py). The tile is the calling program's own; the barrier makes its stores
    visible to all its threads."""
    o_t = tl.arange(0, BT)
    p = scratch + slot * (BT * BT)
    tl.store(p + o_t[:, None] * BT + o_t[None, :], b_x)
    tl.debug_barrier()
    return tl.load(p + o_t[None, :] * BT + o_t[:, None])


@autotune(stages(4, (2, 3)), key=["K", "V", "BT", "BK", "BV"])
@triton.jit
def _out_fwd_kernel(
    q, k, vnew, h, G, o, chunk_row, chunk_end, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    # chunk slots on grid axis 0 (axes 1 and 2 stop at 65535)
    i_m, i_v, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(chunk_row + i_m)
    n_t = (tl.load(chunk_end + i_m) - row0).to(tl.int32)
    bh = row0 * H + i_h
    q += bh * K
    k += bh * K
    vnew += bh * V
    o += bh * V
    G += bh
    h += (i_m * H + i_h) * (K * V)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    # [BT, BV]
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    # [BT, BT]
    b_qk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        p_tk = o_t[:, None] * (H * K) + o_k[None, :]
        # [BT, BK]
        b_q = tl.load(q + p_tk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + p_tk, mask=m_t[:, None] & m_k[None, :], other=0.0)
        # [BK, BV]
        b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_q, b_h, input_precision=PREC)
        b_qk += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    # [BT]
    b_G = tl.load(G + o_t * H, mask=m_t, other=0.0)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_P = b_qk * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf"))).to(tl.float32)
    p_tv = o_t[:, None] * (H * V) + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    b_vn = tl.load(vnew + p_tv, mask=m_tv, other=0.0)
    b_o = b_o * tl.exp(b_G).to(tl.float32)[:, None] + tl.dot(b_P.to(b_vn.dtype), b_vn, input_precision=PREC)
    tl.store(o + p_tv, (b_o * scale).to(o.dtype.element_ty), mask=m_tv)


@autotune(stages(8, (2, 3)), key=["K", "V", "BT", "BK", "BV"])
@triton.jit
def _dv_local_kernel(
    q, k, G, do, dv, chunk_row, chunk_end, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(chunk_row + i_m)
    n_t = (tl.load(chunk_end + i_m) - row0).to(tl.int32)
    bh = row0 * H + i_h
    q += bh * K
    k += bh * K
    do += bh * V
    dv += bh * V
    G += bh
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    # [BT, BT] (i, j) = k_i . q_j
    b_kq = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        p_tk = o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        # [BT, BK]
        b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
        b_kq += tl.dot(b_k, tl.trans(b_q), input_precision=PREC)
    b_G = tl.load(G + o_t * H, mask=m_t, other=0.0)
    upper = (o_t[:, None] <= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    # P^T: P[j, i] = q_j . k_i D_ji for j >= i
    b_PT = b_kq * scale * tl.exp(tl.where(upper, b_G[None, :] - b_G[:, None], float("-inf"))).to(tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        # [BT, BV]
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_dv = tl.dot(b_PT.to(b_do.dtype), b_do, input_precision=PREC)
        tl.store(dv + p_tv, b_dv.to(dv.dtype.element_ty), mask=m_tv)


@autotune(stages(8, (2, 3)), key=["K", "V", "BT", "BK", "BV"])
@triton.jit
def _dqkwg_kernel(
    q, k, vnew, h, do, dh, dv2, G, dq, dk, dw, dg, scratch, chunk_row, chunk_end, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, TRANS_FREE: tl.constexpr,
):
    i_m, i_k, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    row0 = tl.load(chunk_row + i_m)
    n_t = (tl.load(chunk_end + i_m) - row0).to(tl.int32)
    bh = row0 * H + i_h
    q += bh * K
    k += bh * K
    dq += bh * K
    dk += bh * K
    dw += bh * K
    vnew += bh * V
    do += bh * V
    dv2 += bh * V
    G += bh
    dg += i_k * T * H + bh
    h += (i_m * H + i_h) * (K * V)
    dh += (i_m * H + i_h) * (K * V)
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    # [BT, BK]
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    # [BT, BT] (do vnew^T)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    # [BK] row sums of h * dh
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_tv = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        # [BT, BV]
        b_vn = tl.load(vnew + p_tv, mask=m_tv, other=0.0)
        b_do = tl.load(do + p_tv, mask=m_tv, other=0.0)
        b_dv = tl.load(dv2 + p_tv, mask=m_tv, other=0.0)
        # [BK, BV]
        p_kv = o_k[:, None] * V + o_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_h = tl.load(h + p_kv, mask=m_kv, other=0.0)
        b_dh = tl.load(dh + p_kv, mask=m_kv, other=0.0)
        b_ds += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dk += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
        b_dw += tl.dot(b_dv, tl.trans(b_h), input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    p_tk = o_t[:, None] * (H * K) + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    tl.store(dw + p_tk, (-b_dw).to(dw.dtype.element_ty), mask=m_tk)

    # [BT, BK]
    b_q = tl.load(q + p_tk, mask=m_tk, other=0.0)
    b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
    DT = b_k.dtype
    # [BT]
    b_G = tl.load(G + o_t * H, mask=m_t, other=0.0)
    g_last = tl.load(G + (n_t - 1) * H)
    b_dq = b_dq * (scale * tl.exp(b_G).to(tl.float32))[:, None]
    b_dk = b_dk * tl.where(m_t, tl.exp(g_last - b_G).to(tl.float32), 0.0)[:, None]
    dg_last = tl.sum(b_hdh, axis=0) * tl.exp(g_last).to(tl.float32) + tl.sum(b_dk * b_k.to(tl.float32))
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_ds = b_ds * scale * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf"))).to(tl.float32)
    if G.dtype.element_ty == tl.float64:
        # Reference precision: the intra-chunk term of dG as row sums minus column sums of
        # M = dP * P (P = scale (q k^T) * D), summed in float64 like the reference's decay backward,
        # instead of q.dq - k.dk, whose two large fp32 terms cancel.
        b_M = (b_ds * tl.dot(b_q, tl.trans(b_k), input_precision=PREC)).to(tl.float64)
        b_dG = tl.sum((b_dq * b_q.to(tl.float32)).to(tl.float64), axis=1)
        b_dG -= tl.sum((b_dk * b_k.to(tl.float32)).to(tl.float64), axis=1)
        b_dG += tl.sum(b_M, axis=1) - tl.sum(b_M, axis=0)
    b_dq += tl.dot(b_ds.to(DT), b_k, input_precision=PREC)
    if TRANS_FREE:
        b_dk += tl.dot(_transposed_via_memory(b_ds.to(DT), scratch, (i_m * tl.num_programs(1) + i_k) * H + i_h, BT),
                       b_q, input_precision=PREC)
    else:
        # fla #640: miscompiled on Hopper by Triton 3.4 - 3.7.0 at BK = 64 (kernels/triton_640.py).
        b_dk += tl.dot(tl.trans(b_ds.to(DT)), b_q, input_precision=PREC)
    if G.dtype.element_ty != tl.float64:
        b_dG = tl.sum(b_dq * b_q.to(tl.float32), axis=1) - tl.sum(b_dk * b_k.to(tl.float32), axis=1)
    b_dG = tl.where(o_t == n_t - 1, b_dG + dg_last, b_dG)
    tl.store(dq + p_tk, b_dq.to(dq.dtype.element_ty), mask=m_tk)
    tl.store(dk + p_tk, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dg + o_t * H, b_dG.to(dg.dtype.element_ty), mask=m_t)
