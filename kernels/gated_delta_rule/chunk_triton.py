"""Triton forward of the varlen chunked gated delta rule; backward by recomputing the reference.

Same contract and math as `chunk_ref` (see its docstring). One program per (sequence, head, V block)
walks its sequence's chunks in order with the state block S [K, BV] in registers; per chunk it builds
the strictly lower coupling A, inverts (I + A) by forward substitution over rows, forms U and W,
writes the outputs and, where asked, the fp32 state. The backward (`torch.autograd.Function`)
recomputes `chunk_ref` under autograd: gradients are those of the reference, not a Triton backward.

On CPU, run with `TRITON_INTERPRET=1` set before triton is imported (fp32 only: the interpreter's
bf16 is wrong). The wrapper rejects float64 (Triton has no fp64 `tl.dot` path worth testing here).

Legend: T packed rows, N sequences, M chunks, U distinct exported states, E exported states,
H heads, K key dim, V value dim; tiles: BT = C rows, BK >= K, BV value columns per program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.chunk_ref import chunk_gated_delta_rule_ref
from kernels.gated_delta_rule.layout import validate_inputs
from kernels.gated_delta_rule.naive import L2NORM_EPS


@triton.heuristics({"HAS_INIT": lambda args: args["h0"] is not None})
@triton.jit
def _gdr_fwd_kernel(
    q, k, v, g, beta, h0, o, states, cu_seqlens, chunk_base, export_slot,
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, EPS: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    base = tl.load(chunk_base + i_n).to(tl.int64)
    n_chunks = tl.cdiv(eos - bos, BT)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    lower = o_t[:, None] > o_t[None, :]
    causal = o_t[:, None] >= o_t[None, :]

    # [BK, BV]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        p_h0 = h0 + ((i_n * H + i_h) * K).to(tl.int64) * V + o_k[:, None] * V + o_v[None, :]
        S = tl.load(p_h0, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)

    for j in range(0, n_chunks):
        rows = bos + j * BT + o_t
        m_t = rows < eos
        # [BT, BK]
        p_qk = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_q = tl.load(q + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(k + p_qk, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        # [BT, BV]
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        # [BT]
        b_g = tl.load(g + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=1) + EPS)[:, None]
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + EPS)[:, None]
        b_q = b_q * scale

        b_G = tl.cumsum(b_g, axis=0)
        G_last = tl.sum(tl.where(o_t == BT - 1, b_G, 0.0), axis=0)
        # [BT, BT]; the unused upper part may overflow to inf before the where drops it
        b_decay = tl.where(causal, tl.exp(b_G[:, None] - b_G[None, :]), 0.0)
        b_kbeta = b_k * b_beta[:, None]
        b_A = tl.dot(b_kbeta, tl.trans(b_k), input_precision="ieee") * b_decay
        b_A = tl.where(lower, b_A, 0.0)
        # (I + A)^-1 = I + Ai, Ai strictly lower, row by row: Ai[i] = -A[i] - A[i] Ai
        b_Ai = tl.zeros([BT, BT], dtype=tl.float32)
        for i in range(1, BT):
            a_i = -tl.sum(tl.where(o_t[:, None] == i, b_A, 0.0), axis=0)
            a_i = a_i + tl.sum(a_i[:, None] * b_Ai, axis=0)
            b_Ai = tl.where(o_t[:, None] == i, a_i[None, :], b_Ai)
        b_Ai = b_Ai + tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
        b_u = tl.dot(b_Ai, b_v * b_beta[:, None], input_precision="ieee")
        b_w = tl.dot(b_Ai, b_kbeta * tl.exp(b_G)[:, None], input_precision="ieee")

        b_vnew = b_u - tl.dot(b_w, S, input_precision="ieee")
        b_attn = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * b_decay
        b_o = tl.dot(b_q * tl.exp(b_G)[:, None], S, input_precision="ieee")
        b_o += tl.dot(b_attn, b_vnew, input_precision="ieee")
        tl.store(o + p_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        b_kdec = b_k * tl.exp(G_last - b_G)[:, None]
        S = S * tl.exp(G_last) + tl.dot(tl.trans(b_kdec), b_vnew, input_precision="ieee")
        slot = tl.load(export_slot + base + j).to(tl.int64)
        if slot >= 0:
            p_s = states + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
            tl.store(p_s, S, mask=m_k[:, None] & m_v[None, :])


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation; tests replace it with NaN-filled buffers to prove every element is written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _forward(
    q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state, export_seq, export_pos, chunk_size, scale,
    use_qk_l2norm,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel; returns o [T, H, V] (v's dtype) and states [E, H, K, V] fp32."""
    T, H, K = q_THK.shape
    V = v_THV.shape[-1]
    C = chunk_size
    dev = q_THK.device
    cu = cu_seqlens.cpu().long()
    n_chunks_N = (cu[1:] - cu[:-1] + C - 1) // C
    chunk_base_N = torch.cumsum(n_chunks_N, 0) - n_chunks_N
    M = int(n_chunks_N.sum())
    # One buffer row per distinct (sequence, chunk) asked for; duplicates share it.
    slot_of_E = chunk_base_N[export_seq.cpu().long()] + (export_pos.cpu().long() + C - 1) // C - 1
    uniq_U, inverse_E = torch.unique(slot_of_E, return_inverse=True)
    export_slot_M = torch.full((M,), -1, dtype=torch.int32)
    export_slot_M[uniq_U] = torch.arange(uniq_U.numel(), dtype=torch.int32)

    o_THV = _empty((T, H, V), v_THV.dtype, dev)
    states_UHKV = _empty((uniq_U.numel(), H, K, V), torch.float32, dev)
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(32, triton.next_power_of_2(V)))
    h0 = None if initial_state is None else initial_state.to(device=dev, dtype=torch.float32).contiguous()
    grid = (cu.numel() - 1, H, triton.cdiv(V, BV))
    _gdr_fwd_kernel[grid](
        q=q_THK.contiguous(), k=k_THK.contiguous(), v=v_THV.contiguous(), g=g_TH.contiguous(),
        beta=beta_TH.contiguous(), h0=h0, o=o_THV, states=states_UHKV,
        cu_seqlens=cu.to(dev), chunk_base=chunk_base_N.to(dev), export_slot=export_slot_M.to(dev),
        scale=float(K**-0.5 if scale is None else scale),
        H=H, K=K, V=V, BT=C, BK=BK, BV=BV, USE_L2NORM=use_qk_l2norm, EPS=L2NORM_EPS,
    )
    return o_THV, states_UHKV.index_select(0, inverse_E.to(dev))


class _ChunkGatedDeltaRuleTriton(torch.autograd.Function):
    """Triton forward; backward recomputes `chunk_gated_delta_rule_ref` and differentiates it."""

    @staticmethod
    def forward(ctx, q_THK, k_THK, v_THV, g_TH, beta_TH, initial_state, cfg):
        ctx.cfg = cfg
        ctx.save_for_backward(q_THK, k_THK, v_THV, g_TH, beta_TH, initial_state)
        ctx.has_init = initial_state is not None
        return _forward(
            q_THK, k_THK, v_THV, g_TH, beta_TH, cfg["cu_seqlens"], initial_state, cfg["export_seq"],
            cfg["export_pos"], cfg["chunk_size"], cfg["scale"], cfg["use_qk_l2norm"],
        )

    @staticmethod
    def backward(ctx, do_THV, dstates_EHKV):
        saved = ctx.saved_tensors
        inputs = [None if x is None else x.detach().requires_grad_(True) for x in saved]
        with torch.enable_grad():
            o_THV, states_EHKV = chunk_gated_delta_rule_ref(*inputs[:5], initial_state=inputs[5], **ctx.cfg)
        outs, cots = [o_THV], [do_THV]
        if states_EHKV.numel():
            outs.append(states_EHKV)
            cots.append(dstates_EHKV)
        wrt = [x for x in inputs if x is not None]
        grads = iter(torch.autograd.grad(outs, wrt, cots, allow_unused=True))
        result = [None if x is None else next(grads) for x in inputs]
        return (*result, None)


def chunk_gated_delta_rule_triton(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    export_seq: torch.Tensor,
    export_pos: torch.Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton-forward chunked gated delta rule; same arguments and results as `chunk_gated_delta_rule_ref`.

    Additional requirements: chunk_size a power of two >= 16 (tl.dot tiles), K <= 256, inputs
    fp32/bf16/fp16 (not float64).
    """
    validate_inputs(
        q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state, export_seq, export_pos, chunk_size
    )
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two >= 16 for backend='triton', got {chunk_size}")
    K = q_THK.shape[-1]
    if K > 256:
        raise ValueError(f"q: expected K <= 256 for backend='triton', got K={K}; use backend='ref'")
    for name, x in (("q", q_THK), ("k", k_THK), ("v", v_THV)):
        if x.dtype == torch.float64:
            raise ValueError(f"{name}: expected fp32/bf16/fp16 for backend='triton', got float64; use backend='ref'")
    cfg = dict(
        cu_seqlens=cu_seqlens, export_seq=export_seq, export_pos=export_pos, chunk_size=chunk_size,
        scale=scale, use_qk_l2norm=use_qk_l2norm,
    )
    return _ChunkGatedDeltaRuleTriton.apply(q_THK, k_THK, v_THV, g_TH, beta_TH, initial_state, cfg)
