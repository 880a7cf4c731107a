"""The MoE block (`trainer.models.moe`): expert-sorted dispatch, the experts and the fixed-order combine
against the per-expert reference, on seeded random routings (values and gradients)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.models.moe import Experts, combine, dispatch_rows, gather_rows, route
from trainer.models.ops import EXACT, FAST

E, D, I, K = 8, 64, 32, 2


def _experts(gen: torch.Generator, dtype=torch.float32) -> Experts:
    ex = Experts(E, D, I)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(E, 2 * I, D, generator=gen) * 0.1)
        ex.down_proj.copy_(torch.randn(E, D, I, generator=gen) * 0.1)
    return ex.to(dtype)


def _routing(gen: torch.Generator, R: int, skew: bool):
    probs = torch.rand(R, E, generator=gen)
    if skew:
        probs[:, : E // 2] += 1.0  # some experts unused
    w, idx = torch.topk(probs, K, dim=-1)
    idx, perm = idx.sort(-1)
    return w.gather(-1, perm), idx


def _moe(ex: Experts, x, w, idx, ops, align: int):
    d = route(idx, E, align=align)
    return combine(ex(dispatch_rows(x, d), d, ops), w, d, chained=True)


@pytest.mark.parametrize("align", [1, 8], ids=["unpadded", "groups-of-8"])
@pytest.mark.parametrize("seed", range(4))
def test_sorted_dispatch_bitwise_equals_per_expert_reference(seed, align):
    gen = torch.Generator().manual_seed(seed)
    ex = _experts(gen)
    R = int(torch.randint(1, 200, (1,), generator=gen))
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    w, idx = _routing(gen, R, skew=bool(seed % 2))
    w = w.requires_grad_()
    ops = dataclasses.replace(EXACT, group_align=align)
    got, want = _moe(ex, x, w, idx, ops, align), ex.forward_ref(x, idx, w, EXACT)
    assert torch.equal(got, want)
    g = torch.randn(got.shape, generator=gen)
    params = (x, w, ex.gate_up_proj, ex.down_proj)
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("align", [1, 8])
def test_route_slots_groups_and_inverse_maps(align):
    gen = torch.Generator().manual_seed(7)
    R = 37
    _, idx = _routing(gen, R, skew=True)
    d = route(idx, E, align=align)
    A, S = R * K, d.num_slots
    assert S >= A and (S - A) < E * align + align and d.padded == (S > A)
    starts, ends, counts = d.group_start.tolist(), d.group_end.tolist(), d.counts.tolist()
    assert counts == torch.bincount(idx.reshape(-1), minlength=E).tolist()
    for e in range(E):
        assert starts[e] % align == 0 and ends[e] - starts[e] == -(-counts[e] // align) * align
        rows = d.slot_row[starts[e] : starts[e] + counts[e]]
        assert rows.tolist() == sorted(rows.tolist())  # stable: rows ascending within an expert
        assert all(e in idx[r].tolist() for r in rows.tolist())
        assert (d.slot_row[starts[e] + counts[e] : ends[e]] == R).all()  # padding reads the zero row
    for r in range(R):  # row_slots and slot_assign invert each other
        for j in range(K):
            s = int(d.row_slots[r, j])
            assert int(d.slot_row[s]) == r and int(d.slot_assign[s]) == r * K + j


def test_gather_rows_backward_is_the_transpose():
    gen = torch.Generator().manual_seed(3)
    R = 23
    _, idx = _routing(gen, R, skew=False)
    d = route(idx, E, align=8)
    x = torch.randn(R, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gather_rows(t, d.slot_row, d.row_slots, src_pads=True), (x,))
    y = torch.randn(d.num_slots, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda t: gather_rows(t, d.row_slots.reshape(-1), d.slot_assign[:, None], inv_pads=True), (y,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_gemm_path_matches_the_loop(dtype):
    """The GPU's grouped-GEMM experts (here torch's CPU implementation) against the per-expert loop."""
    gen = torch.Generator().manual_seed(9)
    ex = _experts(gen, dtype)
    R = 150
    x = torch.randn(R, D, generator=gen).to(dtype).requires_grad_()
    w, idx = _routing(gen, R, skew=True)
    w = w.to(dtype)
    loop = dataclasses.replace(FAST, experts="loop")
    got, want = _moe(ex, x, w, idx, FAST, FAST.group_align), _moe(ex, x, w, idx, loop, FAST.group_align)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    g = torch.randn(got.shape, generator=gen).to(dtype)
    params = (x, ex.gate_up_proj, ex.down_proj)
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params)):
        torch.testing.assert_close(a.float(), b.float(), **({"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else tol))


def test_moe_runs_under_deterministic_algorithms():
    gen = torch.Generator().manual_seed(11)
    ex = _experts(gen)
    x = torch.randn(50, D, generator=gen, requires_grad=True)
    w, idx = _routing(gen, 50, skew=False)
    torch.use_deterministic_algorithms(True)
    try:
        out = _moe(ex, x, w, idx, EXACT, 8)
        out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_gemm_matches_the_loop_on_cuda():
    gen = torch.Generator().manual_seed(5)
    ex = _experts(gen, torch.bfloat16).cuda()
    R = 1000
    x = torch.randn(R, D, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
    w, idx = _routing(gen, R, skew=True)
    w, idx = w.to(torch.bfloat16).cuda(), idx.cuda()
    got = _moe(ex, x, w, idx, FAST, FAST.group_align)
    want = _moe(ex, x, w, idx, dataclasses.replace(FAST, experts="loop"), FAST.group_align)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    g = torch.randn(got.shape, generator=gen).to(torch.bfloat16).cuda()
    params = (x, ex.gate_up_proj, ex.down_proj)
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((want * g).sum(), params)):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)
    # the same bits twice (deterministic)
    torch.use_deterministic_algorithms(True)
    try:
        again = _moe(ex, x, w, idx, FAST, FAST.group_align)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(again, got)
