"""PyTorch references of the batch-invariant kernels: the math and the roundings they implement.

Plain torch ops, differentiable through autograd; fp32 math for every input dtype (float64 stays
float64), results rounded once to the output dtype. They define what the Triton kernels compute;
they are not themselves batch-invariant on a GPU (cuBLAS and torch's reductions pick their
strategy by shape).

Legend: M rows, K reduction dim, N output columns (or a row's length), D normalised dim.
"""
from __future__ import annotations

import torch

from kernels.dtypes import compute_dtype


def linear_ref(x_MK: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """x @ w.T in fp32 (float64 for float64 inputs), rounded to x's dtype. x [..., K], w [N, K]."""
    dt = compute_dtype(x_MK, w_NK)
    return (x_MK.to(dt) @ w_NK.to(dt).T).to(x_MK.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, *, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim, in x's dtype.

    zero_centered: x_hat (1 + w), rounded once (the trainer's `RMSNorm`, Qwen3-Next's norm);
    else w x_hat with x_hat first rounded to x's dtype (the trainer's `GatedRMSNorm` before its
    gate, transformers' convention); x_hat = x rsqrt(mean(x^2) + eps) in fp32.
    """
    dt = compute_dtype(x)
    xf = x.to(dt)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x_hat * (1.0 + weight.to(dt))).to(x.dtype)
    return (weight.to(dt) * x_hat.to(x.dtype).to(dt)).to(x.dtype)


def logsumexp_ref(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) over the last dim, fp32 (float64 for float64 x)."""
    return torch.logsumexp(x.to(compute_dtype(x)), dim=-1)


def softmax_ref(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax over the last dim computed in fp32, in `dtype` (default x's dtype)."""
    return torch.softmax(x.to(compute_dtype(x)), dim=-1).to(dtype or x.dtype)
