"""Tests of the Triton backend of kernels.gated_delta_rule against the PyTorch reference.

Runs on CUDA, or on CPU under the Triton interpreter: `TRITON_INTERPRET=1 pytest
tests/test_gated_delta_rule_triton.py` (tests/test_gated_delta_rule.py starts exactly that in a
subprocess, since the variable must be set before triton is imported). Otherwise skipped.
"""
from __future__ import annotations

import os

import pytest
import torch

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see module docstring)", allow_module_level=True)

from kernels.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from kernels.gated_delta_rule import chunk_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output buffer starts as NaN: a missed store shows up in the comparisons."""
    monkeypatch.setattr(
        chunk_triton, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )


def make_inputs(lens, H, K, V, *, seed, init=True, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = dict(
        q=torch.randn(T, H, K, generator=gen),
        k=torch.randn(T, H, K, generator=gen) * K**-0.5,
        v=torch.randn(T, H, V, generator=gen),
        g=-0.3 * torch.rand(T, H, generator=gen),
        beta=torch.rand(T, H, generator=gen) * 0.9 + 0.05,
        h0=0.5 * torch.randn(len(lens), H, K, V, generator=gen) if init else None,
    )
    x = {n: None if t is None else t.to(DEVICE, dtype if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
    return x, cu


def run(backend, x, cu, exports, C, **kw):
    return chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, initial_state=x["h0"],
        export_seq=torch.tensor([e[0] for e in exports], dtype=torch.long),
        export_pos=torch.tensor([e[1] for e in exports], dtype=torch.long),
        chunk_size=C, backend=backend, **kw,
    )


# (lens, H, K, V, C, init, l2norm, exports)
CASES = {
    "n1_C16_end": ([37], 1, 16, 16, 16, False, True, [(0, 16), (0, 37)]),
    "n3_C16_K8_V40_init": ([37, 16, 5], 2, 8, 40, 16, True, False, [(0, 37), (2, 5), (1, 16), (0, 16), (0, 16)]),
    "n2_C32_K20_l2": ([70, 33], 2, 20, 12, 32, True, True, [(1, 32), (0, 64), (1, 33)]),
    "no_exports": ([9, 20], 1, 16, 16, 16, True, True, []),
}
if DEVICE == "cuda":
    CASES["cuda_n4_C64_K128"] = ([300, 64, 1, 129], 4, 128, 128, 64, True, True, [(0, 256), (3, 129), (1, 64), (0, 300)])


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_triton_forward_matches_ref_fp32(case):
    lens, H, K, V, C, init, l2, exports = case
    x, cu = make_inputs(lens, H, K, V, seed=1, init=init)
    o_t, s_t = run("triton", x, cu, exports, C, use_qk_l2norm=l2)
    o_r, s_r = run("ref", x, cu, exports, C, use_qk_l2norm=l2)
    assert o_t.dtype == torch.float32 and s_t.shape == (len(exports), H, K, V)
    assert not o_t.isnan().any() and not s_t.isnan().any()
    torch.testing.assert_close(o_t, o_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_t, s_r, rtol=1e-5, atol=1e-5)


def test_triton_packing_is_bitwise_invariant():
    """One program per (sequence, head, V block): a sequence's bits do not depend on its neighbours."""
    L, C = 45, 16
    x, cu = make_inputs([L], 2, 16, 16, seed=7)
    o_alone, s_alone = run("triton", x, cu, [(0, 32), (0, L)], C, use_qk_l2norm=True)
    y, cu2 = make_inputs([20, L, 33], 2, 16, 16, seed=8)
    for n in ("q", "k", "v", "g", "beta"):
        y[n][20 : 20 + L] = x[n]
    y["h0"][1] = x["h0"][0]
    o, s = run("triton", y, cu2, [(2, 33), (1, 32), (1, L)], C, use_qk_l2norm=True)
    assert torch.equal(o[20 : 20 + L], o_alone)
    assert torch.equal(s[1:], s_alone)


def test_triton_backward_is_the_reference_gradient():
    """Backward recomputes the reference: gradients (with a cotangent on the exported states) match it."""
    x, cu = make_inputs([37, 16], 2, 8, 8, seed=2)
    for t in x.values():
        t.requires_grad_(True)
    exports = [(0, 16), (1, 16), (0, 37)]
    gen = torch.Generator().manual_seed(3)
    outs = {b: run(b, x, cu, exports, 16, use_qk_l2norm=True) for b in ("triton", "ref")}
    cot = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in outs["ref"]]
    leaves = list(x.values())
    g_t = torch.autograd.grad(outs["triton"], leaves, cot)
    g_r = torch.autograd.grad(outs["ref"], leaves, cot)
    for a, b in zip(g_t, g_r):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_triton_without_initial_state_has_gradients():
    x, cu = make_inputs([20], 1, 16, 16, seed=4, init=False)
    x["v"].requires_grad_(True)
    o, s = run("triton", x, cu, [(0, 16)], 16)
    (dv,) = torch.autograd.grad(o.sum() + s.sum(), [x["v"]])
    assert dv.abs().max() > 0


def test_triton_rejects_small_chunks():
    x, cu = make_inputs([8], 1, 16, 16, seed=5)
    with pytest.raises(ValueError, match="chunk_size"):
        run("triton", x, cu, [], 8)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 is only meaningful on a GPU (the interpreter's bf16 is wrong)")
def test_triton_bf16_inputs_match_ref():
    x, cu = make_inputs([300, 64, 129], 4, 128, 128, seed=6, dtype=torch.bfloat16)
    exports = [(0, 256), (2, 129)]
    o_t, s_t = run("triton", x, cu, exports, 64, use_qk_l2norm=True)
    o_r, s_r = run("ref", x, cu, exports, 64, use_qk_l2norm=True)
    assert o_t.dtype == torch.bfloat16 and s_t.dtype == torch.float32
    torch.testing.assert_close(o_t.float(), o_r.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(s_t, s_r, rtol=1e-4, atol=1e-4)
