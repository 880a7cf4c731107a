"""Tests of the Triton backend of kernels.tree_attention against the PyTorch reference.

Runs on CUDA, or on CPU under the Triton interpreter: `TRITON_INTERPRET=1 pytest
tests/kernels/test_tree_attention_triton.py` (tests/kernels/test_tree_attention.py starts exactly that in a
subprocess, since the variable must be set before triton is imported). Otherwise skipped.
"""
from __future__ import annotations

import os

import pytest
import torch

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1 (see module docstring)", allow_module_level=True)

from kernels.tree_attention import BACKENDS, tree_attention  # noqa: E402
from kernels.tree_attention import triton_kernel  # noqa: E402
from kernels.tree_attention import prepare_tree_layout  # noqa: E402
from tests.determinism import deterministic  # noqa: E402
from tests.tree_attention_helpers import random_qkv, random_tree  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output buffer (o, lse, dq, dk, dv) starts as NaN: a missed store shows up in the comparisons."""
    monkeypatch.setattr(
        triton_kernel, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )


def run_backends(tree, H, Hkv, D, backends, *, seed, dtype=torch.float32, **blocks):
    """Per backend: (o, dq, dk, dv) on the same inputs and cotangent, through one prepared layout."""
    q, k, v = random_qkv(tree, H, Hkv, D, seed=seed, dtype=dtype, device=DEVICE)
    do = torch.randn(tree.R, H, D, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    layout = tree.prepare(DEVICE, **blocks)
    out = {}
    for backend in backends:
        o = tree_attention(q, k, v, layout, scale=D**-0.5, backend=backend)
        out[backend] = (o, *torch.autograd.grad(o, [q, k, v], do))
    return out


# (tree kwargs, H, Hkv, D, block_m, block_n); the interpreter's cost is programs x tiles: keep small.
# Imported rows (extended rows R..R+I-1, appended after the local ones) appear in most cases.
CASES = {
    "single_segment_multiblock": (dict(num_segments=1, min_len=45, max_len=45), 2, 2, 16, 16, 16),
    "deep_chain_gqa_2_1": (dict(num_segments=6, min_len=3, max_len=12, kind="chain"), 2, 1, 16, 16, 16),
    "wide_imported_bm16_bn32": (dict(num_segments=6, min_len=4, max_len=16, kind="wide", num_imported=2), 2, 1, 16, 16, 32),
    "imported_short_segments_gqa_4_2": (dict(num_segments=6, max_len=10, num_imported=3), 4, 2, 16, 16, 16),
    "imported_unmerged_d24": (dict(num_segments=5, max_len=14, num_imported=2, merge_adjacent=False), 2, 2, 24, 16, 16),
    "default_blocks_64_d64": (dict(num_segments=3, min_len=10, max_len=80, num_imported=1), 2, 1, 64, 64, 64),
}
# (Production tiles, D = 128, run in bf16 on CUDA below.)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_every_backend_matches_ref_fp32(case):
    """Every backend of the contract against the reference: outputs and q/k/v gradients (imported
    rows' gradients included), every output buffer poisoned with NaN first."""
    kwargs, H, Hkv, D, bm, bn = case
    tree = random_tree(7, **kwargs)
    out = run_backends(tree, H, Hkv, D, list(BACKENDS), seed=8, block_m=bm, block_n=bn)
    want = out.pop("ref")
    assert set(out) >= {"triton"}
    for backend, got in out.items():
        assert got[0].dtype == torch.float32 and got[0].shape == (tree.R, H, D)
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
            assert not a.isnan().any(), (backend, name)
            assert b.abs().max() > 0, name
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name, be=backend: f"{be} {n}: {m}")


def test_every_backend_is_deterministic_under_torch_deterministic_mode():
    """`torch.use_deterministic_algorithms(True)`, warnings as errors: forward and backward of every
    backend run (GQA: the group sum in head order), and a second run gives the same bits."""
    tree = random_tree(21, num_segments=5, max_len=12, num_imported=2)
    with deterministic():
        runs = [run_backends(tree, 4, 2, 16, list(BACKENDS), seed=22, block_m=16, block_n=16) for _ in range(2)]
    for backend in BACKENDS:
        for name, a, b in zip(("o", "dq", "dk", "dv"), runs[0][backend], runs[1][backend]):
            assert torch.equal(a, b), (backend, name)


def _path_layout(L: int, **blocks):
    return prepare_tree_layout(torch.tensor([0]), torch.tensor([L]), torch.tensor([0, 0]),
                               torch.zeros(0, 2, dtype=torch.long), num_rows=L, device=DEVICE, batch_invariant=True,
                               **blocks)


@pytest.mark.parametrize("case", [CASES[n] for n in ("deep_chain_gqa_2_1", "wide_imported_bm16_bn32", "imported_unmerged_d24")],
                         ids=["deep_chain_gqa_2_1", "wide_imported_bm16_bn32", "imported_unmerged_d24"])
def test_triton_on_a_batch_invariant_layout_matches_ref_fp32(case):
    """The depth-tiled forward and dq (`prepare_tree_layout(..., batch_invariant=True)`): outputs and
    gradients against the reference, buffers poisoned with NaN."""
    kwargs, H, Hkv, D, bm, bn = case
    tree = random_tree(7, **kwargs)
    q, k, v = random_qkv(tree, H, Hkv, D, seed=8, dtype=torch.float32, device=DEVICE)
    do = torch.randn(tree.R, H, D, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    got, want = [], []
    for layout, backend, out in ((tree.prepare(DEVICE, block_m=bm, block_n=bn, batch_invariant=True), "triton", got),
                                 (tree.prepare(DEVICE), "ref", want)):
        o = tree_attention(q, k, v, layout, scale=D**-0.5, backend=backend)
        out += [o, *torch.autograd.grad(o, [q, k, v], do)]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def assert_tree_rows_equal_paths_alone(tree, H, Hkv, D, *, seed, dtype, **blocks):
    """Every segment's rows: the tree's o and dq are bitwise those of the same rows at the end of the
    segment's path run alone (the expanded sequence: ancestors, then the segment), both layouts
    prepared with batch_invariant=True."""
    q, k, v = (x.detach() for x in random_qkv(tree, H, Hkv, D, seed=seed, dtype=dtype, device=DEVICE))
    q.requires_grad_(True)
    o = tree_attention(q, k, v, tree.prepare(DEVICE, batch_invariant=True, **blocks), scale=D**-0.5, backend="triton")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    (dq,) = torch.autograd.grad(o, q, do)
    off = tree.attn_offsets.tolist()
    for s, (a, L) in enumerate(zip(tree.seg_start.tolist(), tree.seg_len.tolist())):
        anc = [torch.arange(x, y) for x, y in tree.attn_ranges[off[s] : off[s + 1]].tolist()]
        path = torch.cat(anc + [torch.arange(a, a + L)]).to(DEVICE)
        n = path.shape[0] - L
        q_path = torch.cat([q.new_zeros(n, H, D), q.detach()[a : a + L]]).requires_grad_(True)
        alone = tree_attention(q_path, k[path], v[path], _path_layout(path.shape[0], **blocks), scale=D**-0.5,
                               backend="triton")
        (dq_alone,) = torch.autograd.grad(alone, q_path, torch.cat([do.new_zeros(n, H, D), do[a : a + L]]))
        assert torch.equal(alone[n:], o[a : a + L]), f"segment {s}: o"
        assert torch.equal(dq_alone[n:], dq[a : a + L]), f"segment {s}: dq"


@pytest.mark.parametrize("seed", range(3))
def test_batch_invariant_tree_rows_bitwise_equal_their_paths_alone_fp32(seed):
    """Key tiles at fixed depths: however a row's ancestors are split into ranges (and whatever the
    rows beside it), its o and dq are the bits of its expanded run (the default layout tiles each
    range from its start and misses this)."""
    tree = random_tree(30 + seed, num_segments=6, min_len=3, max_len=40, num_imported=2)
    assert_tree_rows_equal_paths_alone(tree, 4, 2, 16, seed=seed, dtype=torch.float32, block_m=16, block_n=16)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 is only meaningful on a GPU (the interpreter's bf16 is wrong)")
def test_batch_invariant_tree_rows_bitwise_equal_their_paths_alone_bf16():
    """The moonshot's attention part in bf16 at production tiles (BM = BN = 64, D = 128, GQA 8:2)."""
    tree = random_tree(33, num_segments=24, min_len=1, max_len=300, num_imported=3)
    assert_tree_rows_equal_paths_alone(tree, 8, 2, 128, seed=34, dtype=torch.bfloat16)


def test_triton_kv_rows_seen_by_nobody_get_zero_gradients():
    """Imported rows outside every range and trailing rows: written as zeros, not left unset."""
    tree = random_tree(9, num_segments=3, max_len=10, num_imported=2)
    q, k, v = random_qkv(tree, 2, 2, 16, seed=10, dtype=torch.float32, device=DEVICE)
    pad = torch.randn(17, 2, 16, device=DEVICE)
    k2 = torch.cat([k.detach(), pad]).requires_grad_(True)
    v2 = torch.cat([v.detach(), pad]).requires_grad_(True)
    layout = prepare_tree_layout(**tree.layout(), num_rows=tree.R, num_kv_rows=tree.Rk + 17, device=DEVICE,
                                 block_m=16, block_n=16)
    o = tree_attention(q, k2, v2, layout, scale=0.25, backend="triton")
    dk, dv = torch.autograd.grad(o.sum(), [k2, v2])
    assert torch.equal(dk[tree.Rk :], torch.zeros_like(dk[tree.Rk :]))
    assert torch.equal(dv[tree.Rk :], torch.zeros_like(dv[tree.Rk :]))
    assert dv[: tree.Rk].abs().max() > 0


def test_triton_rejects_float64_and_a_layout_elsewhere():
    tree = random_tree(11, num_segments=2, max_len=4)
    q, k, v = random_qkv(tree, 1, 1, 16, seed=12, dtype=torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        tree_attention(q.double(), k.double(), v.double(), tree.prepare(DEVICE), scale=1.0, backend="triton")
    with pytest.raises(ValueError, match="block_m"):
        tree.prepare(DEVICE, block_m=8)
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="device"):
            tree_attention(q, k, v, tree.prepare("cpu"), scale=1.0, backend="triton")


def test_triton_accepts_a_layout_prepared_on_another_spelling_of_qs_device():
    """The first GPU run's failure: a layout prepared on "cuda" was refused for q on "cuda:0"
    (`torch.device("cuda") != torch.device("cuda:0")`); devices are compared resolved."""
    tree = random_tree(16, num_segments=3, max_len=9, num_imported=1)
    q, k, v = random_qkv(tree, 2, 1, 16, seed=17, dtype=torch.float32, device=DEVICE)
    spelling = "cuda" if DEVICE == "cuda" else "cpu:0"
    o = tree_attention(q, k, v, tree.prepare(spelling, block_m=16, block_n=16), scale=0.25, backend="triton")
    want = tree_attention(q, k, v, tree.prepare(DEVICE, block_m=16, block_n=16), scale=0.25, backend="triton")
    assert torch.equal(o, want)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 is only meaningful on a GPU (the interpreter's bf16 is wrong)")
def test_triton_bf16_matches_fp32_ref():
    """bf16 Triton against the fp32 reference on the same (bf16-rounded) inputs, errors relative to the scale."""
    tree = random_tree(13, num_segments=40, min_len=1, max_len=200, num_imported=3)
    q, k, v = random_qkv(tree, 8, 2, 128, seed=14, dtype=torch.bfloat16, device=DEVICE)
    do = torch.randn(tree.R, 8, 128, generator=torch.Generator().manual_seed(15)).to(DEVICE, torch.bfloat16)
    layout = tree.prepare(DEVICE)
    o = tree_attention(q, k, v, layout, scale=128**-0.5, backend="triton")
    got = (o, *torch.autograd.grad(o, [q, k, v], do))
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    o_r = tree_attention(*leaves, layout, scale=128**-0.5, backend="ref")
    want = (o_r, *torch.autograd.grad(o_r, leaves, do.float()))
    assert got[0].dtype == torch.bfloat16
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert not a.isnan().any(), name
        err = (a.float() - b).abs().max() / b.abs().max()
        assert err < 2e-2, (name, err.item())
