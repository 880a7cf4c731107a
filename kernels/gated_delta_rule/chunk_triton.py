"""Triton backend of the varlen chunked gated delta rule: staged forward and backward kernels.

    o, states = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, ..., backend="triton")

Same contract and math as `chunk_ref`, on the same `ChunkLayout`; the stages (`wy_triton`,
`state_triton`, `output_triton`, `l2norm_triton`) and their precision: docs/design/execution.md
("The gated delta rule"). On CPU set `TRITON_INTERPRET=1` before triton is imported (fp32 only).
Legend: T packed rows, N sequences, M chunk slots, E exported states, U distinct exported states,
H heads, K key dim, V value dim, NK key blocks; tiles: BT = C, BK/BV per-chunk key/value columns,
BKS >= K the recurrence's key rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels import triton_640
from kernels.gated_delta_rule.chunk_ref import resolve_layout
from kernels.gated_delta_rule.l2norm_triton import l2norm_bwd, l2norm_fwd
from kernels.gated_delta_rule.layout import ChunkLayout
from kernels.gated_delta_rule.output_triton import _dqkwg_kernel, _dv_local_kernel, _out_fwd_kernel
from kernels.gated_delta_rule.state_triton import _state_bwd_kernel, _state_fwd_kernel
from kernels.gated_delta_rule.wy_triton import _kkt_fwd_kernel, _solve_kernel, _wu_fwd_kernel, _wy_bwd_kernel

CHUNK_SIZES = (16, 32, 64)
MAX_K = 256


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the kernels write; tests replace it with NaN-filled buffers to prove each read
    element was written."""
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(slots=True, frozen=True, kw_only=True)
class _Tiles:
    """Tile sizes and dot precision of one call."""

    H: int
    K: int
    V: int
    BT: int
    BK: int
    BV: int
    BKS: int
    NK: int
    PREC: str
    gate_dtype: torch.dtype
    """dtype of G: float64 for fp32 inputs (the reference's gate precision), fp32 otherwise (fla's)."""
    trans_free: bool
    """The backward's transpose-free forms (fla #640 on Hopper; `kernels.triton_640.check`)."""

    def dims(self) -> dict:
        return dict(H=self.H, K=self.K, V=self.V, BT=self.BT)


def _tiles(H: int, K: int, V: int, C: int, dtype: torch.dtype, trans_free: bool) -> _Tiles:
    BK = min(64, max(16, triton.next_power_of_2(K)))
    return _Tiles(
        H=H, K=K, V=V, BT=C, BK=BK, BV=min(64, max(16, triton.next_power_of_2(V))),
        BKS=max(16, triton.next_power_of_2(K)), NK=triton.cdiv(K, BK),
        # fp32: exact fp32 products (tf32 would miss the reference by ~1e-3).
        PREC="ieee" if dtype == torch.float32 else "tf32",
        gate_dtype=torch.float64 if dtype == torch.float32 else torch.float32, trans_free=trans_free,
    )


def _chunks(layout: ChunkLayout) -> dict:
    return dict(chunk_row=layout.chunk_row_M, chunk_end=layout.chunk_end_M)


def _walk(layout: ChunkLayout) -> dict:
    return dict(
        chunk_off=layout.chunk_off_t_J, rank_chunks=layout.rank_chunks_N, rank_seq=layout.rank_to_seq_N,
        export_row=layout.export_row_M, **_chunks(layout),
    )


def _wy_forward(kn, g, beta, layout: ChunkLayout, t: _Tiles):
    """G [T, H] (`t.gate_dtype`) and Ai = (I + A)^-1 [T, H, BT] (k's dtype) of every chunk."""
    T, dev = kn.shape[0], kn.device
    G = _empty((T, t.H), t.gate_dtype, dev)
    A = _empty((T, t.H, t.BT), torch.float32, dev)
    Ai = _empty((T, t.H, t.BT), kn.dtype, dev)
    grid = (layout.num_chunks, t.H)
    _kkt_fwd_kernel[grid](k=kn, g=g, beta=beta, G=G, A=A, **_chunks(layout), H=t.H, K=t.K, BT=t.BT, BK=t.BK, PREC=t.PREC)
    _solve_kernel[grid](A=A, Ai=Ai, **_chunks(layout), H=t.H, BT=t.BT)
    return G, Ai


def _wu(kn, v, beta, G, Ai, layout: ChunkLayout, t: _Tiles):
    """w = Ai (beta k exp(G)) [T, H, K], u = Ai (beta v) [T, H, V], in k's / v's dtype."""
    w = _empty(tuple(kn.shape), kn.dtype, kn.device)
    u = _empty(tuple(v.shape), v.dtype, v.device)
    _wu_fwd_kernel[(layout.num_chunks, t.H)](
        k=kn, v=v, beta=beta, G=G, Ai=Ai, w=w, u=u, **_chunks(layout), **t.dims(), BK=t.BK, BV=t.BV, PREC=t.PREC,
    )
    return w, u


def _recurrence(kn, w, u, G, h0, layout: ChunkLayout, t: _Tiles, *, export: bool):
    """h [M, H, K, V] (k's dtype; the state entering each chunk), vnew [T, H, V] (v's dtype) and,
    with `export`, the distinct exported states [U, H, K, V] fp32 (else None)."""
    dev = kn.device
    h = _empty((layout.num_chunks, t.H, t.K, t.V), kn.dtype, dev)
    vnew = _empty(tuple(u.shape), u.dtype, dev)
    states = _empty((layout.num_export_rows, t.H, t.K, t.V), torch.float32, dev) if export and layout.num_export_rows else None
    _state_fwd_kernel[lambda meta: (layout.num_seqs, t.H, triton.cdiv(t.V, meta["BV"]))](
        k=kn, w=w, u=u, G=G, h0=h0, h=h, vnew=vnew, states=states, **_walk(layout), **t.dims(), BK=t.BKS, PREC=t.PREC,
    )
    return h, vnew, states


def _forward(qn, kn, v, g, beta, h0, layout: ChunkLayout, t: _Tiles, scale: float):
    """o [T, H, V] (v's dtype), the distinct exported states [U, H, K, V] fp32 (None when U = 0),
    and G, Ai for the backward; qn, kn are the (normalised) q, k."""
    G, Ai = _wy_forward(kn, g, beta, layout, t)
    w, u = _wu(kn, v, beta, G, Ai, layout, t)
    h, vnew, states = _recurrence(kn, w, u, G, h0, layout, t, export=True)
    o = _empty(tuple(v.shape), v.dtype, v.device)
    _out_fwd_kernel[(layout.num_chunks, triton.cdiv(t.V, t.BV), t.H)](
        q=qn, k=kn, vnew=vnew, h=h, G=G, o=o, **_chunks(layout), scale=scale, **t.dims(), BK=t.BK, BV=t.BV, PREC=t.PREC,
    )
    return o, states, G, Ai


def _backward(qn, kn, v, g_dtype, beta, G, Ai, h0, do, dstates, layout: ChunkLayout, t: _Tiles, scale: float):
    """dq, dk fp32 w.r.t. the normalised q, k; dv, dbeta, dg in v's, beta's and `g_dtype`; dh0 fp32
    (None without an initial state). dstates [U, H, K, V] fp32 or None: gradients on the exports."""
    T, dev = kn.shape[0], kn.device
    M = layout.num_chunks
    w, u = _wu(kn, v, beta, G, Ai, layout, t)
    h, vnew, _ = _recurrence(kn, w, u, G, h0, layout, t, export=False)
    dv_local = _empty(tuple(v.shape), torch.float32, dev)
    _dv_local_kernel[(M, t.H)](
        q=qn, k=kn, G=G, do=do, dv=dv_local, **_chunks(layout), scale=scale, **t.dims(), BK=t.BK, BV=t.BV, PREC=t.PREC,
    )
    dh = _empty((M, t.H, t.K, t.V), kn.dtype, dev)
    dv2 = _empty(tuple(v.shape), v.dtype, dev)
    dh0 = None if h0 is None else _empty(tuple(h0.shape), torch.float32, dev)
    _state_bwd_kernel[lambda meta: (layout.num_seqs, t.H, triton.cdiv(t.V, meta["BV"]))](
        q=qn, k=kn, w=w, G=G, do=do, dv_local=dv_local, dstates=dstates, dh=dh, dv2=dv2, dh0=dh0,
        **_walk(layout), scale=scale, **t.dims(), BK=t.BKS, PREC=t.PREC,
    )
    dq = _empty(tuple(qn.shape), torch.float32, dev)
    dk_part = _empty(tuple(kn.shape), torch.float32, dev)
    dw = _empty(tuple(kn.shape), kn.dtype, dev)
    dg_part = _empty((t.NK, T, t.H), t.gate_dtype, dev)
    # One [BT, BT] tile per program of the transposing kernels (fla #640); _wy_bwd reuses it.
    scratch = _empty((M * t.NK * t.H * t.BT * t.BT,), kn.dtype, dev) if t.trans_free else None
    _dqkwg_kernel[(M, t.NK, t.H)](
        q=qn, k=kn, vnew=vnew, h=h, do=do, dh=dh, dv2=dv2, G=G, dq=dq, dk=dk_part, dw=dw, dg=dg_part,
        scratch=scratch, **_chunks(layout), scale=scale, T=T, **t.dims(), BK=t.BK, BV=t.BV, PREC=t.PREC,
        TRANS_FREE=t.trans_free,
    )
    dk = _empty(tuple(kn.shape), torch.float32, dev)
    dv = _empty(tuple(v.shape), v.dtype, dev)
    dbeta = _empty(tuple(beta.shape), beta.dtype, dev)
    dg = _empty(tuple(G.shape), g_dtype, dev)
    _wy_bwd_kernel[(M, t.H)](
        k=kn, v=v, beta=beta, G=G, Ai=Ai, dw=dw, du=dv2, dk_in=dk_part, dg_in=dg_part,
        dk=dk, dv=dv, dbeta=dbeta, dg=dg, scratch=scratch, **_chunks(layout), T=T,
        **t.dims(), NK=t.NK, BK=t.BK, BV=t.BV, PREC=t.PREC, TRANS_FREE=t.trans_free,
    )
    return dq, dk, dv, dbeta, dg, dh0


class _ChunkGatedDeltaRuleTriton(torch.autograd.Function):
    """Staged Triton forward and backward; saves normalised q, k, v, beta, G, Ai and the initial state."""

    @staticmethod
    def forward(ctx, q_THK, k_THK, v_THV, g_TH, beta_TH, h0_NHKV, layout, scale, use_qk_l2norm):
        T, H, K = q_THK.shape
        V = v_THV.shape[-1]
        t = _tiles(H, K, V, layout.chunk_size, q_THK.dtype, triton_640.check(q_THK.device))
        if use_qk_l2norm:
            qn, q_rstd = l2norm_fwd(q_THK, _empty)
            kn, k_rstd = l2norm_fwd(k_THK, _empty)
        else:
            qn, kn, q_rstd, k_rstd = q_THK.contiguous(), k_THK.contiguous(), None, None
        v_THV, g_TH, beta_TH = v_THV.contiguous(), g_TH.contiguous(), beta_TH.contiguous()
        h0 = None if h0_NHKV is None else h0_NHKV.detach().to(torch.float32).contiguous()
        o_THV, states_UHKV, G, Ai = _forward(qn, kn, v_THV, g_TH, beta_TH, h0, layout, t, scale)
        ctx.save_for_backward(qn, kn, q_rstd, k_rstd, v_THV, beta_TH, G, Ai, h0)
        ctx.meta = (layout, t, scale, use_qk_l2norm, q_THK.dtype, k_THK.dtype, g_TH.dtype,
                    None if h0_NHKV is None else h0_NHKV.dtype)
        if states_UHKV is None:
            states_EHKV = o_THV.new_zeros((0, H, K, V), dtype=torch.float32)
        else:
            states_EHKV = states_UHKV.index_select(0, layout.export_unique_E)
        return o_THV, states_EHKV

    @staticmethod
    def backward(ctx, do_THV, dstates_EHKV):
        qn, kn, q_rstd, k_rstd, v_THV, beta_TH, G, Ai, h0 = ctx.saved_tensors
        layout, t, scale, use_qk_l2norm, q_dtype, k_dtype, g_dtype, h0_dtype = ctx.meta
        dstates_UHKV = None
        if layout.num_export_rows and dstates_EHKV is not None:
            # Requests for one state share its row: their gradients add up there, in request order.
            dstates_UHKV = dstates_EHKV.new_zeros((layout.num_export_rows, t.H, t.K, t.V), dtype=torch.float32)
            layout.export_adds_U.apply_(dstates_UHKV, dstates_EHKV.float())
        dq, dk, dv, dbeta, dg, dh0 = _backward(
            qn, kn, v_THV, g_dtype, beta_TH, G, Ai, h0, do_THV.contiguous(), dstates_UHKV, layout, t, scale,
        )
        if use_qk_l2norm:
            dq = l2norm_bwd(qn, q_rstd, dq, q_dtype, _empty)
            dk = l2norm_bwd(kn, k_rstd, dk, k_dtype, _empty)
        else:
            dq, dk = dq.to(q_dtype), dk.to(k_dtype)
        if dh0 is not None:
            dh0 = dh0.to(h0_dtype)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None


def chunk_gated_delta_rule_triton(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    *,
    cu_seqlens=None,
    initial_state: torch.Tensor | None = None,
    export_seq=None,
    export_pos=None,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    layout: ChunkLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton chunked gated delta rule; same arguments and results as `chunk_gated_delta_rule_ref`.

    Differentiable w.r.t. q, k, v, g, beta and initial_state, with gradients on the exported
    states flowing back into the call (injected at their chunk) and out through initial_state.
    Additional requirements: chunk_size 16, 32 or 64; K <= 256; q, k, v of one dtype among
    fp32/bf16/fp16 (not float64) on one device (CUDA, or CPU under TRITON_INTERPRET=1).
    """
    layout = resolve_layout(
        q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens=cu_seqlens, initial_state=initial_state,
        export_seq=export_seq, export_pos=export_pos, chunk_size=chunk_size, layout=layout,
    )
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: expected one of {CHUNK_SIZES} for backend='triton', got {chunk_size}")
    K = q_THK.shape[-1]
    if K > MAX_K:
        raise ValueError(f"q: expected K <= {MAX_K} for backend='triton', got K={K}; use backend='ref'")
    if not (q_THK.dtype == k_THK.dtype == v_THV.dtype) or q_THK.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"q, k, v: expected one dtype among fp32/bf16/fp16 for backend='triton', got {q_THK.dtype}, "
            f"{k_THK.dtype}, {v_THV.dtype}; use backend='ref' for float64"
        )
    if scale is None:
        scale = K**-0.5
    return _ChunkGatedDeltaRuleTriton.apply(
        q_THK, k_THK, v_THV, g_TH, beta_TH, initial_state, layout, float(scale), bool(use_qk_l2norm)
    )
