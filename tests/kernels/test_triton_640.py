"""`kernels.triton_640`: the fla #640 guard's policy on faked devices and Triton versions, and (compiled
for sm_90 without a GPU, `tests/triton_aot.py`) where our kernels transpose a dot result.

The numerical checks at the miscompile's shapes are tests/kernels/test_gated_delta_rule_triton.py
(interpreter, fp32) and tests/kernels/test_gated_delta_rule_triton_640.py (GPU, bf16 and fp32).
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from kernels import triton_640

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU target and fakes devices: run without TRITON_INTERPRET", allow_module_level=True)

HOPPER = torch.device("cuda", 0)


@pytest.fixture
def fake(monkeypatch):
    """fake(version, capability): the Triton version and the device's compute capability."""
    triton_640._check.cache_clear()
    monkeypatch.delenv("HARTS_TRITON_640", raising=False)
    monkeypatch.delenv("HARTS_ALLOW_TRITON_640", raising=False)

    def set_(version, capability=(9, 0)):
        monkeypatch.setattr(triton_640, "triton_version", lambda: version)
        monkeypatch.setattr(triton_640, "_capability", lambda index: capability)

    yield set_
    triton_640._check.cache_clear()


@pytest.mark.parametrize(
    "version, capability, hit",
    [
        ((3, 6, 0), (9, 0), True),
        ((3, 4, 0), (9, 0), True),
        ((3, 7, 0), (9, 0), True),
        ((3, 7, 1), (9, 0), False),
        ((3, 3, 1), (9, 0), False),
        ((3, 6, 0), (8, 0), False),
        ((3, 6, 0), (10, 0), False),
    ],
)
def test_affected_is_hopper_with_triton_3_4_0_to_3_7_0(fake, version, capability, hit):
    fake(version, capability)
    assert triton_640.affected(HOPPER) is hit
    assert triton_640.affected(torch.device("cpu")) is False


def test_policies_on_an_affected_device(fake, monkeypatch):
    fake((3, 6, 0))
    assert triton_640.ON_AFFECTED == "plain"
    assert triton_640.check(HOPPER) is False
    monkeypatch.setenv("HARTS_TRITON_640", "transpose_free")
    assert triton_640.check(HOPPER) is True
    monkeypatch.setenv("HARTS_TRITON_640", "refuse")
    with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0 .*#640.*>= 3\.4\.0 and < 3\.7\.1"):
        triton_640.check(HOPPER)
    monkeypatch.setenv("HARTS_ALLOW_TRITON_640", "1")
    with pytest.warns(RuntimeWarning, match="HARTS_ALLOW_TRITON_640=1"):
        assert triton_640.check(HOPPER) is False
    monkeypatch.setenv("HARTS_TRITON_640", "sometimes")
    with pytest.raises(ValueError, match="HARTS_TRITON_640"):
        triton_640.check(HOPPER)


def test_unaffected_devices_run_the_plain_forms_under_any_policy(fake, monkeypatch):
    fake((3, 7, 1))
    for policy in triton_640.POLICIES:
        monkeypatch.setenv("HARTS_TRITON_640", policy)
        assert triton_640.check(HOPPER) is False
        assert triton_640.check(torch.device("cpu")) is False


def test_triton_version_parses_local_suffixes(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", "3.6.0+git1234abcd")
    assert triton_640.triton_version() == (3, 6, 0)
    monkeypatch.setattr(triton, "__version__", "3.7")
    assert triton_640.triton_version() == (3, 7, 0)


def _gdn_and_tree_launches(monkeypatch, K: int, trans_free: bool) -> dict:
    """Every Triton launch of a bf16 GDN forward + backward (K = V, C = 64) and a tree-attention
    forward + backward in both modes (head dim K), recorded on the CPU:
    {(kernel name, INVARIANT flag or None): (kernel, kwargs)}."""
    from kernels.gated_delta_rule import chunk_triton, l2norm_triton
    from kernels.tree_attention import triton_kernel
    from tests.triton_aot import record

    monkeypatch.setattr(triton_640, "check", lambda device: trans_free)
    with monkeypatch.context() as patch:
        launches = record(patch, chunk_triton, l2norm_triton, triton_kernel)
        _run_gdn_and_tree(K)
    return {(name, kwargs.get("INVARIANT")): (kernel, kwargs) for name, kernel, kwargs in launches}


def _run_gdn_and_tree(K: int) -> None:
    from kernels.gated_delta_rule import chunk_gated_delta_rule
    from kernels.tree_attention import prepare_tree_layout, tree_attention

    T, H = 130, 2
    x = [torch.randn(T, H, K, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    gb = [torch.zeros(T, H, requires_grad=True) for _ in range(2)]
    o, s = chunk_gated_delta_rule(*x, *gb, cu_seqlens=torch.tensor([0, 100, T]), export_seq=torch.tensor([0]),
                                  export_pos=torch.tensor([64]), chunk_size=64, use_qk_l2norm=True, backend="triton")
    torch.autograd.grad([o, s], [*x, *gb], [torch.zeros_like(o), torch.zeros_like(s)])
    layout = prepare_tree_layout(torch.tensor([0, 100]), torch.tensor([100, 50]), torch.tensor([0, 0, 1]),
                                 torch.tensor([[0, 60]]), num_rows=150)
    q = torch.randn(150, 4, K, dtype=torch.bfloat16, requires_grad=True)
    kv = [torch.randn(150, 2, K, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    for lay in (layout, replace(layout, batch_invariant=True)):
        o = tree_attention(q, *kv, lay, scale=K**-0.5, backend="triton")
        torch.autograd.grad(o, [q, *kv], torch.zeros_like(o))


@pytest.mark.slow
def test_only_the_two_known_sites_transpose_a_dot_result_and_their_transpose_free_forms_do_not(monkeypatch):
    """Compiled for sm_90 in bf16 at K = 64 (BK = 64): the TTGIR `tt.trans` of an MMA-layout tensor
    (the operand fla #640's miscompile needs) appears in `_dqkwg_kernel` and `_wy_bwd_kernel`
    only, and nowhere once they run their transpose-free forms."""
    from tests.triton_aot import compile_launch, mma_transposes

    plain = _gdn_and_tree_launches(monkeypatch, 64, trans_free=False)
    found = {key: mma_transposes(compile_launch(k, kw).asm["ttgir"]) for key, (k, kw) in plain.items()}
    assert {name for (name, _), lines in found.items() if lines} == {"_dqkwg_kernel", "_wy_bwd_kernel"}, found
    assert len(found) >= 17, sorted(found)  # the tree-attention forward and dq in both modes
    free = _gdn_and_tree_launches(monkeypatch, 64, trans_free=True)
    for name in ("_dqkwg_kernel", "_wy_bwd_kernel"):
        kernel, kwargs = free[(name, None)]
        assert kwargs["TRANS_FREE"] is True
        assert mma_transposes(compile_launch(kernel, kwargs).asm["ttgir"]) == [], name
