"""Batch-invariant RMSNorm over the last dim, forward and backward (Triton).

    x_hat = x rsqrt(mean(x^2) + eps) (fp32);  y = x_hat (1 + w) zero_centered, else w round_x(x_hat)
    dx = rstd (g dy - x_hat mean(x_hat g dy)), g = 1 + w or w;  dw = sum over rows of dy x_hat

exactly `reference.rms_norm_ref`. One program per block of BR rows, BR and BD functions of D only;
dw in two fixed-order stages, no atomics (docs/design/numerics.md, "The batch-invariant mode").
Legend: M rows, D row length, P = ceil(M / BR) row blocks; tiles: BR rows, BD >= D columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_tuning import autotune, stages


@autotune(stages(4, (2,)), key=["D"])
@triton.jit(do_not_specialize=["M"])
def _rms_fwd_kernel(
    x, w, y, rstd, M, eps,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    row0 = tl.program_id(0).to(tl.int64) * BR
    x += row0 * D
    y += row0 * D
    rstd += row0
    o_r = tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < M - row0
    m_d = o_d < D
    m = m_r[:, None] & m_d[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    # [BR, BD]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    # [BR]
    b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    # [BD]
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_xh = b_x * b_r[:, None]
    if ZERO_CENTERED:
        b_y = b_xh * (1.0 + b_w)[None, :]
    else:
        b_y = b_w[None, :] * b_xh.to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + p, b_y.to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=m_r)


@autotune(stages(4, (2,)), key=["D"])
@triton.jit(do_not_specialize=["M"])
def _rms_bwd_kernel(
    x, w, rstd, dy, dx, dw_part, M,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, ZERO_CENTERED: tl.constexpr,
):
    i_p = tl.program_id(0).to(tl.int64)
    row0 = i_p * BR
    x += row0 * D
    dy += row0 * D
    dx += row0 * D
    rstd += row0
    o_r = tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < M - row0
    m_d = o_d < D
    m = m_r[:, None] & m_d[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    # [BR, BD]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    # [BR]
    b_r = tl.load(rstd + o_r, mask=m_r, other=0.0)
    # [BD]
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_xh = b_x * b_r[:, None]
    if ZERO_CENTERED:
        b_g = 1.0 + b_w
        b_dw = tl.sum(b_dy * b_xh, axis=0)
    else:
        b_g = b_w
        b_dw = tl.sum(b_dy * b_xh.to(dx.dtype.element_ty).to(tl.float32), axis=0)
    b_gdy = b_dy * b_g[None, :]
    b_dx = b_r[:, None] * (b_gdy - b_xh * (tl.sum(b_xh * b_gdy, axis=1) / D)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)
    tl.store(dw_part + i_p * D + o_d, b_dw, mask=m_d)


@autotune(stages(4, (2,)), key=["D"])
@triton.jit
def _sum_rows_kernel(part, out, P, D: tl.constexpr, BC: tl.constexpr):
    # out[d] = sum over p of part[p, d], p in order: the second stage of dw.
    o_c = tl.program_id(0) * BC + tl.arange(0, BC)
    m_c = o_c < D
    acc = tl.zeros([BC], dtype=tl.float32)
    for i_p in range(0, P):
        acc += tl.load(part + i_p * D + o_c, mask=m_c, other=0.0)
    tl.store(out + o_c, acc.to(out.dtype.element_ty), mask=m_c)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation; tests replace it with NaN-filled buffers to prove every element is written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _blocks(D: int) -> tuple[int, int]:
    """(BR, BD): rows per program and the row tile, functions of D only."""
    BD = max(16, triton.next_power_of_2(D))
    return max(1, min(16, 4096 // BD)), BD


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, w_D, eps, zero_centered):
        M, D = x_MD.shape
        BR, BD = _blocks(D)
        y = _empty((M, D), x_MD.dtype, x_MD.device)
        rstd = _empty((M,), torch.float32, x_MD.device)
        if M:
            _rms_fwd_kernel[(triton.cdiv(M, BR),)](x=x_MD, w=w_D, y=y, rstd=rstd, M=M, eps=eps, D=D, BR=BR, BD=BD,
                                        ZERO_CENTERED=zero_centered)
        ctx.save_for_backward(x_MD, w_D, rstd)
        ctx.zero_centered = zero_centered
        return y

    @staticmethod
    def backward(ctx, dy_MD):
        x_MD, w_D, rstd = ctx.saved_tensors
        M, D = x_MD.shape
        BR, BD = _blocks(D)
        P = triton.cdiv(M, BR)
        dx = _empty((M, D), x_MD.dtype, x_MD.device)
        dw_part = _empty((P, D), torch.float32, x_MD.device)
        dw = _empty((D,), w_D.dtype, w_D.device)
        if M:
            _rms_bwd_kernel[(P,)](x=x_MD, w=w_D, rstd=rstd, dy=dy_MD.contiguous(), dx=dx, dw_part=dw_part, M=M, D=D, BR=BR,
                       BD=BD, ZERO_CENTERED=ctx.zero_centered)
        _sum_rows_kernel[(triton.cdiv(D, 256),)](part=dw_part, out=dw, P=P, D=D, BC=256)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, zero_centered: bool) -> torch.Tensor:
    """Batch-invariant RMSNorm over the last dim, differentiable w.r.t. x and weight.

    Args:
        x: [..., D] fp32/bf16/fp16 (CUDA, or CPU under TRITON_INTERPRET=1 in fp32).
        weight: [D] (any float dtype; read in fp32).
        eps: added to the mean square.
        zero_centered: y = x_hat (1 + w) (the trainer's `RMSNorm`), else y = w x_hat with x_hat
            rounded to x's dtype first (its `GatedRMSNorm` before the gate).

    Returns:
        [..., D] in x's dtype; row m's bits depend only on x[m], weight, eps and D.
    """
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight: expected shape ({D},) for x [..., {D}], got {tuple(weight.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: expected fp32/bf16/fp16, got {x.dtype}")
    y = _RMSNorm.apply(x.reshape(-1, D).contiguous(), weight.contiguous(), float(eps), bool(zero_centered))
    return y.reshape(x.shape)
