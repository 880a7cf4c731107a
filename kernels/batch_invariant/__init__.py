"""Batch-invariant GPU kernels: a row's result does not depend on how many rows run with it.

Tree and expanded plans put the same token in batches of different sizes and at different
positions; a kernel whose reduction order changes with the batch (cuBLAS picking tiles and split-K
by M, a reduction picking its strategy by the tensor's shape) gives the token other bits in each
(Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025). These kernels fix every
reduction's order by the reduced length alone, so a row's bits are a function of the row and the
weights (GPU issue 32, item 4: tree == expanded bitwise in bf16):

    y = linear(x, weight)                       x @ weight.T           `matmul`
    y = mm_t(a, b, out_dtype=None)              a @ b.T, no autograd   `matmul`
    y = rms_norm(x, weight, eps=, zero_centered=)                      `rmsnorm`
    lse = logsumexp(x)          y = softmax(x, dtype=None)             `row_softmax`

Each is differentiable (backward kernels of the same kind; weight gradients are fixed-order sums
over the rows: deterministic, and by nature dependent on the rows present) and runs on CUDA, or on
the CPU under TRITON_INTERPRET=1 in fp32 (tests). PyTorch references of the same math and
roundings: `reference` (`linear_ref`, `rms_norm_ref`, `logsumexp_ref`, `softmax_ref`).

Costs: fixed tiles lose the per-shape tuning of cuBLAS; `benchmarks.bench_kernels --gpu` measures
the matmul against `torch.mm` at LLM shapes.

Legend: M rows, K reduction dim, N output columns / row length, D normalised dim.
"""
from __future__ import annotations

from kernels.batch_invariant.matmul import linear, mm_t
from kernels.batch_invariant.reference import linear_ref, logsumexp_ref, rms_norm_ref, softmax_ref
from kernels.batch_invariant.rmsnorm import rms_norm
from kernels.batch_invariant.row_softmax import logsumexp, softmax

__all__ = [
    "linear", "linear_ref", "logsumexp", "logsumexp_ref", "mm_t", "rms_norm", "rms_norm_ref", "softmax", "softmax_ref",
]
