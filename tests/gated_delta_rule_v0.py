"""Frozen copy of the chunked gated delta rule reference as of commit 8455dbc (before the per-step
overhead work): the oracle of `kernels.gated_delta_rule.chunk_ref`, differentiated by autograd.

Do not optimise this file. `tests/kernels/test_gated_delta_rule.py` checks that the live reference returns
the same outputs, states and gradients as this one up to rounding: the live one forms the gate
cumsums in float64 and writes the recurrence's backward out (in float64 both agree to 1e-12).
Inputs are assumed valid.

Legend: T packed rows, N sequences, M chunks, C chunk size, E exported states, J chunk steps,
H heads, K key dim, V value dim.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels.gated_delta_rule.recurrent_ref import compute_dtype, prepare_qk


def build_chunk_layout_v0(cu_seqlens, export_seq_E, export_pos_E, chunk_size):
    """The v0 chunk layout: sequences ranked by chunk count, j-th chunks contiguous."""
    C = chunk_size
    cu = cu_seqlens.cpu().long()
    T = int(cu[-1])
    seq_start_N = cu[:-1]
    seq_len_N = cu[1:] - cu[:-1]
    n_chunks_N = (seq_len_N + C - 1) // C
    rank_to_seq_N = torch.sort(n_chunks_N, descending=True, stable=True).indices
    n_chunks_R = n_chunks_N[rank_to_seq_N]
    J = int(n_chunks_R[0])
    active_J = [int((n_chunks_R > j).sum()) for j in range(J)]
    chunk_off_J = [0] * J
    for j in range(1, J):
        chunk_off_J[j] = chunk_off_J[j - 1] + active_J[j - 1]
    M = chunk_off_J[-1] + active_J[-1]
    chunk_j_M = torch.cat([torch.full((a,), j, dtype=torch.long) for j, a in enumerate(active_J)])
    chunk_rank_M = torch.cat([torch.arange(a) for a in active_J])
    chunk_seq_M = rank_to_seq_N[chunk_rank_M]
    row_MC = (seq_start_N[chunk_seq_M] + chunk_j_M * C)[:, None] + torch.arange(C)[None, :]
    valid_MC = row_MC < (seq_start_N + seq_len_N)[chunk_seq_M][:, None]
    gather_MC = torch.where(valid_MC, row_MC, torch.full_like(row_MC, T))
    row_slot_T = torch.empty(T, dtype=torch.long)
    row_slot_T[row_MC[valid_MC]] = torch.arange(M * C).reshape(M, C)[valid_MC]
    seq_to_rank_N = torch.empty_like(rank_to_seq_N)
    seq_to_rank_N[rank_to_seq_N] = torch.arange(rank_to_seq_N.numel())
    export_chunks_E = (export_pos_E.cpu().long() + C - 1) // C
    offs = torch.tensor(chunk_off_J + [M], dtype=torch.long)
    export_slot_E = offs[export_chunks_E - 1] + seq_to_rank_N[export_seq_E.cpu().long()]
    return SimpleNamespace(
        chunk_size=C, seq_len_N=seq_len_N, rank_to_seq_N=rank_to_seq_N, active_J=active_J,
        chunk_off_J=chunk_off_J, gather_MC=gather_MC, row_slot_T=row_slot_T,
        export_chunks_E=export_chunks_E, export_slot_E=export_slot_E, num_chunks=M,
    )


def _to_chunks_v0(x_TX, layout):
    pad_TX = torch.cat([x_TX, x_TX.new_zeros((1, *x_TX.shape[1:]))])
    gather = layout.gather_MC.to(x_TX.device).reshape(-1)
    x_MCX = pad_TX.index_select(0, gather).reshape(layout.num_chunks, layout.chunk_size, *x_TX.shape[1:])
    return x_MCX.movedim(1, 2).contiguous()


def chunk_gated_delta_rule_v0(
    q_THK, k_THK, v_THV, g_TH, beta_TH, *, cu_seqlens, initial_state=None, export_seq, export_pos,
    chunk_size=64, scale=None, use_qk_l2norm=False,
):
    """The v0 reference, op for op (same signature as `chunk_gated_delta_rule_ref`)."""
    layout = build_chunk_layout_v0(cu_seqlens, export_seq, export_pos, chunk_size)
    dt = compute_dtype(q_THK, k_THK, v_THV)
    dev = q_THK.device
    T, H, K = q_THK.shape
    V = v_THV.shape[-1]
    C = chunk_size
    M = layout.num_chunks
    N = layout.seq_len_N.numel()
    out_dtype = v_THV.dtype

    q_THK, k_THK = prepare_qk(q_THK, k_THK, scale, use_qk_l2norm, dt)
    q_MHCK = _to_chunks_v0(q_THK, layout)
    k_MHCK = _to_chunks_v0(k_THK, layout)
    v_MHCV = _to_chunks_v0(v_THV.to(dt), layout)
    g_MHC = _to_chunks_v0(g_TH.to(dt), layout)
    beta_MHC = _to_chunks_v0(beta_TH.to(dt), layout)

    G_MHC = g_MHC.cumsum(dim=-1)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    decay_MHCC = (G_MHC[..., :, None] - G_MHC[..., None, :]).masked_fill(~causal_CC, float("-inf")).exp()
    kbeta_MHCK = k_MHCK * beta_MHC[..., None]
    kt_MHKC = k_MHCK.transpose(-1, -2)
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
