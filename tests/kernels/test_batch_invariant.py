"""Tests of kernels.batch_invariant on the CPU: the Triton kernels under the interpreter (a
subprocess: tests/kernels/test_batch_invariant_triton.py) and compiled for sm_90 without a GPU
(tests/triton_aot.py): every kernel compiles in bf16 and fp32 with the specialisation a launch
gets, and the bf16 matmul is a pipelined wgmma loop."""
from __future__ import annotations

import os

import pytest
import torch

from tests.triton_interpreter import run_under_interpreter


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    """Values, gradients, bitwise row invariance and deterministic mode, fp32 (see that module)."""
    run_under_interpreter("kernels/test_batch_invariant_triton.py")


def _launches(monkeypatch, dtype: torch.dtype) -> dict:
    """Each distinct launch of a forward + backward of every op, recorded on the CPU:
    {(kernel name, output dtypes): (kernel, kwargs)}."""
    from kernels.batch_invariant import linear, logsumexp, matmul, rms_norm, rmsnorm, row_softmax, softmax
    from tests.triton_aot import record

    launches = record(monkeypatch, matmul, rmsnorm, row_softmax)
    x = torch.randn(300, 2048, dtype=dtype, requires_grad=True)
    w = torch.randn(512, 2048, dtype=dtype, requires_grad=True)
    g = torch.randn(2048, requires_grad=True)
    z = torch.randn(4, 151_936, dtype=dtype, requires_grad=True)
    y = linear(x, w)
    torch.autograd.grad(y, [x, w], torch.randn_like(y))
    for zero_centered in (True, False):
        y = rms_norm(x, g, eps=1e-6, zero_centered=zero_centered)
        torch.autograd.grad(y, [x, g], torch.randn_like(y))
    torch.autograd.grad(logsumexp(z), z, torch.randn(4))
    y = softmax(z, dtype=torch.float32)
    torch.autograd.grad(y, z, torch.randn_like(y))
    out = {}
    for name, kernel, kwargs in launches:
        key = (name, *(str(v.dtype) for v in kwargs.values() if isinstance(v, torch.Tensor)),
               *(f"{k}={v}" for k, v in kwargs.items() if k == "ZERO_CENTERED" or k.startswith("stride") and v == 1))
        out.setdefault(key, (kernel, kwargs))
    return out


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for a GPU target")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_kernels_compile_for_sm90(monkeypatch, dtype):
    from tests.triton_aot import compile_launch

    launches = _launches(monkeypatch, dtype)
    names = {key[0] for key in launches}
    assert names == {"_mm_t_tc_kernel" if dtype == torch.bfloat16 else "_mm_t_fp32_kernel", "_rms_fwd_kernel",
                     "_rms_bwd_kernel", "_sum_rows_kernel", "_lse_fwd_kernel", "_lse_bwd_kernel",
                     "_softmax_fwd_kernel", "_softmax_bwd_kernel"}, names
    assert sum(key[0].startswith("_mm_t") for key in launches) == 3  # y, dx (w^T), dw (dy^T, x^T)
    for key, (kernel, kwargs) in launches.items():
        ttgir = compile_launch(kernel, kwargs).asm["ttgir"]
        if key[0] == "_mm_t_tc_kernel" and "stride_ak=1" in key and "stride_bk=1" in key:
            assert "ttng.warp_group_dot " in ttgir and "async_copy_global_to_local" in ttgir, key
