"""Tests of kernels.batch_invariant: the Triton kernels against their PyTorch references (values and
gradients), and batch invariance: a row computed inside batches of other sizes, at other positions,
beside other rows, gets the same bits.

Runs on CUDA, or on CPU under the Triton interpreter in fp32: `TRITON_INTERPRET=1 pytest
tests/kernels/test_batch_invariant_triton.py` (tests/kernels/test_batch_invariant.py starts that in
a subprocess). The bf16 cases are gpu-marked (the interpreter's bf16 is wrong). Every output buffer
starts as NaN.
"""
from __future__ import annotations

import os

import pytest
import torch

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see module docstring)", allow_module_level=True)

from kernels.batch_invariant import (  # noqa: E402
    linear, linear_ref, logsumexp, logsumexp_ref, mm_t, rms_norm, rms_norm_ref, softmax, softmax_ref,
)
from kernels.batch_invariant import matmul, rmsnorm, row_softmax  # noqa: E402
from tests.determinism import deterministic  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="bf16 is only meaningful on a GPU (the interpreter's bf16 is wrong)")


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    for module in (matmul, rmsnorm, row_softmax):
        monkeypatch.setattr(
            module, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
        )


def randn(*shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


def assert_rel(a: torch.Tensor, b: torch.Tensor, tol: float, name: str) -> None:
    assert not a.isnan().any(), f"{name}: NaN (an element never written)"
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    assert err <= tol, f"{name}: max error {err:.3g} of max |ref| > {tol}"


def sub_batches(M: int, seed: int) -> list[torch.Tensor]:
    """Row index sets of other batches: prefixes, a middle slice, single rows, a permutation (rows at
    other tile positions) and a batch with every row repeated (other neighbours)."""
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(seed))
    return [torch.arange(1), torch.arange(min(M, 5)), torch.arange(M // 3, M), torch.tensor([M - 1]), perm,
            torch.arange(M).repeat_interleave(2)]


def assert_rows_invariant(fn, x: torch.Tensor, seed: int) -> None:
    """fn's rows on every sub-batch of x are bitwise its rows on all of x."""
    full = fn(x)
    for rows in sub_batches(x.shape[0], seed):
        part = fn(x[rows.to(x.device)])
        assert torch.equal(part, full[rows.to(x.device)]), f"rows {rows.tolist()[:8]}...: {part.shape}"


# (M, K, N): one tile and several, K with a masked last step, N with a masked last tile.
LINEAR_SHAPES = {"M1_K20_N8": (1, 20, 8), "M37_K72_N40": (37, 72, 40), "M130_K64_N70": (130, 64, 70)}


@pytest.mark.parametrize("shape", list(LINEAR_SHAPES.values()), ids=list(LINEAR_SHAPES))
def test_linear_matches_ref_fp32(shape):
    M, K, N = shape
    x = randn(M, K, seed=1).requires_grad_(True)
    w = randn(N, K, seed=2, scale=K**-0.5).requires_grad_(True)
    dy = randn(M, N, seed=3)
    y = linear(x, w)
    y_ref = linear_ref(x, w)
    assert y.shape == (M, N) and y.dtype == torch.float32
    assert_rel(y, y_ref, 1e-5, "y")
    for name, a, b in zip(("dx", "dw"), torch.autograd.grad(y, [x, w], dy), torch.autograd.grad(y_ref, [x, w], dy)):
        assert_rel(a, b, 1e-5, name)


def test_linear_flattens_leading_dims_and_checks_shapes():
    x, w = randn(2, 3, 16, seed=4), randn(5, 16, seed=5)
    assert torch.equal(linear(x, w), linear(x.reshape(6, 16), w).reshape(2, 3, 5))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        linear(x, randn(5, 15, seed=6))
    with pytest.raises(ValueError, match="one dtype"):
        mm_t(x.reshape(6, 16), w.double())


def test_linear_and_its_input_gradient_are_row_invariant_fp32():
    """y = x w^T and dx = dy w: every row's bits are the same in any batch (M is no
    specialisation key, the tiles are fixed, no split-K)."""
    M, K, N = 150, 72, 40
    x, w, dy = randn(M, K, seed=7), randn(N, K, seed=8), randn(M, N, seed=9)
    assert_rows_invariant(lambda rows: linear(rows, w), x, seed=10)
    assert_rows_invariant(lambda rows: mm_t(rows, w.t()), dy, seed=11)


@pytest.mark.parametrize("zero_centered", [True, False], ids=["zero_centered", "plain_weight"])
@pytest.mark.parametrize("D", [48, 256], ids=["D48", "D256"])
def test_rms_norm_matches_ref_fp32(D, zero_centered):
    M = 37
    x = randn(M, D, seed=12, scale=3.0).requires_grad_(True)
    w = randn(D, seed=13, scale=0.1).requires_grad_(True)
    dy = randn(M, D, seed=14)
    y = rms_norm(x, w, eps=1e-6, zero_centered=zero_centered)
    y_ref = rms_norm_ref(x, w, eps=1e-6, zero_centered=zero_centered)
    assert_rel(y, y_ref, 2e-6, "y")
    for name, a, b in zip(("dx", "dw"), torch.autograd.grad(y, [x, w], dy), torch.autograd.grad(y_ref, [x, w], dy)):
        assert_rel(a, b, 1e-5, name)


def test_rms_norm_and_its_input_gradient_are_row_invariant_fp32():
    M, D = 70, 48
    x, w, dy = randn(M, D, seed=15), randn(D, seed=16, scale=0.1), randn(M, D, seed=17)

    def dx(idx_rows):
        xr = x[idx_rows].requires_grad_(True)
        return torch.autograd.grad(rms_norm(xr, w, eps=1e-6, zero_centered=True), xr, dy[idx_rows])[0]

    assert_rows_invariant(lambda rows: rms_norm(rows, w, eps=1e-6, zero_centered=True), x, seed=18)
    full = dx(torch.arange(M, device=DEVICE))
    for rows in sub_batches(M, seed=19):
        assert torch.equal(dx(rows.to(DEVICE)), full[rows.to(DEVICE)])


# Row lengths: one block, and (N > 4096) several blocks with a masked last one.
@pytest.mark.parametrize("N", [50, 5000], ids=["N50", "N5000"])
def test_logsumexp_and_softmax_match_ref_fp32(N):
    M = 6
    x = randn(M, N, seed=20, scale=4.0).requires_grad_(True)
    dl, dy = randn(M, seed=21), randn(M, N, seed=22)
    lse, lse_ref = logsumexp(x), logsumexp_ref(x)
    assert lse.dtype == torch.float32 and lse.shape == (M,)
    assert_rel(lse, lse_ref, 1e-6, "lse")
    assert_rel(torch.autograd.grad(lse, x, dl)[0], torch.autograd.grad(lse_ref, x, dl)[0], 1e-5, "dx lse")
    y, y_ref = softmax(x), softmax_ref(x)
    assert_rel(y, y_ref, 1e-5, "softmax")
    assert_rel(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(y_ref, x, dy)[0], 1e-5, "dx softmax")


def test_logsumexp_and_softmax_are_row_invariant_and_keep_masked_rows_finite_fp32():
    M, N = 40, 300
    x = randn(M, N, seed=23, scale=5.0)
    x[3, 10:] = float("-inf")  # a row with few finite logits
    assert_rows_invariant(logsumexp, x, seed=24)
    assert_rows_invariant(softmax, x, seed=25)
    assert torch.isfinite(logsumexp(x)).all()
    torch.testing.assert_close(softmax(x).sum(-1), torch.ones(M, device=DEVICE))


def test_every_kernel_runs_under_torch_deterministic_mode():
    x = randn(20, 32, seed=26).requires_grad_(True)
    w = randn(16, 32, seed=27).requires_grad_(True)
    g = randn(32, seed=28).requires_grad_(True)
    with deterministic():
        runs = []
        for _ in range(2):
            h = rms_norm(linear(x, w), g[:16], eps=1e-6, zero_centered=True)
            loss = (softmax(h) * h).sum() + logsumexp(h).sum()
            runs.append(torch.autograd.grad(loss, [x, w, g]))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# GPU (bf16 on the tensor cores, and fp32 at LLM shapes).
LLM = dict(K=2048, N=512)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_linear_is_row_invariant_and_accurate(dtype):
    M, K, N = 1000, LLM["K"], LLM["N"]
    x, w = randn(M, K, seed=30, dtype=dtype), randn(N, K, seed=31, dtype=dtype, scale=K**-0.5)
    assert_rows_invariant(lambda rows: linear(rows, w), x, seed=32)
    for big in (4096, 8192):  # the same rows inside larger batches
        xb = torch.cat([x, randn(big - M, K, seed=33, dtype=dtype)])
        assert torch.equal(linear(xb, w)[:M], linear(x, w))
    assert_rel(linear(x, w), linear_ref(x, w), 1e-2 if dtype == torch.bfloat16 else 1e-5, "y")
    dy = randn(M, N, seed=34, dtype=dtype)
    assert_rows_invariant(lambda rows: mm_t(rows, w.t()), dy, seed=35)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_norm_and_softmax_are_row_invariant(dtype):
    x = randn(1000, 2048, seed=36, dtype=dtype, scale=3.0)
    w = randn(2048, seed=37, scale=0.1)
    for zero_centered in (True, False):
        assert_rows_invariant(lambda rows: rms_norm(rows, w, eps=1e-6, zero_centered=zero_centered), x, seed=38)
        assert_rel(rms_norm(x, w, eps=1e-6, zero_centered=zero_centered),
                   rms_norm_ref(x, w, eps=1e-6, zero_centered=zero_centered), 1e-2 if dtype == torch.bfloat16 else 1e-5, "y")
    logits = randn(64, 151_936, seed=39, dtype=dtype, scale=3.0)
    assert_rows_invariant(logsumexp, logits, seed=40)
    assert_rows_invariant(lambda rows: softmax(rows, dtype=torch.float32), logits, seed=41)
    assert_rel(logsumexp(logits), logsumexp_ref(logits), 1e-6, "lse")
