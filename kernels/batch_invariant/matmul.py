"""Batch-invariant matmul y = x @ w.T: each output row's bits depend on that row of x, w and K only.

    y = linear(x_MK, w_NK)          # differentiable: dx and dw are the same kernel
    y = mm_t(a, b, out_dtype=None)  # a @ b.T, no autograd

Tiles fixed per dtype (`TILES`), no split-K, M not a specialisation key, num_stages the only tuned
parameter; fp32 inputs use exact fp32 products (docs/design/numerics.md, "The batch-invariant
mode"). Legend: M rows of x, K reduction dim, N rows of w (output columns); tiles BM x BN, BK per step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_tuning import autotune, stages

#: (BM, BN, BK) per input dtype: never chosen by the problem shape (num_warps: the kernel's).
TILES = {
    torch.bfloat16: (128, 256, 64),
    torch.float16: (128, 256, 64),
    torch.float32: (64, 64, 32),
}
GROUP_M = 8


@triton.jit(do_not_specialize=["M"])
def _mm_t_body(
    a, b, c, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PREC: tl.constexpr,
):
    # Grouped order of the output tiles (L2 reuse of b); it does not touch the arithmetic.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    o_m = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
    o_n = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < M
    m_n = o_n < N
    p_a = a + o_m[:, None] * stride_am + o_k[None, :] * stride_ak
    p_b = b + o_n[:, None] * stride_bn + o_k[None, :] * stride_bk
    # [BM, BN]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = o_k < K - k0
        # [BM, BK], [BN, BK]
        b_a = tl.load(p_a, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_b = tl.load(p_b, mask=m_n[:, None] & m_k[None, :], other=0.0)
        acc = tl.dot(b_a, tl.trans(b_b), acc, input_precision=PREC)
        p_a += BK * stride_ak
        p_b += BK * stride_bk
    p_c = c + o_m[:, None] * stride_cm + o_n[None, :] * stride_cn
    tl.store(p_c, acc.to(c.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


# One body, two launch configs: 8 warps on the tensor cores (bf16/fp16), 4 for fp32's CUDA-core dots.
_mm_t_tc_kernel = autotune(stages(8, (3, 4)), key=["N", "K", "BM", "BN", "BK"])(_mm_t_body)
_mm_t_fp32_kernel = autotune(stages(4, (2, 3)), key=["N", "K", "BM", "BN", "BK"])(_mm_t_body)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation; tests replace it with NaN-filled buffers to prove every element is written."""
    return torch.empty(shape, dtype=dtype, device=device)


def mm_t(a_MK: torch.Tensor, b_NK: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a @ b.T [M, N] in `out_dtype` (default a's dtype), batch-invariant in the rows of a.

    Args:
        a_MK: [M, K]; b_NK: [N, K] (any strides), both fp32, bf16 or fp16, one dtype, one device
            (CUDA, or CPU under TRITON_INTERPRET=1 in fp32).
    """
    if a_MK.dim() != 2 or b_NK.dim() != 2 or a_MK.shape[1] != b_NK.shape[1]:
        raise ValueError(f"a, b: expected [M, K] and [N, K], got {tuple(a_MK.shape)} and {tuple(b_NK.shape)}")
    if a_MK.dtype != b_NK.dtype or a_MK.dtype not in TILES:
        raise ValueError(f"a, b: expected one dtype among {tuple(TILES)}, got {a_MK.dtype} and {b_NK.dtype}")
    (M, K), N = a_MK.shape, b_NK.shape[0]
    c = _empty((M, N), out_dtype or a_MK.dtype, a_MK.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    BM, BN, BK = TILES[a_MK.dtype]
    kernel = _mm_t_fp32_kernel if a_MK.dtype == torch.float32 else _mm_t_tc_kernel
    kernel[(triton.cdiv(M, BM) * triton.cdiv(N, BN),)](
        a=a_MK, b=b_NK, c=c, M=M, N=N, K=K, stride_am=a_MK.stride(0), stride_ak=a_MK.stride(1),
        stride_bn=b_NK.stride(0), stride_bk=b_NK.stride(1), stride_cm=c.stride(0), stride_cn=c.stride(1),
        BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M, PREC="ieee" if a_MK.dtype == torch.float32 else "tf32",
    )
    return c


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK):
        ctx.save_for_backward(x_MK, w_NK)
        return mm_t(x_MK, w_NK)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_NK = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = mm_t(dy_MN, w_NK.t(), x_MK.dtype)
        if ctx.needs_input_grad[1]:
            dw = mm_t(dy_MN.t(), x_MK.t(), w_NK.dtype)
        return dx, dw


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Batch-invariant x @ weight.T, differentiable (`nn.functional.linear` without bias).

    Args:
        x: [..., K] (leading dims flattened into rows). weight: [N, K], x's dtype and device.

    Returns:
        [..., N] in x's dtype; row m's bits depend only on x[m], weight and the dtype.
    """
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x, weight: expected [..., K] and [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    y = _Linear.apply(x.reshape(-1, x.shape[-1]), weight)
    return y.reshape(*x.shape[:-1], weight.shape[0])
