"""The "blocked" tree-attention backend (`kernels.tree_attention.blocked`) against the reference.

Random trees (tests/tree_attention_helpers: branches inside and at the end of segments, imported
rows after the local ones), fp32 and float64: outputs and gradients match the reference within
rounding; a row's output is bitwise the same inside a tree as at the same depth of its path alone
(the batch invariance the executor's Invariant E rests on); the tensors saved for backward do not
grow with the number of (query, key) pairs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.tree_attention import blocked as TA
from kernels.tree_attention import prepare_tree_layout, tree_attention
from tests.tree_attention_helpers import random_qkv, random_tree


@pytest.fixture
def small_blocks(monkeypatch):
    """Small query and key blocks, so that several of each are exercised on small trees."""
    monkeypatch.setattr(TA, "BLOCK_Q", 16)
    monkeypatch.setattr(TA, "BLOCK_K", 32)


def _path_layout(L: int):
    return prepare_tree_layout(torch.tensor([0]), torch.tensor([L]), torch.tensor([0, 0]), torch.zeros(0, 2, dtype=torch.long), num_rows=L)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_matches_reference_outputs_and_gradients(seed, dtype, small_blocks):
    tree = random_tree(seed, num_segments=8 + seed, max_len=60, num_imported=seed * 7)
    H, Hkv = (4, 2) if seed % 2 else (2, 2)
    q, k, v = random_qkv(tree, H, Hkv, 16, seed=seed, dtype=dtype)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    layout = tree.prepare()
    got = tree_attention(*leaves, layout, scale=0.25, backend="blocked")
    want = tree_attention(*leaves, layout, scale=0.25, backend="ref")
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, **tol)
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        torch.testing.assert_close(a, b, **(dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else tol))


def test_gradcheck_float64(small_blocks):
    tree = random_tree(3, num_segments=4, max_len=12, num_imported=5)
    q, k, v = (x.detach().requires_grad_() for x in random_qkv(tree, 2, 1, 4, seed=0, dtype=torch.float64))
    layout = tree.prepare()
    assert torch.autograd.gradcheck(lambda q, k, v: tree_attention(q, k, v, layout, scale=0.5, backend="blocked"), (q, k, v))


@pytest.mark.parametrize("seed", range(4))
def test_tree_rows_bitwise_equal_their_paths_alone(seed):
    """Every row gets the same bits in the tree as at the same depth of its own path alone (the
    expanded run), across query and key blocks of different extents (default block sizes)."""
    tree = random_tree(10 + seed, num_segments=10, min_len=20, max_len=300, num_imported=40 * seed)
    q, k, v = (x.detach() for x in random_qkv(tree, 4, 2, 16, seed=seed, dtype=torch.float32))
    out = tree_attention(q, k, v, tree.prepare(), scale=0.25, backend="blocked")
    off = tree.attn_offsets.tolist()
    for s, (a, L) in enumerate(zip(tree.seg_start.tolist(), tree.seg_len.tolist())):
        anc = [torch.arange(x, y) for x, y in tree.attn_ranges[off[s] : off[s + 1]].tolist()]
        path = torch.cat(anc + [torch.arange(a, a + L)])  # the segment's rows at their depths
        n_anc = path.shape[0] - L
        q_path = torch.cat([torch.zeros(n_anc, *q.shape[1:]), q[a : a + L]])
        alone = tree_attention(q_path, k[path], v[path], _path_layout(path.shape[0]), scale=0.25, backend="blocked")
        assert torch.equal(alone[n_anc:], out[a : a + L])


def test_saved_memory_is_linear_in_rows():
    """What autograd keeps for backward: inputs, output and log-sum-exp, not scores ([R, depth])."""
    L = 3000
    q = torch.randn(L, 8, 32, requires_grad=True)
    k = torch.randn(L, 2, 32, requires_grad=True)
    v = torch.randn(L, 2, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        tree_attention(q, k, v, _path_layout(L), scale=0.2, backend="blocked").sum().backward()
    per_row = sum(saved) / L
    assert per_row <= (8 + 2 + 2 + 8) * 32 * 4 + 8 * 4, per_row  # q, k, v, o, lse: no [L, L] scores


def test_plan_is_built_once_per_layout():
    layout = _path_layout(40)
    q, k, v = (torch.randn(40, h, 8) for h in (2, 1, 1))
    tree_attention(q, k, v, layout, scale=0.3, backend="blocked")
    plan = layout.plans["blocked"]
    tree_attention(q, k, v, layout, scale=0.3, backend="blocked")
    assert layout.plans["blocked"] is plan and all(b.n_keys % TA.BLOCK_K == 0 for s in plan.segments for b in s.blocks)
