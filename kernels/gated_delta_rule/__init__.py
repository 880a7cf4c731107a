"""Chunked gated delta rule (Gated DeltaNet), varlen, with fp32 boundary-state exports.

    layout = prepare_layout(cu_seqlens, export_seq, export_pos, chunk_size, device=...)   # once per call's indices
    o_THV, states_EHKV = chunk_gated_delta_rule(
        q_THK, k_THK, v_THV, g_TH, beta_TH, *, cu_seqlens, initial_state=None,
        export_seq, export_pos, chunk_size=64, scale=None, use_qk_l2norm=False, backend="ref",
        layout=layout)                              # with layout=, the indices may be omitted

Modules: `recurrent_ref` (oracle), `chunk_ref` (reference, the CPU path), `chunk_triton` (staged
Triton over `wy_triton`, `state_triton`, `output_triton`, `l2norm_triton`), `layout`. The math and
its design: docs/design/execution.md ("The gated delta rule").
Legend: T packed rows, N sequences, E exported states, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import torch

from kernels.gated_delta_rule.chunk_ref import chunk_gated_delta_rule_ref
from kernels.gated_delta_rule.layout import ChunkLayout, prepare_layout
from kernels.gated_delta_rule.recurrent_ref import recurrent_gated_delta_rule_ref

BACKENDS = ("ref", "triton")


def chunk_gated_delta_rule(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    export_seq: torch.Tensor | None = None,
    export_pos: torch.Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    backend: str | None = None,
    layout: ChunkLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen chunked gated delta rule (the math: docs/design/execution.md, "The gated delta rule").

    Args:
        q_THK, k_THK: [T, H, K]; v_THV: [T, H, V]; g_TH: [T, H] log decay (<= 0); beta_TH: [T, H].
        cu_seqlens: [N+1] packed sequence offsets (0 .. T); host data (CPU tensor or numpy array).
        initial_state: [N, H, K, V] fp32, or None for zeros.
        export_seq, export_pos: [E] (sequence, rows done) of each state to return; export_pos is a
            multiple of chunk_size or the sequence length.
        chunk_size: C. scale: q factor (default K ** -0.5). use_qk_l2norm: L2-normalise q, k.
        backend: "ref" (PyTorch, differentiable, bitwise batch-invariant on CPU; the default, None,
            on every device) or "triton" (staged Triton forward and backward, fla's chunked
            algorithm; CUDA, or CPU under TRITON_INTERPRET=1 in fp32; C in 16/32/64, K <= 256).
            GPU timings: `benchmarks/bench_kernels.py --gpu` (not measured in this repository yet).
        layout: `prepare_layout(cu_seqlens, export_seq, export_pos, chunk_size)`, shared by the
            calls (layers) with those indices; cu_seqlens, export_seq, export_pos may then be None.

    Returns:
        o [T, H, V] in v's dtype, states [E, H, K, V] fp32 (float64 for float64 inputs).
    """
    if backend is None:
        backend = "ref"
    kwargs = dict(
        cu_seqlens=cu_seqlens,
        initial_state=initial_state,
        export_seq=export_seq,
        export_pos=export_pos,
        chunk_size=chunk_size,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        layout=layout,
    )
    if backend == "ref":
        return chunk_gated_delta_rule_ref(q_THK, k_THK, v_THV, g_TH, beta_TH, **kwargs)
    if backend == "triton":
        from kernels.gated_delta_rule.chunk_triton import chunk_gated_delta_rule_triton

        return chunk_gated_delta_rule_triton(q_THK, k_THK, v_THV, g_TH, beta_TH, **kwargs)
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


__all__ = [
    "BACKENDS",
    "ChunkLayout",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "recurrent_gated_delta_rule_ref",
    "prepare_layout",
]
