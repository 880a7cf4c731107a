"""Tree attention: each segment's queries attend to its compact ancestor ranges plus causally to its
own rows, the softmax-attention layer of a prefix-shared tree microbatch.

    layout = prepare_tree_layout(seg_start, seg_len, attn_offsets, attn_ranges, num_rows=R,
                                 num_kv_rows=R + I, device=q.device)      # once per microbatch
    o_RHd = tree_attention(q_RHd, k_NHd, v_NHd, layout, scale=hd ** -0.5, backend="ref")

Backends (`BACKENDS`, `attention_backend(name)`): "ref" (`segment_ref`), "blocked" (exact, bitwise
batch-invariant on the CPU) and "triton"; the contract and each backend's design:
docs/design/execution.md ("Tree attention"). Legend: R query rows, I imported rows, N = R + I k/v
rows, S segments, n ancestor ranges, H query heads, Hkv kv heads, d/hd head dim.
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
    """Tree attention (the contract: docs/design/execution.md, "Tree attention").

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
