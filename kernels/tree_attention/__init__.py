"""Tree attention: each segment's queries attend to its compact ancestor ranges plus causally to its
own rows (DESIGN §6), the softmax-attention layer of a prefix-shared tree microbatch.

Contract (the plan's layout, proto/harts/v1/plan.proto Microbatch segments + attn_offsets/attn_ranges):

    o_RHD = tree_attention(q_RHD, k_KHD, v_KHD, *, seg_start, seg_len, attn_offsets, attn_ranges,
                           scale, backend="ref")

Segments `seg_start[s] : seg_start[s] + seg_len[s]` tile the R query rows (consecutive depths). Row r
of segment s sees every k/v row in `attn_ranges[attn_offsets[s] : attn_offsets[s+1]]` (half-open,
its ancestors; rows >= R are imported rows, so Rk >= R) and rows seg_start[s] .. r of its own
segment. Ancestor ranges are disjoint and outside the segment's own rows. GQA: query head h uses
kv head h // (H / Hkv). Softmax in fp32 (float64 inputs stay float64), output in q's dtype,
differentiable w.r.t. q, k, v.

Modules: `ref` (per-segment PyTorch reference, the default), `triton_kernel` (flash-attention-2 style
Triton forward and backward), `layout` (validation and the block maps the kernels walk).

Legend: R query rows, Rk k/v rows, S segments, n ancestor ranges, H query heads, Hkv kv heads, D head dim.
"""
from __future__ import annotations

import torch

from kernels.tree_attention.layout import validate_inputs
from kernels.tree_attention.ref import tree_attention_ref

BACKENDS = ("ref", "triton")


def tree_attention(
    q_RHD: torch.Tensor,
    k_KHD: torch.Tensor,
    v_KHD: torch.Tensor,
    *,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    attn_offsets: torch.Tensor,
    attn_ranges: torch.Tensor,
    scale: float,
    backend: str = "ref",
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Tree attention; see the module docstring for the contract.

    Args:
        q_RHD: [R, H, D]. k_KHD, v_KHD: [Rk, Hkv, D], Rk >= R (rows >= R imported).
        seg_start, seg_len: [S] int32/int64, segments tiling rows 0..R-1.
        attn_offsets: [S+1] int32/int64. attn_ranges: [n, 2] half-open k/v row ranges.
        scale: score factor (usually D ** -0.5).
        backend: "ref" (PyTorch, any device and dtype) or "triton" (fused kernels; CUDA, or CPU
            under TRITON_INTERPRET=1 in fp32; not float64). Measured on an H200 (bf16, one 2048-row
            prompt + 8 x 1024-row branches, H=16, Hkv=2, D=128; benchmarks/bench_tree_attention.py):
            forward ref 13.9 ms, triton 1.67 ms; forward+backward ref 34.6 ms, triton 9.5 ms;
            flash SDPA on the 8 expanded sequences (1.64x the visible pairs) 0.87 / 2.98 ms.
        block_m, block_n: Triton query/kv tile rows (powers of two >= 16); ignored by "ref".

    Returns:
        o [R, H, D] in q's dtype.
    """
    index = validate_inputs(q_RHD, k_KHD, v_KHD, seg_start, seg_len, attn_offsets, attn_ranges)
    if backend == "ref":
        return tree_attention_ref(q_RHD, k_KHD, v_KHD, index, scale)
    if backend == "triton":
        from kernels.tree_attention.triton_kernel import tree_attention_triton

        return tree_attention_triton(q_RHD, k_KHD, v_KHD, index, scale, block_m=block_m, block_n=block_n)
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


__all__ = ["BACKENDS", "tree_attention", "tree_attention_ref"]
