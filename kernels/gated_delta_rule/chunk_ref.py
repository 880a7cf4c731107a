"""Chunkwise gated delta rule in PyTorch: the reference of the Triton kernel, and the CPU path.

Math per chunk (C rows; G = cumulative sum of g inside the chunk; decay D_ij = exp(G_i - G_j) for
i >= j, else 0), as in transformers' `torch_chunk_gated_delta_rule` and fla's WY representation:

    A   = strict_lower((beta k) k^T * D)                      intra-chunk delta-rule couplings
    U   = (I + A)^-1 (beta v)        W = (I + A)^-1 (beta k exp(G))
    V'  = U - W S                    the chunk's corrections given the incoming state S
    O   = (q exp(G)) S + ((q k^T) * D) V'
    S  <- exp(G_last) S + (k exp(G_last - G))^T V'

Batch invariance (DESIGN §2, §5.3: the tree run and the trajectory-expanded run must give bitwise
equal fp32 outputs on CPU). Each chunk is computed by the same op sequence on tensors of the same
per-chunk shape, whatever else is in the call: every sequence is padded to a multiple of C (pad rows
are zeros: g = 0 keeps the decay, beta = k = 0 adds nothing), all chunks are gathered into
[M, H, C, *] and the intra-chunk work is batched over them; the inter-chunk recurrence loops over the
chunk index j, batched over the sequences that have a j-th chunk. Measured on this CPU build
(torch 2.13, MKL): batched `matmul` and `linalg.solve_triangular` give each matrix of the batch the
same bits whatever the batch size and position; `exp`, `cumsum`, `rsqrt`, row sums and the basic
arithmetic are position independent. Not so for `sigmoid`, `softplus` and `silu` (their vectorised
body and scalar tail round differently), which is why none of them appear here.

Legend: T packed rows, N sequences, M chunks, C chunk size, E exported states, H heads, K key dim,
V value dim.
"""
from __future__ import annotations

import torch

from kernels.gated_delta_rule.layout import ChunkLayout, build_chunk_layout, validate_inputs
from kernels.gated_delta_rule.naive import compute_dtype, prepare_qk


def _to_chunks(x_TX: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """[T, H, *] -> [M, H, C, *], zero rows where a chunk runs past its sequence."""
    pad_TX = torch.cat([x_TX, x_TX.new_zeros((1, *x_TX.shape[1:]))])
    gather = layout.gather_MC.to(x_TX.device).reshape(-1)
    x_MCX = pad_TX.index_select(0, gather).reshape(layout.num_chunks, layout.chunk_size, *x_TX.shape[1:])
    return x_MCX.movedim(1, 2).contiguous()


def chunk_gated_delta_rule_ref(
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
    """Varlen chunkwise gated delta rule, differentiable through autograd.

    Args:
        q_THK, k_THK: [T, H, K] queries and keys.
        v_THV: [T, H, V] values; the output takes their dtype.
        g_TH: [T, H] log decays (<= 0).
        beta_TH: [T, H] write strengths in (0, 1).
        cu_seqlens: [N+1] offsets of the N packed sequences.
        initial_state: [N, H, K, V] fp32 states before each sequence, or None for zeros.
        export_seq, export_pos: [E] return the state of sequence export_seq[e] after its first
            export_pos[e] rows (a multiple of chunk_size, or the sequence length).
        chunk_size: C; chunks are [jC, (j+1)C) from each sequence start.
        scale: factor on q (default K ** -0.5), applied after the optional L2 norm.
        use_qk_l2norm: L2-normalise q and k first.

    Returns:
        o [T, H, V] in v's dtype; states [E, H, K, V] in the compute dtype (fp32, or float64 when
        the inputs are float64).
    """
    validate_inputs(
        q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state, export_seq, export_pos, chunk_size
    )
    layout = build_chunk_layout(cu_seqlens, export_seq, export_pos, chunk_size)
    dt = compute_dtype(q_THK, k_THK, v_THV)
    dev = q_THK.device
    T, H, K = q_THK.shape
    V = v_THV.shape[-1]
    C = chunk_size
    M = layout.num_chunks
    N = layout.seq_len_N.numel()
    out_dtype = v_THV.dtype

    q_THK, k_THK = prepare_qk(q_THK, k_THK, scale, use_qk_l2norm, dt)
    q_MHCK = _to_chunks(q_THK, layout)
    k_MHCK = _to_chunks(k_THK, layout)
    v_MHCV = _to_chunks(v_THV.to(dt), layout)
    g_MHC = _to_chunks(g_TH.to(dt), layout)
    beta_MHC = _to_chunks(beta_TH.to(dt), layout)

    G_MHC = g_MHC.cumsum(dim=-1)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    decay_MHCC = (G_MHC[..., :, None] - G_MHC[..., None, :]).masked_fill(~causal_CC, float("-inf")).exp()
    kbeta_MHCK = k_MHCK * beta_MHC[..., None]
    kt_MHKC = k_MHCK.transpose(-1, -2)
    # solve_triangular(unitriangular=True) never reads the diagonal or above: A needs no masking.
    A_MHCC = (kbeta_MHCK @ kt_MHKC) * decay_MHCC
    u_MHCV = torch.linalg.solve_triangular(A_MHCC, v_MHCV * beta_MHC[..., None], upper=False, unitriangular=True)
    w_MHCK = torch.linalg.solve_triangular(
        A_MHCC, kbeta_MHCK * G_MHC.exp()[..., None], upper=False, unitriangular=True
    )
    attn_MHCC = (q_MHCK @ kt_MHKC) * decay_MHCC
    qdec_MHCK = q_MHCK * G_MHC.exp()[..., None]
    Glast_MH1 = G_MHC[..., -1:]
    kdecT_MHKC = (k_MHCK * (Glast_MH1 - G_MHC).exp()[..., None]).transpose(-1, -2)
    chunk_decay_MH11 = Glast_MH1.exp()[..., None]

    rank_to_seq = layout.rank_to_seq_N.to(dev)
    if initial_state is None:
        S_NHKV = q_THK.new_zeros(N, H, K, V)
    else:
        S_NHKV = initial_state.to(dt).index_select(0, rank_to_seq)
    export_j_E = layout.export_chunks_E - 1
    o_parts, state_parts, state_ids = [], [], []
    for j, (a, off) in enumerate(zip(layout.active_J, layout.chunk_off_J)):
        S_NHKV = S_NHKV[:a]
        sl = slice(off, off + a)
        vnew_NHCV = u_MHCV[sl] - w_MHCK[sl] @ S_NHKV
        o_parts.append(qdec_MHCK[sl] @ S_NHKV + attn_MHCC[sl] @ vnew_NHCV)
        S_NHKV = S_NHKV * chunk_decay_MH11[sl] + kdecT_MHKC[sl] @ vnew_NHCV
        ids = (export_j_E == j).nonzero().flatten()
        if ids.numel():
            ranks = (layout.export_slot_E[ids] - off).to(dev)
            state_parts.append(S_NHKV.index_select(0, ranks))
            state_ids.append(ids)

    o_MCHV = torch.cat(o_parts).movedim(2, 1)
    o_THV = o_MCHV.reshape(M * C, H, V).index_select(0, layout.row_slot_T.to(dev)).to(out_dtype)
    if state_parts:
        order_E = torch.empty(export_seq.numel(), dtype=torch.long)
        order_E[torch.cat(state_ids)] = torch.arange(export_seq.numel())
        states_EHKV = torch.cat(state_parts).index_select(0, order_E.to(dev))
    else:
        states_EHKV = q_THK.new_zeros(0, H, K, V)
    return o_THV, states_EHKV
