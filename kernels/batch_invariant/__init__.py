"""Batch-invariant GPU kernels: a row's result does not depend on how many rows run with it.

    y = linear(x, weight)                       x @ weight.T           `matmul`
    y = mm_t(a, b, out_dtype=None)              a @ b.T, no autograd   `matmul`
    y = rms_norm(x, weight, eps=, zero_centered=)                      `rmsnorm`
    lse = logsumexp(x)          y = softmax(x, dtype=None)             `row_softmax`

Every reduction in an order fixed by the reduced length alone, differentiable, on CUDA or under
TRITON_INTERPRET=1 in fp32; PyTorch references in `reference`. Why and how: docs/design/numerics.md
("The batch-invariant mode"). Legend: M rows, K reduction dim, N output columns / row length, D normalised dim.
"""
from __future__ import annotations

from kernels.batch_invariant.matmul import linear, mm_t
from kernels.batch_invariant.reference import linear_ref, logsumexp_ref, rms_norm_ref, softmax_ref
from kernels.batch_invariant.rmsnorm import rms_norm
from kernels.batch_invariant.row_softmax import logsumexp, softmax

__all__ = [
    "linear", "linear_ref", "logsumexp", "logsumexp_ref", "mm_t", "rms_norm", "rms_norm_ref", "softmax", "softmax_ref",
]
