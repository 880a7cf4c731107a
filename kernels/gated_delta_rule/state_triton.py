"""Triton kernels of the gated delta rule's inter-chunk state recurrence, forward and backward.

One program per (rank, head, block of BV value columns) walks its sequence's chunks in order
(`_state_fwd_kernel`: h, vnew, exported states) or in reverse (`_state_bwd_kernel`: dh, dvnew, the
initial state's gradient, with gradients injected on exported states), the fp32 state block in
registers. Formulas: docs/design/execution.md ("The gated delta rule").
Legend: T packed rows, M chunk slots, N sequences (ranks), U distinct exported states, H heads,
K key dim, V value dim; tiles: BT = C rows, BK >= K, BV value columns.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_tuning import autotune, stages

# Numerics fixed per kernel (kernels/triton_tuning.py), tuned over num_stages: BV = 32 on 4 warps
# (forward) and 8 warps (backward). Spills at K = V = 128 (ptxas for sm_90,
# scripts/triton_aot_check.py --all-configs): 2 warps, and BV = 64 on 4 warps.


@triton.heuristics({
    "HAS_H0": lambda args: args["h0"] is not None,
    "EXPORT": lambda args: args["states"] is not None,
})
@autotune(stages(4, (2, 3), BV=32), key=["K", "V", "BT", "BK"])
@triton.jit
def _state_fwd_kernel(
    k, w, u, G, h0, h, vnew, states,
    chunk_row, chunk_end, chunk_off, rank_chunks, rank_seq, export_row,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, EXPORT: tl.constexpr, PREC: tl.constexpr,
):
    i_r, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # int32 tile offsets: within a [K, V] state, and within a chunk's [BT, K] / [BT, V] rows
    p_kv = o_k[:, None] * V + o_v[None, :]
    p_tk = o_t[:, None] * (H * K) + o_k[None, :]
    p_tv = o_t[:, None] * (H * V) + o_v[None, :]
    # [BK, BV]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        seq = tl.load(rank_seq + i_r)
        b_S += tl.load(h0 + (seq * H + i_h) * (K * V) + p_kv, mask=m_kv, other=0.0).to(tl.float32)
    n_chunks = tl.load(rank_chunks + i_r)
    for j in range(0, n_chunks):
        m = tl.load(chunk_off + j) + i_r
        row0 = tl.load(chunk_row + m)
        n_t = (tl.load(chunk_end + m) - row0).to(tl.int32)
        m_t = o_t < n_t
        bh = row0 * H + i_h
        tl.store(h + (m * H + i_h) * (K * V) + p_kv, b_S.to(h.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        # [BT, BK]
        b_w = tl.load(w + bh * K + p_tk, mask=m_tk, other=0.0)
        b_k = tl.load(k + bh * K + p_tk, mask=m_tk, other=0.0)
        # [BT, BV]
        b_vn = tl.load(u + bh * V + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_vn -= tl.dot(b_w, b_S.to(b_w.dtype), input_precision=PREC)
        tl.store(vnew + bh * V + p_tv, b_vn.to(vnew.dtype.element_ty), mask=m_tv)
        # [BT]
        g_last = tl.load(G + bh + (n_t - 1) * H)
        b_G = tl.load(G + bh + o_t * H, mask=m_t, other=0.0)
        b_kd = b_k * tl.where(m_t, tl.exp(g_last - b_G).to(tl.float32), 0.0)[:, None]
        b_S = b_S * tl.exp(g_last).to(tl.float32)
        b_S += tl.dot(tl.trans(b_kd.to(b_k.dtype)), b_vn.to(b_k.dtype), input_precision=PREC)
        if EXPORT:
            e = tl.load(export_row + m)
            if e >= 0:
                tl.store(states + (e * H + i_h) * (K * V) + p_kv, b_S, mask=m_kv)


@triton.heuristics({
    "HAS_DH0": lambda args: args["dh0"] is not None,
    "HAS_DSTATES": lambda args: args["dstates"] is not None,
})
@autotune(stages(8, (2, 3), BV=32), key=["K", "V", "BT", "BK"])
@triton.jit
def _state_bwd_kernel(
    q, k, w, G, do, dv_local, dstates, dh, dv2, dh0,
    chunk_row, chunk_end, chunk_off, rank_chunks, rank_seq, export_row, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DH0: tl.constexpr, HAS_DSTATES: tl.constexpr, PREC: tl.constexpr,
):
    i_r, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_kv = o_k[:, None] * V + o_v[None, :]
    p_tk = o_t[:, None] * (H * K) + o_k[None, :]
    p_tv = o_t[:, None] * (H * V) + o_v[None, :]
    # [BK, BV] gradient on the state after the current chunk
    b_dS = tl.zeros([BK, BV], dtype=tl.float32)
    n_chunks = tl.load(rank_chunks + i_r)
    for jj in range(0, n_chunks):
        m = tl.load(chunk_off + (n_chunks - 1 - jj)) + i_r
        row0 = tl.load(chunk_row + m)
        n_t = (tl.load(chunk_end + m) - row0).to(tl.int32)
        m_t = o_t < n_t
        bh = row0 * H + i_h
        if HAS_DSTATES:
            e = tl.load(export_row + m)
            if e >= 0:
                b_dS += tl.load(dstates + (e * H + i_h) * (K * V) + p_kv, mask=m_kv, other=0.0)
        tl.store(dh + (m * H + i_h) * (K * V) + p_kv, b_dS.to(dh.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        # [BT]
        g_last = tl.load(G + bh + (n_t - 1) * H)
        b_G = tl.load(G + bh + o_t * H, mask=m_t, other=0.0)
        # [BT, BK]
        b_k = tl.load(k + bh * K + p_tk, mask=m_tk, other=0.0)
        b_w = tl.load(w + bh * K + p_tk, mask=m_tk, other=0.0)
        b_q = tl.load(q + bh * K + p_tk, mask=m_tk, other=0.0).to(tl.float32) * (scale * tl.exp(b_G).to(tl.float32))[:, None]
        b_kd = b_k * tl.where(m_t, tl.exp(g_last - b_G).to(tl.float32), 0.0)[:, None]
        # [BT, BV]
        b_do = tl.load(do + bh * V + p_tv, mask=m_tv, other=0.0)
        b_dv = tl.load(dv_local + bh * V + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dv += tl.dot(b_kd.to(b_k.dtype), b_dS.to(b_k.dtype), input_precision=PREC)
        tl.store(dv2 + bh * V + p_tv, b_dv.to(dv2.dtype.element_ty), mask=m_tv)
        b_dS = b_dS * tl.exp(g_last).to(tl.float32)
        b_dS += tl.dot(tl.trans(b_q.to(b_do.dtype)), b_do, input_precision=PREC)
        b_dS -= tl.dot(tl.trans(b_w), b_dv.to(b_w.dtype), input_precision=PREC)
    if HAS_DH0:
        seq = tl.load(rank_seq + i_r)
        tl.store(dh0 + (seq * H + i_h) * (K * V) + p_kv, b_dS.to(dh0.dtype.element_ty), mask=m_kv)
