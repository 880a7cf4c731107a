"""Triton kernels of the gated delta rule's per-chunk WY representation, forward and backward.

One program per (chunk slot, head): `_kkt_fwd_kernel` (G, A), `_solve_kernel` (Ai = (I + A)^-1
by blocked forward substitution), `_wu_fwd_kernel` (w, u), `_wy_bwd_kernel` (dk, dv, dbeta, dg;
with TRANS_FREE, dM^T reaches its dot through a scratch tile: `kernels.triton_640`). Gates in the
dtype of G, which the host picks (float64 for fp32 inputs). Formulas and precision:
docs/design/execution.md ("The gated delta rule").
Legend: T packed rows, M chunk slots, H heads, K key dim, V value dim, NK key blocks of the
output-stage gradients; tiles: BT = C rows, BK key columns, BV value columns.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.gated_delta_rule.output_triton import _transposed_via_memory
from kernels.triton_tuning import autotune, stages


@autotune(stages(4, (2, 3)), key=["K", "BT", "BK"])
@triton.jit
def _kkt_fwd_kernel(
    k, g, beta, G, A, chunk_row, chunk_end,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(chunk_row + i_m)
    n_t = (tl.load(chunk_end + i_m) - row0).to(tl.int32)
    bh = row0 * H + i_h
    g += bh
    beta += bh
    G += bh
    k += bh * K
    A += bh * BT
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    # [BT]
    b_g = tl.load(g + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_G = tl.cumsum(b_g.to(G.dtype.element_ty), axis=0)
    tl.store(G + o_t * H, b_G, mask=m_t)
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    # [BT, BT]
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        # [BT, BK]
        b_k = tl.load(k + o_t[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    lower = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    # Masked exponents are -inf (not the upper part's differences, which may overflow): exact zeros.
    b_A = b_kk * b_beta[:, None] * tl.exp(tl.where(lower, b_G[:, None] - b_G[None, :], float("-inf"))).to(tl.float32)
    tl.store(A + o_t[:, None] * (H * BT) + o_t[None, :], b_A, mask=m_t[:, None])


@triton.jit
def _load_block16(A, r0, c0, n_t, H: tl.constexpr, BT: tl.constexpr):
    """[16, 16] block of the chunk's matrix A (based at its first row) at chunk rows r0.., columns
    c0.. (rows >= n_t read as zeros)."""
    o_i = tl.arange(0, 16)
    return tl.load(A + (r0 + o_i)[:, None] * (H * BT) + c0 + o_i[None, :], mask=(r0 + o_i < n_t)[:, None], other=0.0)


@triton.jit
def _store_block16(Ai, b_X, r0, c0, n_t, H: tl.constexpr, BT: tl.constexpr):
    """Write the [16, 16] block b_X of the chunk's Ai at chunk rows r0.., columns c0.. (rows < n_t)."""
    o_i = tl.arange(0, 16)
    p = Ai + (r0 + o_i)[:, None] * (H * BT) + c0 + o_i[None, :]
    tl.store(p, b_X.to(Ai.dtype.element_ty), mask=(r0 + o_i < n_t)[:, None])


@triton.jit
def _inv_diag_block16(A, r0, n_t, H: tl.constexpr, BT: tl.constexpr):
    """(I + A_bb)^-1 of the strictly lower 16 x 16 diagonal block A_bb at chunk rows and columns r0..

    Forward substitution on X = (I + A_bb)^-1 - I, top row first: X_i = -A_i - A_i X, where row A_i
    is zero from column i on, so only the rows of X above i (already final) contribute.
    """
    o_i = tl.arange(0, 16)
    # [16, 16]
    b_X = tl.zeros([16, 16], dtype=tl.float32)
    for i in range(1, 16):
        # [16]
        b_a = -tl.load(A + (r0 + i) * (H * BT) + r0 + o_i, mask=(o_i < i) & (r0 + i < n_t), other=0.0)
        b_a = b_a + tl.sum(b_a[:, None] * b_X, axis=0)
        b_X = tl.where((o_i == i)[:, None], b_a[None, :], b_X)
    return b_X + tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)


@autotune(stages(2, (2,)), key=["BT"])
@triton.jit
def _solve_kernel(A, Ai, chunk_row, chunk_end, H: tl.constexpr, BT: tl.constexpr):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(chunk_row + i_m)
    n_t = (tl.load(chunk_end + i_m) - row0).to(tl.int32)
    A += (row0 * H + i_h) * BT
    Ai += (row0 * H + i_h) * BT
    zero = tl.zeros([16, 16], dtype=tl.float32)
    # Block forward substitution: X_ii = (I + A_ii)^-1, X_ij = -X_ii sum_{j <= l < i} A_il X_lj.
    X11 = _inv_diag_block16(A, 0, n_t, H, BT)
    _store_block16(Ai, X11, 0, 0, n_t, H, BT)
    if BT >= 32:
        X22 = _inv_diag_block16(A, 16, n_t, H, BT)
        A21 = _load_block16(A, 16, 0, n_t, H, BT)
        X21 = -tl.dot(X22, tl.dot(A21, X11, input_precision="ieee"), input_precision="ieee")
        _store_block16(Ai, zero, 0, 16, n_t, H, BT)
        _store_block16(Ai, X21, 16, 0, n_t, H, BT)
        _store_block16(Ai, X22, 16, 16, n_t, H, BT)
    if BT == 64:
        X33 = _inv_diag_block16(A, 32, n_t, H, BT)
        X44 = _inv_diag_block16(A, 48, n_t, H, BT)
        A31 = _load_block16(A, 32, 0, n_t, H, BT)
        A32 = _load_block16(A, 32, 16, n_t, H, BT)
        A41 = _load_block16(A, 48, 0, n_t, H, BT)
        A42 = _load_block16(A, 48, 16, n_t, H, BT)
        A43 = _load_block16(A, 48, 32, n_t, H, BT)
        X32 = -tl.dot(X33, tl.dot(A32, X22, input_precision="ieee"), input_precision="ieee")
        X31 = -tl.dot(
            X33, tl.dot(A31, X11, input_precision="ieee") + tl.dot(A32, X21, input_precision="ieee"),
            input_precision="ieee",
        )
        X43 = -tl.dot(X44, tl.dot(A43, X33, input_precision="ieee"), input_precision="ieee")
        X42 = -tl.dot(
            X44, tl.dot(A42, X22, input_precision="ieee") + tl.dot(A43, X32, input_precision="ieee"),
            input_precision="ieee",
        )
        X41 = -tl.dot(
            X44,
            tl.dot(A41, X11, input_precision="ieee") + tl.dot(A42, X21, input_precision="ieee")
            + tl.dot(A43, X31, input_precision="ieee"),
            input_precision="ieee",
        )
        _store_block16(Ai, zero, 0, 32, n_t, H, BT)
        _store_block16(Ai, zero, 0, 48, n_t, H, BT)
        _store_block16(Ai, zero, 16, 32, n_t, H, BT)
        _store_block16(Ai, zero, 16, 48, n_t, H, BT)
        _store_block16(Ai, X31, 32, 0, n_t, H, BT)
        _store_block16(Ai, X32, 32, 16, n_t, H, BT)
        _store_block16(Ai, X33, 32, 32, n_t, H, BT)
        _store_block16(Ai, zero, 32, 48, n_t, H, BT)
        _store_block16(Ai, X41, 48, 0, n_t, H, BT)
        _store_block16(Ai, X42, 48, 16, n_t, H, BT)
        _store_block16(Ai, X43, 48, 32, n_t, H, BT)
        _store_block16(Ai, X44, 48, 48, n_t, H, BT)


@autotune(stages(4, (2, 3)), key=["K", "V", "BT", "BK", "BV"])
@triton.jit
def _wu_fwd_kernel(
    k, v, beta, G, Ai, w, u, chunk_row, chunk_end,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(chunk_row + i_m)
    n_t = (tl.load(chunk_end + i_m) - row0).to(tl.int32)
    bh = row0 * H + i_h
    k += bh * K
    w += bh * K
    v += bh * V
    u += bh * V
    beta += bh
    G += bh
    Ai += bh * BT
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    # [BT, BT]
    b_Ai = tl.load(Ai + o_t[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
    # [BT]
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_eG = tl.exp(tl.load(G + o_t * H, mask=m_t, other=0.0)).to(tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        # [BT, BV]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
        b_u = tl.dot(b_Ai, (b_v * b_beta[:, None]).to(b_Ai.dtype), input_precision=PREC)
        tl.store(u + p_v, b_u.to(u.dtype.element_ty), mask=m_tv)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        # [BT, BK]
        b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
        b_w = tl.dot(b_Ai, (b_k * (b_beta * b_eG)[:, None]).to(b_Ai.dtype), input_precision=PREC)
        tl.store(w + p_k, b_w.to(w.dtype.element_ty), mask=m_tk)


@autotune(stages(8, (2, 3)), key=["K", "V", "BT", "BK", "BV", "NK"])
@triton.jit
def _wy_bwd_kernel(
    k, v, beta, G, Ai, dw, du, dk_in, dg_in, dk, dv, dbeta, dg, scratch, chunk_row, chunk_end, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, NK: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, TRANS_FREE: tl.constexpr,
):
    i_m, i_h = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(chunk_row + i_m)
    n_t = (tl.load(chunk_end + i_m) - row0).to(tl.int32)
    bh = row0 * H + i_h
    k += bh * K
    dw += bh * K
    dk_in += bh * K
    dk += bh * K
    v += bh * V
    du += bh * V
    dv += bh * V
    beta += bh
    G += bh
    dg_in += bh
    dg += bh
    dbeta += bh
    Ai += bh * BT
    o_t = tl.arange(0, BT)
    m_t = o_t < n_t
    # [BT, BT] Ai^T: element (i, j) is Ai[j, i]
    b_AiT = tl.load(Ai + o_t[None, :] * (H * BT) + o_t[:, None], mask=m_t[None, :], other=0.0)
    DT = b_AiT.dtype
    # [BT]
    b_beta = tl.load(beta + o_t * H, mask=m_t, other=0.0).to(tl.float32)
    b_G = tl.load(G + o_t * H, mask=m_t, other=0.0)
    b_eG = tl.exp(b_G).to(tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    b_dG = tl.zeros([BT], dtype=G.dtype.element_ty)
    # [BT, BT]
    b_dAi = tl.zeros([BT, BT], dtype=tl.float32)

    # w = Ai (beta exp(G) k): d(beta exp(G) k) = Ai^T dw, dAi += dw (beta exp(G) k)^T
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        # [BT, BK]
        b_k = tl.load(k + p_k, mask=m_tk, other=0.0).to(tl.float32)
        b_dw = tl.load(dw + p_k, mask=m_tk, other=0.0)
        b_kbg = b_k * (b_beta * b_eG)[:, None]
        b_dAi += tl.dot(b_dw, tl.trans(b_kbg.to(DT)), input_precision=PREC)
        b_dkbg = tl.dot(b_AiT, b_dw.to(DT), input_precision=PREC)
        b_dbeta += tl.sum(b_dkbg * b_k * b_eG[:, None], axis=1)
        b_dG += tl.sum((b_dkbg * b_kbg).to(b_dG.dtype), axis=1)
        b_dk = tl.load(dk_in + p_k, mask=m_tk, other=0.0) + b_dkbg * (b_beta * b_eG)[:, None]
        tl.store(dk + p_k, b_dk, mask=m_tk)
    # u = Ai (beta v)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        p_v = o_t[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        # [BT, BV]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_du = tl.load(du + p_v, mask=m_tv, other=0.0)
        b_dAi += tl.dot(b_du, tl.trans((b_v * b_beta[:, None]).to(DT)), input_precision=PREC)
        b_dvb = tl.dot(b_AiT, b_du.to(DT), input_precision=PREC)
        b_dbeta += tl.sum(b_dvb * b_v, axis=1)
        tl.store(dv + p_v, (b_dvb * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)

    # Ai = (I + A)^-1 with A strictly lower: only the strictly lower parts of dAi and dA count.
    strict = (o_t[:, None] > o_t[None, :]) & m_t[:, None] & m_t[None, :]
    b_dAi = tl.where(strict, b_dAi, 0.0)
    b_dA = tl.dot(b_dAi.to(DT), b_AiT, input_precision=PREC)
    b_dA = tl.dot(b_AiT, b_dA.to(DT), input_precision=PREC)
    # [BT, BT] gradient on beta_i k_i.k_j (A is that times the decay)
    b_dM = -b_dA * tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], float("-inf"))).to(tl.float32)
    # The second pass re-reads this program's dk stores: make them visible to every thread.
    tl.debug_barrier()
    if TRANS_FREE:
        b_dMT = _transposed_via_memory(b_dM.to(DT), scratch, i_m.to(tl.int64) * H + i_h, BT)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        p_k = o_t[:, None] * (H * K) + o_k[None, :]
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        # [BT, BK]
        b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
        b_kb = (b_k.to(tl.float32) * b_beta[:, None]).to(DT)
        b_kk += tl.dot(b_kb, tl.trans(b_k.to(DT)), input_precision=PREC)
        b_dkb = tl.dot(b_dM.to(DT), b_k.to(DT), input_precision=PREC)
        b_dbeta += tl.sum(b_dkb * b_k.to(tl.float32), axis=1)
        b_dk = tl.load(dk + p_k, mask=m_tk, other=0.0) + b_dkb * b_beta[:, None]
        if TRANS_FREE:
            b_dk += tl.dot(b_dMT, b_kb, input_precision=PREC)
        else:
            # fla #640: miscompiled on Hopper by Triton 3.4 - 3.7.0 (kernels/triton_640.py).
            b_dk += tl.dot(tl.trans(b_dM.to(DT)), b_kb, input_precision=PREC)
        tl.store(dk + p_k, b_dk, mask=m_tk)
    b_dMA = b_dM * b_kk
    b_dMA = b_dMA.to(b_dG.dtype)
    b_dG += tl.sum(b_dMA, axis=1) - tl.sum(b_dMA, axis=0)
    for i_k in range(0, NK):
        b_dG += tl.load(dg_in + i_k * T * H + o_t * H, mask=m_t, other=0.0)
    # dg_i = sum of dG over the chunk's rows t >= i
    b_dg = tl.cumsum(tl.where(m_t, b_dG, 0.0), axis=0, reverse=True)
    tl.store(dg + o_t * H, b_dg.to(dg.dtype.element_ty), mask=m_t)
    tl.store(dbeta + o_t * H, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
