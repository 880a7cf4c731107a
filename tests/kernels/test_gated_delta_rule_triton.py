"""Tests of the Triton backend of kernels.gated_delta_rule against the PyTorch reference.

Runs on CUDA, or on CPU under the Triton interpreter: `TRITON_INTERPRET=1 pytest
tests/kernels/test_gated_delta_rule_triton.py` (tests/kernels/test_gated_delta_rule.py starts exactly that in a
subprocess, since the variable must be set before triton is imported). Otherwise skipped.

Every buffer the kernels write starts as NaN (outputs and intermediates), so a missed store or a
read of an unwritten element shows up in the comparisons. Interpreter cost grows with programs x
loop iterations: keep the shapes small.
"""
from __future__ import annotations

import os

import pytest
import torch

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see module docstring)", allow_module_level=True)

from kernels.gated_delta_rule import chunk_gated_delta_rule, prepare_layout  # noqa: E402
from tests.determinism import deterministic  # noqa: E402
from kernels import triton_640  # noqa: E402
from kernels.gated_delta_rule import chunk_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("o", "states", "dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    monkeypatch.setattr(
        chunk_triton, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )


def make_inputs(lens, H, K, V, *, seed, init=True, decay=0.3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = dict(
        q=torch.randn(T, H, K, generator=gen),
        k=torch.randn(T, H, K, generator=gen) * K**-0.5,
        v=torch.randn(T, H, V, generator=gen),
        g=-decay * torch.rand(T, H, generator=gen),
        beta=torch.rand(T, H, generator=gen) * 0.9 + 0.05,
        h0=0.5 * torch.randn(len(lens), H, K, V, generator=gen) if init else None,
    )
    x = {n: None if t is None else t.to(DEVICE, dtype if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
    return x, cu


def exports_of(pairs):
    return (torch.tensor([p[0] for p in pairs], dtype=torch.long), torch.tensor([p[1] for p in pairs], dtype=torch.long))


def run(backend, x, cu, exports, C, **kw):
    es, ep = exports_of(exports)
    return chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, initial_state=x["h0"], export_seq=es,
        export_pos=ep, chunk_size=C, backend=backend, **kw,
    )


def outputs_and_grads(backend, x, cu, exports, C, *, seed, **kw):
    """(o, states, dq, dk, dv, dg, dbeta[, dh0]) under random cotangents on o and on every exported state."""
    leaves = {n: t.detach().requires_grad_(True) for n, t in x.items() if t is not None}
    y = {n: leaves.get(n) for n in x}
    o, s = run(backend, y, cu, exports, C, **kw)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(DEVICE, o.dtype)
    ds = torch.randn(s.shape, generator=gen).to(DEVICE)
    outs, cots = ([o, s], [do, ds]) if s.numel() else ([o], [do])
    grads = torch.autograd.grad(outs, list(leaves.values()), cots)
    return (o, s, *grads)


def assert_close_rel(got, want, tol, names=NAMES):
    """max |got - want| <= tol * max |want| per tensor, and no NaN."""
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert not a.isnan().any(), f"{name}: NaN (an element never written)"
        if b.numel() == 0:
            continue
        scale = b.abs().max().item()
        assert scale > 0, name
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * scale, f"{name}: max abs error {err:.3g} > {tol} x max |ref| {scale:.3g}"


# (lens, H, K, V, C, init, l2norm, decay, exports): varlen packings with partial last chunks,
# duplicate and end-of-sequence exports, K and V that are not powers of two (masked tiles), several
# key blocks (K=80: two 64-column blocks), and decays strong enough that the upper halves of the
# decay tiles overflow (C * 8 = 512 in the exponent).
CASES = {
    "n3_C16_K8_V40_init_dup": ([37, 16, 5], 2, 8, 40, 16, True, False, 0.3, [(0, 37), (2, 5), (1, 16), (0, 16), (0, 16)]),
    "n2_C32_K20_V12_l2": ([70, 33], 2, 20, 12, 32, True, True, 0.3, [(1, 32), (0, 64), (1, 33)]),
    "n3_C64_K80_noinit_strong": ([100, 64, 1], 1, 80, 16, 64, False, True, 8.0, [(0, 64), (2, 1), (0, 100)]),
    "n2_C16_no_exports": ([9, 20], 1, 16, 16, 16, True, True, 1.0, []),
}
# (Production tiles, K = V = 128 and C = 64, run in bf16 on CUDA below: fp32 products at full
# precision there compile slowly and are not a production path.)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_triton_matches_ref_fp32(case):
    """Outputs, exported states and every gradient (q, k, v, g, beta, initial state), with gradients
    injected on the exported states."""
    lens, H, K, V, C, init, l2, decay, exports = case
    x, cu = make_inputs(lens, H, K, V, seed=1, init=init, decay=decay)
    got = outputs_and_grads("triton", x, cu, exports, C, seed=2, use_qk_l2norm=l2)
    want = outputs_and_grads("ref", x, cu, exports, C, seed=2, use_qk_l2norm=l2)
    assert got[0].dtype == torch.float32 and got[1].shape == (len(exports), H, K, V)
    assert len(got) == len(want) == (8 if init else 7)
    assert_close_rel(got, want, 2e-6)


# fla #640 shapes (kernels/triton_640.py): BK = 64 key tiles and C = 64 ([64, 64] transposed
# tiles); K = 64 is one key block, K = 100 two (the second masked).
CASES_640 = {
    "K64_C64": ([70, 64], 1, 64, 16, 64, True, True, 0.3, [(0, 64), (1, 64), (0, 70)]),
    "K100_C64": ([65, 20], 1, 100, 16, 64, False, True, 0.3, [(0, 64), (1, 20)]),
}


@pytest.mark.parametrize("trans_free", [False, True], ids=["plain", "transpose_free"])
@pytest.mark.parametrize("case", list(CASES_640.values()), ids=list(CASES_640))
def test_triton_bk64_shapes_match_ref_fp32(case, trans_free, monkeypatch):
    """At the shapes of the Hopper miscompile, both forms of the backward's transposed products
    match the reference (the transpose-free one reads back a NaN-poisoned scratch tile it wrote)."""
    lens, H, K, V, C, init, l2, decay, exports = case
    monkeypatch.setattr(triton_640, "check", lambda device: trans_free)
    shapes = []
    empty = chunk_triton._empty
    monkeypatch.setattr(chunk_triton, "_empty", lambda shape, dtype, device: shapes.append(shape) or empty(shape, dtype, device))
    x, cu = make_inputs(lens, H, K, V, seed=21, init=init, decay=decay)
    got = outputs_and_grads("triton", x, cu, exports, C, seed=22, use_qk_l2norm=l2)
    want = outputs_and_grads("ref", x, cu, exports, C, seed=22, use_qk_l2norm=l2)
    assert_close_rel(got, want, 2e-6)
    M, NK = sum(-(-n // C) for n in lens), -(-K // 64)
    assert ((M * NK * H * C * C,) in shapes) is trans_free


def test_triton_is_deterministic_under_torch_deterministic_mode():
    """`torch.use_deterministic_algorithms(True)`, warnings as errors: forward and backward run
    (duplicate exports: their gradients add in request order, no index_add_) and a second run gives
    the same bits."""
    lens, H, K, V, C, init, l2, decay, exports = CASES["n3_C16_K8_V40_init_dup"]
    x, cu = make_inputs(lens, H, K, V, seed=31, init=init, decay=decay)
    with deterministic():
        runs = [outputs_and_grads("triton", x, cu, exports, C, seed=32, use_qk_l2norm=l2) for _ in range(2)]
    for name, a, b in zip(NAMES, *runs):
        assert torch.equal(a, b), name


def test_triton_split_at_exported_state_equals_one_call():
    """A sequence run as two calls, the second starting from the state the first exports, gives the
    one-call outputs and gradients: the export gradient is injected at its chunk and comes back out
    through the initial state (docs/design/numerics.md)."""
    L, cut, C = 53, 32, 16
    x, cu = make_inputs([L], 2, 16, 16, seed=3)
    leaves = {n: t.detach().requires_grad_(True) for n, t in x.items()}
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(L, 2, 16, generator=gen).to(DEVICE)
    whole, _ = run("triton", leaves, cu, [], C, use_qk_l2norm=True)
    g_whole = torch.autograd.grad(whole, list(leaves.values()), do)

    head = {n: t[:cut] if n != "h0" else t for n, t in leaves.items()}
    o1, (s1,) = run("triton", head, torch.tensor([0, cut]), [(0, cut)], C, use_qk_l2norm=True)
    tail = {n: t[cut:] if n != "h0" else s1[None] for n, t in leaves.items()}
    o2, _ = run("triton", tail, torch.tensor([0, L - cut]), [], C, use_qk_l2norm=True)
    split = torch.cat([o1, o2])
    g_split = torch.autograd.grad(split, list(leaves.values()), do)
    assert_close_rel((split, *g_split), (whole, *g_whole), 2e-5, names=("o", "dq", "dk", "dv", "dg", "dbeta", "dh0"))


def test_triton_packing_is_bitwise_invariant():
    """A sequence's outputs and states do not depend on what else is packed in the call."""
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


def test_triton_uses_the_prepared_layout():
    """One `prepare_layout` indexes both backends; the indices may then be omitted."""
    x, cu = make_inputs([21, 16], 1, 16, 16, seed=9)
    es, ep = exports_of([(1, 16), (0, 16)])
    layout = prepare_layout(cu, es, ep, 16, device=DEVICE)
    a = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], chunk_size=16,
                               layout=layout, backend="triton")
    b = run("triton", x, cu, [(1, 16), (0, 16)], 16)
    r = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], chunk_size=16,
                               layout=layout, backend="ref")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert_close_rel(a, r, 2e-5, names=("o", "states"))


def test_triton_layout_prepared_on_another_spelling_of_the_device_is_not_copied():
    """A layout prepared on "cuda" serves tensors on "cuda:0" as it is (no per-call copy of its
    index tensors; the device mismatch of the first GPU run)."""
    x, cu = make_inputs([21, 16], 1, 16, 16, seed=9)
    es, ep = exports_of([(1, 16)])
    layout = prepare_layout(cu, es, ep, 16, device="cuda" if DEVICE == "cuda" else "cpu:0")
    assert layout.to(x["q"].device) is layout
    a = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], chunk_size=16,
                               layout=layout, backend="triton")
    b = run("triton", x, cu, [(1, 16)], 16)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(C=8), "chunk_size"),
        (dict(C=48), "chunk_size"),
        (dict(dtype=torch.float64), "fp32/bf16/fp16"),
        (dict(v_dtype=torch.float16), "one dtype"),
    ],
    ids=["C8", "C48", "float64", "mixed_dtypes"],
)
def test_triton_rejects_unsupported_inputs(change, match):
    x, cu = make_inputs([8], 1, 16, 16, seed=5, dtype=change.get("dtype", torch.float32))
    if "v_dtype" in change:
        x["v"] = x["v"].to(change["v_dtype"])
    with pytest.raises(ValueError, match=match):
        run("triton", x, cu, [], change.get("C", 16))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 is only meaningful on a GPU (the interpreter's bf16 is wrong)")
def test_triton_bf16_matches_fp32_ref():
    """bf16 Triton at production tiles (K = V = 128, C = 64) against the fp32 reference on the same
    (bf16-rounded) inputs: outputs, states and every gradient within 1.5e-2 relative RMS error
    (bf16 products and the bf16 Ai, w, u, h, vnew, dh that fla's algorithm keeps)."""
    x, cu = make_inputs([300, 64, 129, 1000], 4, 128, 128, seed=6, dtype=torch.bfloat16)
    exports = [(0, 256), (2, 129), (3, 512), (3, 1000), (1, 64)]
    got = outputs_and_grads("triton", x, cu, exports, 64, seed=7, use_qk_l2norm=True)
    ref_x = {n: None if t is None else t.float() for n, t in x.items()}
    want = outputs_and_grads("ref", ref_x, cu, exports, 64, seed=7, use_qk_l2norm=True)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    for name, a, b in zip(NAMES, got, want):
        assert not a.isnan().any(), name
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert err <= 1.5e-2, f"{name}: relative RMS error {err:.3g}"
