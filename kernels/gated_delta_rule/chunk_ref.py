"""Chunkwise gated delta rule in PyTorch: the reference of the Triton kernel, and the CPU path.

    o, states = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, ..., backend="ref")

Per chunk the WY form of transformers' `torch_chunk_gated_delta_rule`, with float64 gates, fixed
per-chunk shapes (bitwise batch-invariant on the CPU) and the state loop as one autograd Function
with a written-out backward (`_StateRecurrence`): docs/design/execution.md ("The gated delta rule").
Legend: T packed rows, N sequences, M chunks, C chunk size, E exported states, H heads, K key dim,
V value dim, a sequences active at a step, B = a * H rows of a step.
"""
from __future__ import annotations

import torch

from kernels.dtypes import compute_dtype
from kernels.gated_delta_rule.layout import (
    ChunkLayout,
    build_chunk_layout,
    validate_indices,
    validate_tensors,
)
from kernels.gated_delta_rule.recurrent_ref import prepare_qk


def _to_chunks(x_TX: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, H, *] -> [M, H, C, *], zero rows where a chunk runs past its sequence."""
    pad_TX = torch.cat([x_TX, x_TX.new_zeros((1, *x_TX.shape[1:]))])
    x_MCX = pad_TX.index_select(0, layout.gather_MC.reshape(-1))
    x_MCX = x_MCX.reshape(layout.num_chunks, layout.chunk_size, *x_TX.shape[1:])
    return x_MCX.movedim(1, 2).contiguous()


class _StateRecurrence(torch.autograd.Function):
    """The sequential part of a call, with its backward written out.

    Rows ("B" = (rank, head) pairs) follow the layout's slot order: step j owns rows
    [chunk_off[j] * H, (chunk_off[j] + active[j]) * H) of every [M * H, ...] input, and its active
    ranks are a prefix of the state's rows. Per step j, on those rows:

        Sin_j   = S                                    the state entering chunk j (an output)
        vnew_j  = u_j - w_j S                          (an output)
        S      <- decay_j S + kdecT_j vnew_j           exported rows after step j (an output)

    Backward, j from last to first, with G = dL/dS after step j (export cotangents added in):

        dvnew_j = dvnew_j(out) + kdecT_j^T G           G <- decay_j G - w_j^T dvnew_j + dSin_j(out)

    and the per-chunk parameter gradients in one batch afterwards (dw = -dvnew Sin^T,
    dkdecT = G_after vnew^T, ddecay = sum(G_after * Sin)). Two `bmm` and three elementwise ops per
    step each way, no autograd node per op: the loop is where tree plans (more, shorter calls)
    pay per-step overhead. Its forward runs the ops of the straightforward loop; gradients agree
    with autograd through that loop to rounding (float64: to 1e-12).
    """

    @staticmethod
    def forward(ctx, u_BCV, w_BCK, kdecT_BKC, decay_B11, S0_BKV, rows_J, export_ranks_J, export_adds_J, H):
        Sin_BKV = u_BCV.new_empty((u_BCV.shape[0], *S0_BKV.shape[1:]))
        vnew_BCV = torch.empty_like(u_BCV)
        # Per-step views, split once (a slice per tensor and step costs more than the step's math).
        steps = zip(*(x.split(rows_J) for x in (u_BCV, w_BCK, kdecT_BKC, decay_B11, Sin_BKV, vnew_BCV)))
        exported = []
        S_BKV = S0_BKV
        for j, (B, (u, w, kdecT, decay, Sin, vnew)) in enumerate(zip(rows_J, steps)):
            S_BKV = S_BKV[:B]
            Sin.copy_(S_BKV)
            torch.sub(u, torch.bmm(w, S_BKV), out=vnew)
            S_BKV = S_BKV * decay + torch.bmm(kdecT, vnew)
            ranks = export_ranks_J.get(j)
            if ranks is not None:
                exported.append(S_BKV.view(B // H, H, *S_BKV.shape[1:]).index_select(0, ranks))
        exported_XHKV = torch.cat(exported) if exported else S0_BKV.new_zeros(0, H, *S0_BKV.shape[1:])
        ctx.save_for_backward(w_BCK, kdecT_BKC, decay_B11, Sin_BKV, vnew_BCV)
        ctx.plan = (rows_J, export_ranks_J, export_adds_J, H, S0_BKV.shape[0])
        return Sin_BKV, vnew_BCV, exported_XHKV

    @staticmethod
    def backward(ctx, dSin_BKV, dvnew_out_BCV, dexported_XHKV):
        w_BCK, kdecT_BKC, decay_B11, Sin_BKV, vnew_BCV = ctx.saved_tensors
        rows_J, export_ranks_J, export_adds_J, H, N_H = ctx.plan
        # Export cotangents per step (the forward concatenated them step by step).
        dexp_J, x0 = {}, 0
        for j in sorted(export_ranks_J):
            n = export_ranks_J[j].shape[0]
            dexp_J[j] = dexported_XHKV[x0 : x0 + n]
            x0 += n
        dvnew_BCV = torch.empty_like(vnew_BCV)
        Gafter_BKV = torch.empty_like(Sin_BKV)
        # Rows of ranks whose sequence has no chunk after step j are zero until their last step.
        G_BKV = Sin_BKV.new_zeros(N_H, *Sin_BKV.shape[1:])
        # bmm on transposed views rather than baddbmm: CPU baddbmm with a transposed operand loops
        # over the batch.
        steps = list(zip(*(x.split(rows_J) for x in (
            kdecT_BKC.transpose(1, 2), w_BCK.transpose(1, 2), decay_B11, dSin_BKV, dvnew_out_BCV, dvnew_BCV, Gafter_BKV))))
        for j in reversed(range(len(rows_J))):
            B = rows_J[j]
            kdec_BCK, wT_BKC, decay, dSin, dvnew_out, dvnew, Gafter = steps[j]
            G = G_BKV[:B]
            if j in dexp_J:
                export_adds_J[j].apply_(G.view(B // H, H, *G.shape[1:]), dexp_J[j])
            Gafter.copy_(G)
            torch.add(dvnew_out, torch.bmm(kdec_BCK, G), out=dvnew)
            G.mul_(decay).sub_(torch.bmm(wT_BKC, dvnew)).add_(dSin)
        dw_BCK = -torch.bmm(dvnew_BCV, Sin_BKV.transpose(1, 2))
        dkdecT_BKC = torch.bmm(Gafter_BKV, vnew_BCV.transpose(1, 2))
        ddecay_B11 = (Gafter_BKV * Sin_BKV).sum(dim=(1, 2), keepdim=True)
        return dvnew_BCV, dw_BCK, dkdecT_BKC, ddecay_B11, G_BKV, None, None, None, None


def resolve_layout(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    *,
    cu_seqlens,
    initial_state: torch.Tensor | None,
    export_seq,
    export_pos,
    chunk_size: int,
    layout: ChunkLayout | None,
) -> ChunkLayout:
    """Validate a call and return its layout on q's device: `layout` when given (built by
    `prepare_layout` from the same indices, which are then optional), else built here."""
    validate_tensors(q_THK, k_THK, v_THV, g_TH, beta_TH, None, None)
    T = q_THK.shape[0]
    if layout is None:
        if cu_seqlens is None or export_seq is None or export_pos is None:
            raise ValueError("cu_seqlens, export_seq, export_pos: expected tensors (or a prepared layout), got None")
        cu, seq, pos = validate_indices(cu_seqlens, export_seq, export_pos, chunk_size, T)
        layout = build_chunk_layout(cu, seq, pos, chunk_size)
    else:
        if not isinstance(layout, ChunkLayout):
            raise ValueError(f"layout: expected a ChunkLayout from prepare_layout, got {type(layout).__name__}")
        given = [x if x is not None else own for x, own in zip(
            (cu_seqlens, export_seq, export_pos), (layout.cu_seqlens, layout.export_seq_E, layout.export_pos_E)
        )]
        if not layout.matches(*given, chunk_size):
            raise ValueError(
                "layout: expected one prepared from this call's cu_seqlens, export_seq, export_pos and "
                f"chunk_size={chunk_size}, got one for other indices (chunk_size={layout.chunk_size})"
            )
        if layout.num_rows != T:
            raise ValueError(f"layout: expected one for T={T} packed rows, got one for {layout.num_rows}")
    validate_tensors(q_THK, k_THK, v_THV, g_TH, beta_TH, initial_state, layout.num_seqs)
    return layout.to(q_THK.device)


def chunk_gated_delta_rule_ref(
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
    """Varlen chunkwise gated delta rule, differentiable through autograd.

    Args:
        q_THK, k_THK: [T, H, K] queries and keys.
        v_THV: [T, H, V] values; the output takes their dtype.
        g_TH: [T, H] log decays (<= 0).
        beta_TH: [T, H] write strengths in (0, 1).
        cu_seqlens: [N+1] offsets of the N packed sequences (host data: a CPU tensor or numpy array).
        initial_state: [N, H, K, V] fp32 states before each sequence, or None for zeros.
        export_seq, export_pos: [E] return the state of sequence export_seq[e] after its first
            export_pos[e] rows (a multiple of chunk_size, or the sequence length).
        chunk_size: C; chunks are [jC, (j+1)C) from each sequence start.
        scale: factor on q (default K ** -0.5), applied after the optional L2 norm.
        use_qk_l2norm: L2-normalise q and k first.
        layout: `prepare_layout(cu_seqlens, export_seq, export_pos, chunk_size)`, reused across
            calls with the same indices (layers); cu_seqlens and the exports may then be omitted.

    Returns:
        o [T, H, V] in v's dtype; states [E, H, K, V] in the compute dtype (fp32, or float64 when
        the inputs are float64).
    """
    layout = resolve_layout(
        q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens=cu_seqlens, initial_state=initial_state,
        export_seq=export_seq, export_pos=export_pos, chunk_size=chunk_size, layout=layout,
    )
    dt = compute_dtype(q_THK, k_THK, v_THV)
    T, H, K = q_THK.shape
    V = v_THV.shape[-1]
    C = chunk_size
    M = layout.num_chunks
    N = layout.num_seqs
    out_dtype = v_THV.dtype

    q_THK, k_THK = prepare_qk(q_THK, k_THK, scale, use_qk_l2norm, dt)
    q_MHCK = _to_chunks(q_THK, layout)
    k_MHCK = _to_chunks(k_THK, layout)
    v_MHCV = _to_chunks(v_THV.to(dt), layout)
    g_MHC = _to_chunks(g_TH.to(dt), layout)
    beta_MHC = _to_chunks(beta_TH.to(dt), layout)

    G64_MHC = g_MHC.double().cumsum(dim=-1)
    decay_MHCC = (G64_MHC[..., :, None] - G64_MHC[..., None, :]).masked_fill(layout.above_diag_CC, float("-inf")).exp().to(dt)
    Gexp_MHC = G64_MHC.exp().to(dt)
    Glast_MH1 = G64_MHC[..., -1:]
    kdec_MHC = (Glast_MH1 - G64_MHC).exp().to(dt)
    chunk_decay_MH11 = Glast_MH1.exp().to(dt)[..., None]
    kbeta_MHCK = k_MHCK * beta_MHC[..., None]
    kt_MHKC = k_MHCK.transpose(-1, -2)
    # solve_triangular(unitriangular=True) never reads the diagonal or above: A needs no masking.
    A_MHCC = (kbeta_MHCK @ kt_MHKC) * decay_MHCC
    u_MHCV = torch.linalg.solve_triangular(A_MHCC, v_MHCV * beta_MHC[..., None], upper=False, unitriangular=True)
    w_MHCK = torch.linalg.solve_triangular(
        A_MHCC, kbeta_MHCK * Gexp_MHC[..., None], upper=False, unitriangular=True
    )
    attn_MHCC = (q_MHCK @ kt_MHKC) * decay_MHCC
    qdec_MHCK = q_MHCK * Gexp_MHC[..., None]
    kdecT_MHKC = (k_MHCK * kdec_MHC[..., None]).transpose(-1, -2)

    if initial_state is None:
        S0_BKV = q_THK.new_zeros(N * H, K, V)
    else:
        S0_BKV = initial_state.to(dt).index_select(0, layout.rank_to_seq_N).reshape(N * H, K, V)
    rows_J = [a * H for a in layout.active_J]
    Sin_BKV, vnew_BCV, exported_XHKV = _StateRecurrence.apply(
        u_MHCV.reshape(M * H, C, V), w_MHCK.reshape(M * H, C, K), kdecT_MHKC.reshape(M * H, K, C),
        chunk_decay_MH11.reshape(M * H, 1, 1), S0_BKV, rows_J, layout.export_ranks_J, layout.export_adds_J, H,
    )
    # The outputs need no recurrence: one batch over every chunk once the incoming states are known.
    o_BCV = torch.bmm(qdec_MHCK.reshape(M * H, C, K), Sin_BKV) + torch.bmm(attn_MHCC.reshape(M * H, C, C), vnew_BCV)
    o_MCHV = o_BCV.view(M, H, C, V).movedim(2, 1)
    o_THV = o_MCHV.reshape(M * C, H, V).index_select(0, layout.row_slot_T).to(out_dtype)
    return o_THV, exported_XHKV.index_select(0, layout.export_order_E)
