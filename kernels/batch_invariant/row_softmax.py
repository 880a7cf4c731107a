"""Batch-invariant row-wise logsumexp and softmax over the last dim, forward and backward (Triton).

    lse = m + log(s)         `logsumexp`; backward dx = dlse exp(x - lse)
    y   = exp(x - lse)       `softmax` (second pass); backward dx = y (dy - sum(dy y)), y recomputed in fp32

One program per row walks it in BN-column blocks, first to last, with fp32 online statistics
(running max m, running sum s); BN is a function of the row length only
(docs/design/numerics.md, "The batch-invariant mode"). Legend: M rows, N row length; tiles: BN columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_tuning import autotune, stages


@triton.jit
def _row_lse(x, N, BN: tl.constexpr):
    """fp32 log-sum-exp of the row at x (N elements), blocks of BN in order."""
    o_n = tl.arange(0, BN)
    # A finite start keeps exp(m - m_new) a number until the first block.
    m = tl.full([1], -1.0e30, dtype=tl.float32)
    s = tl.zeros([1], dtype=tl.float32)
    for n0 in range(0, N, BN):
        b_x = tl.load(x + n0 + o_n, mask=o_n < N - n0, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(b_x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(b_x - m_new), axis=0)
        m = m_new
    return m + tl.log(s)


@autotune(stages(4, (2,)), key=["N", "BN"])
@triton.jit(do_not_specialize=["M"])
def _lse_fwd_kernel(x, lse, M, N, BN: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    tl.store(lse + i_m + tl.arange(0, 1), _row_lse(x + i_m * N, N, BN))


@autotune(stages(4, (2,)), key=["N", "BN"])
@triton.jit(do_not_specialize=["M"])
def _lse_bwd_kernel(x, lse, dlse, dx, M, N, BN: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    x += i_m * N
    dx += i_m * N
    o_n = tl.arange(0, BN)
    # [1]
    b_lse = tl.load(lse + i_m + tl.arange(0, 1))
    b_dlse = tl.load(dlse + i_m + tl.arange(0, 1))
    for n0 in range(0, N, BN):
        m_n = o_n < N - n0
        b_x = tl.load(x + n0 + o_n, mask=m_n, other=0.0).to(tl.float32)
        tl.store(dx + n0 + o_n, (b_dlse * tl.exp(b_x - b_lse)).to(dx.dtype.element_ty), mask=m_n)


@autotune(stages(4, (2,)), key=["N", "BN"])
@triton.jit(do_not_specialize=["M"])
def _softmax_fwd_kernel(x, y, lse, M, N, BN: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    x += i_m * N
    y += i_m * N
    o_n = tl.arange(0, BN)
    b_lse = _row_lse(x, N, BN)
    tl.store(lse + i_m + tl.arange(0, 1), b_lse)
    for n0 in range(0, N, BN):
        m_n = o_n < N - n0
        b_x = tl.load(x + n0 + o_n, mask=m_n, other=0.0).to(tl.float32)
        tl.store(y + n0 + o_n, tl.exp(b_x - b_lse).to(y.dtype.element_ty), mask=m_n)


@autotune(stages(4, (2,)), key=["N", "BN"])
@triton.jit(do_not_specialize=["M"])
def _softmax_bwd_kernel(x, lse, dy, dx, M, N, BN: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)
    x += i_m * N
    dy += i_m * N
    dx += i_m * N
    o_n = tl.arange(0, BN)
    b_lse = tl.load(lse + i_m + tl.arange(0, 1))
    # sum(dy y) over the row, blocks in order
    b_dot = tl.zeros([1], dtype=tl.float32)
    for n0 in range(0, N, BN):
        m_n = o_n < N - n0
        b_x = tl.load(x + n0 + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + n0 + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_dot += tl.sum(tl.where(m_n, b_dy * tl.exp(b_x - b_lse), 0.0), axis=0)
    for n0 in range(0, N, BN):
        m_n = o_n < N - n0
        b_x = tl.load(x + n0 + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_dy = tl.load(dy + n0 + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_y = tl.exp(b_x - b_lse)
        tl.store(dx + n0 + o_n, (b_y * (b_dy - b_dot)).to(dx.dtype.element_ty), mask=m_n)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation; tests replace it with NaN-filled buffers to prove every element is written."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block(N: int) -> int:
    """BN, the column block: a function of N only."""
    return min(4096, max(16, triton.next_power_of_2(N)))


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x: expected fp32/bf16/fp16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x: expected [..., N] with N >= 1, got shape {tuple(x.shape)}")
    return x.reshape(-1, x.shape[-1]).contiguous()


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MN):
        M, N = x_MN.shape
        lse = _empty((M,), torch.float32, x_MN.device)
        if M:
            _lse_fwd_kernel[(M,)](x=x_MN, lse=lse, M=M, N=N, BN=_block(N))
        ctx.save_for_backward(x_MN, lse)
        return lse

    @staticmethod
    def backward(ctx, dlse_M):
        x_MN, lse = ctx.saved_tensors
        M, N = x_MN.shape
        dx = _empty((M, N), x_MN.dtype, x_MN.device)
        if M:
            _lse_bwd_kernel[(M,)](x=x_MN, lse=lse, dlse=dlse_M.float().contiguous(), dx=dx, M=M, N=N, BN=_block(N))
        return dx


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MN, dtype):
        M, N = x_MN.shape
        y = _empty((M, N), dtype, x_MN.device)
        lse = _empty((M,), torch.float32, x_MN.device)
        if M:
            _softmax_fwd_kernel[(M,)](x=x_MN, y=y, lse=lse, M=M, N=N, BN=_block(N))
        ctx.save_for_backward(x_MN, lse)
        return y

    @staticmethod
    def backward(ctx, dy_MN):
        x_MN, lse = ctx.saved_tensors
        M, N = x_MN.shape
        dx = _empty((M, N), x_MN.dtype, x_MN.device)
        if M:
            _softmax_bwd_kernel[(M,)](x=x_MN, lse=lse, dy=dy_MN.contiguous(), dx=dx, M=M, N=N, BN=_block(N))
        return dx, None


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Batch-invariant log(sum(exp(x))) over the last dim, fp32, differentiable.

    Args:
        x: [..., N] fp32/bf16/fp16 (CUDA, or CPU under TRITON_INTERPRET=1 in fp32).

    Returns:
        [...] fp32; row m's bits depend only on x[m] and N.
    """
    return _LogSumExp.apply(_rows(x)).reshape(x.shape[:-1])


def softmax(x: torch.Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant softmax over the last dim, computed in fp32, differentiable.

    Args:
        x: [..., N] fp32/bf16/fp16 (CUDA, or CPU under TRITON_INTERPRET=1 in fp32).
        dtype: of the result (default x's dtype; fp32 keeps every bit of the fp32 computation).

    Returns:
        [..., N]; row m's bits depend only on x[m] and N.
    """
    return _Softmax.apply(_rows(x), dtype or x.dtype).reshape(x.shape)
