"""Tree attention: each segment's queries attend to its compact ancestor ranges plus causally to its
own rows (DESIGN §6), the softmax-attention layer of a prefix-shared tree microbatch.

Contract (the plan's layout, proto/harts/v1/plan.proto Microbatch segments + attn_offsets/attn_ranges):

    layout = prepare_tree_layout(seg_start, seg_len, attn_offsets, attn_ranges, num_rows=R,
                                 num_kv_rows=R + I, device=q.device)      # once per microbatch
    o_RHd = tree_attention(q_RHd, k_NHd, v_NHd, layout, scale=hd ** -0.5, backend="ref")

Queries are the R local rows; keys and values are the plan's extended rows [0, R + I): the local
rows, then the I imported rows (a sharing window's ancestor rows, appended after them). Segments
`seg_start[s] : seg_start[s] + seg_len[s]` tile the R query rows (consecutive depths). Row r of
segment s sees every k/v row in `attn_ranges[attn_offsets[s] : attn_offsets[s+1]]` (half-open, its
ancestors, local or imported) and rows seg_start[s] .. r of its own segment. Ancestor ranges are
disjoint and outside the segment's own rows. GQA: query head h uses kv head h // (H / Hkv). Softmax
in fp32 (float64 inputs stay float64), output in q's dtype, differentiable w.r.t. q, k, v (imported
rows' gradients come back in k, v rows R..R+I-1).

Backends (`BACKENDS`, each `fn(q, k, v, layout, scale)`; pick one with `attention_backend(name)`):
"ref" (per-segment PyTorch reference, any device and dtype), "blocked" (exact blocked flash-style
PyTorch: bounded memory, and bitwise batch-invariant on the CPU, so a tree row gets the bits of its
expanded trajectory; the trainer's CPU path) and "triton" (flash-attention-2 style forward and
backward; CUDA, or CPU under TRITON_INTERPRET=1 in fp32; on a layout prepared with
`batch_invariant=True` its forward and dq tile each query's keys at fixed depths of its key
sequence, gathered across its ranges, so a row's output and dq get the bits of the same row in its
path alone: the GPU's tree == expanded). A backend that needs its own
index structure builds it from the layout once, through `layout.plan(name, build)`.

Modules: `segment_ref`, `blocked`, `triton_kernel`, `layout` (validation, `prepare_tree_layout`, the block maps).

Legend: R query rows, I imported rows, N = R + I k/v rows, S segments, n ancestor ranges,
H query heads, Hkv kv heads, d/hd head dim.
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels.tree_attention.layout import TreeLayout, prepare_tree_layout, validate_tensors
from kernels.tree_attention.segment_ref import tree_attention_ref


def _triton(q_RHd, k_NHd, v_NHd, layout: TreeLayout, scale: float) -> torch.Tensor:
    from kernels.tree_attention.triton_kernel import tree_attention_triton

    return tree_attention_triton(q_RHd, k_NHd, v_NHd, layout, scale)


def _blocked(q_RHd, k_NHd, v_NHd, layout: TreeLayout, scale: float) -> torch.Tensor:
    from kernels.tree_attention.blocked import tree_attention_blocked

    return tree_attention_blocked(q_RHd, k_NHd, v_NHd, layout, scale)


BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"ref": tree_attention_ref, "blocked": _blocked, "triton": _triton}


def attention_backend(name: str) -> Callable[..., torch.Tensor]:
    """The backend `fn(q, k, v, layout, scale)` called `name` (raises ValueError for an unknown one)."""
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {tuple(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def tree_attention(
    q_RHd: torch.Tensor,
    k_NHd: torch.Tensor,
    v_NHd: torch.Tensor,
    layout: TreeLayout,
    *,
    scale: float,
    backend: str = "ref",
) -> torch.Tensor:
    """Tree attention; see the module docstring for the contract.

    Args:
        q_RHd: [R, H, hd] queries of the local rows.
        k_NHd, v_NHd: [R + I, Hkv, hd] keys and values: local rows, then imported rows.
        layout: `prepare_tree_layout(...)` of the microbatch (the Triton backend needs it on q's device).
        scale: score factor (usually hd ** -0.5).
        backend: "ref", "blocked" or "triton" (`BACKENDS`).

    Returns:
        o [R, H, hd] in q's dtype.
    """
    fn = attention_backend(backend)
    validate_tensors(q_RHd, k_NHd, v_NHd, layout)
    return fn(q_RHd, k_NHd, v_NHd, layout, float(scale))


__all__ = ["BACKENDS", "TreeLayout", "attention_backend", "prepare_tree_layout", "tree_attention", "tree_attention_ref"]
