"""PyTorch reference of tree attention: per segment, gather its visible k/v rows, masked softmax.

Simple and obviously right rather than fast: one Python iteration per segment. Each segment's
queries see the rows of its ancestor ranges (all of them) followed by its own rows (causally);
scores and softmax in fp32 (float64 inputs stay float64); the output in q's dtype. Plain torch
ops throughout, so autograd gives dq, dk, dv; an ancestor row gathered by several segments
receives the sum of their gradients.

Legend: R query rows, Rk k/v rows, S segments, L rows of one segment, A ancestor rows of one
segment, N = A + L visible rows, H query heads, Hkv kv heads, G = H / Hkv, D head dim.
"""
from __future__ import annotations

import torch

from kernels.tree_attention.layout import TreeLayout


def tree_attention_ref(
    q_RHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, layout: TreeLayout, scale: float
) -> torch.Tensor:
    """Tree attention over a prepared layout; see `kernels.tree_attention.tree_attention`.

    Args:
        q_RHD: [R, H, D]. k_KHD, v_KHD: [Rk, Hkv, D] (local then imported rows).
        layout: from `prepare_tree_layout` (its host index; any device).
        scale: the score factor.

    Returns:
        o [R, H, D] in q's dtype.
    """
    R, H, D = q_RHD.shape
    G = H // k_KHD.shape[1]
    acc_dtype = torch.float64 if q_RHD.dtype == torch.float64 else torch.float32
    dev = q_RHD.device
    index = layout.index
    starts = index.seg_start_S.tolist()
    lens = index.seg_len_S.tolist()
    offsets = index.attn_offsets_S1.tolist()
    ranges = index.attn_ranges_n2.tolist()
    outs = []
    # Segments tile the rows: in start order their outputs concatenate to rows 0..R-1.
    for s in sorted(range(len(starts)), key=starts.__getitem__):
        a0, L = starts[s], lens[s]
        parts = [torch.arange(a, b, dtype=torch.long) for a, b in ranges[offsets[s] : offsets[s + 1]]]
        idx_N = torch.cat([*parts, torch.arange(a0, a0 + L, dtype=torch.long)]).to(dev)
        A = idx_N.numel() - L
        q_LHD = q_RHD[a0 : a0 + L].to(acc_dtype)
        k_NHD = k_KHD.index_select(0, idx_N).to(acc_dtype).repeat_interleave(G, dim=1)
        v_NHD = v_KHD.index_select(0, idx_N).to(acc_dtype).repeat_interleave(G, dim=1)
        s_HLN = torch.einsum("lhd,nhd->hln", q_LHD, k_NHD) * scale
        visible_LN = torch.cat(
            [torch.ones(L, A, dtype=torch.bool, device=dev), torch.ones(L, L, dtype=torch.bool, device=dev).tril()], 1
        )
        p_HLN = torch.softmax(s_HLN.masked_fill(~visible_LN, float("-inf")), dim=-1)
        outs.append(torch.einsum("hln,nhd->lhd", p_HLN, v_NHD).to(q_RHD.dtype))
    if not outs:
        return q_RHD.new_zeros(0, H, D)
    return torch.cat(outs, 0)
