"""The exact CPU tree attention (`trainer.tree_attention`) against the plain reference.

Random trees of segments (each segment's keys: a prefix of an earlier segment's path, then its own
rows), key tables with imported rows appended, fp32 and float64: outputs and gradients match
`tree_ops.ancestor_attention_segments` within rounding; a row's output is bitwise the same inside a
tree and alone on its path (the batch invariance the executor's Invariant E rests on); the tensors
saved for backward do not grow with the number of (query, key) pairs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import tree_attention as TA
from trainer import tree_ops as T
from trainer.layout import layout_from_sequences


def _random_segments(rng: np.random.Generator, n: int, max_len: int, n_imported: int = 0):
    """Segments tiling rows 0..R in order; keys index a table of R local rows then n_imported rows
    (an imported chain that some roots hang below)."""
    imported = np.arange(n_imported)  # positions R + i, resolved once R is known
    segs, paths, R = [], [], 0
    for _ in range(n):
        anc = np.zeros(0, np.int64)
        if paths and rng.random() < 0.8:
            anc = paths[int(rng.integers(len(paths)))]
            anc = anc[: int(rng.integers(0, len(anc) + 1))]
        elif n_imported and rng.random() < 0.7:
            anc = -1 - imported[: int(rng.integers(1, n_imported + 1))]  # placeholders for imported rows
        L = int(rng.integers(1, max_len))
        paths.append(np.concatenate([anc, np.arange(R, R + L)]))
        segs.append((R, L))
        R += L
    kv = [np.where(p < 0, R + (-1 - p), p) for p in paths]
    return [T.AttnSegment(q_start=a, q_len=L, kv_idx=torch.from_numpy(x)) for (a, L), x in zip(segs, kv)], R


def _plan(segs, R, N):
    return TA.attention_plan([s.q_start for s in segs], [s.q_len for s in segs], [s.kv_idx.numpy() for s in segs], R, N)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_matches_reference_outputs_and_gradients(seed, dtype, monkeypatch):
    # small blocks so that several query and key blocks are exercised
    monkeypatch.setattr(TA, "BLOCK_Q", 16)
    monkeypatch.setattr(TA, "BLOCK_K", 32)
    rng = np.random.default_rng(seed)
    n_imp = int(rng.integers(0, 40))
    segs, R = _random_segments(rng, int(rng.integers(1, 14)), 90, n_imp)
    N = R + n_imp
    gen = torch.Generator().manual_seed(seed)
    H, Hkv = (4, 2) if seed % 2 else (2, 2)
    q = torch.randn(R, H, 16, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(N, Hkv, 16, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(N, Hkv, 16, generator=gen, dtype=dtype, requires_grad=True)
    got = TA.tree_attention(q, k, v, _plan(segs, R, N), scale=0.25)
    want = T.ancestor_attention_segments(q, k, v, segs, scale=0.25)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, want, **tol)
    w = torch.randn(got.shape, generator=gen, dtype=dtype)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **(dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else tol))


def test_gradcheck_float64(monkeypatch):
    monkeypatch.setattr(TA, "BLOCK_K", 16)
    segs, R = _random_segments(np.random.default_rng(3), 4, 12, 5)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(R, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(R + 5, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(R + 5, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    plan = _plan(segs, R, R + 5)
    assert torch.autograd.gradcheck(lambda q, k, v: TA.tree_attention(q, k, v, plan, scale=0.5), (q, k, v))


@pytest.mark.parametrize("seed", range(4))
def test_tree_rows_bitwise_equal_their_paths_alone(seed):
    """Every row gets the same bits in the tree as at the same depth of its own path alone (the
    expanded run), across query and key blocks of different extents."""
    rng = np.random.default_rng(10 + seed)
    segs, R = _random_segments(rng, 10, 300)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(R, h, 16, generator=gen) for h in (4, 2, 2))
    tree = TA.tree_attention(q, k, v, _plan(segs, R, R), scale=0.25)
    for s in segs:
        path = s.kv_idx  # the segment's rows at their depths: ancestors then itself
        alone = TA.tree_attention(q[path], k[path], v[path], TA.attention_plan([0], [path.shape[0]], [np.arange(path.shape[0])], path.shape[0]), scale=0.25)
        assert torch.equal(alone[-s.q_len :], tree[s.q_start : s.q_start + s.q_len])


def test_saved_memory_is_linear_in_rows():
    """What autograd keeps for backward: inputs, output and log-sum-exp, not scores ([R, depth])."""
    L = 3000
    seq = layout_from_sequences([list(range(L))], conv_kernel=4, chunk_size=16)
    q = torch.randn(L, 8, 32, requires_grad=True)
    k = torch.randn(L, 2, 32, requires_grad=True)
    v = torch.randn(L, 2, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        TA.tree_attention(q, k, v, seq.attention, scale=0.2).sum().backward()
    per_row = sum(saved) / L
    assert per_row <= (8 + 2 + 2 + 8) * 32 * 4 + 8 * 4, per_row  # q, k, v, o, lse: no [L, L] scores


def test_plan_rejects_segments_out_of_order():
    with pytest.raises(ValueError, match="tiling rows"):
        TA.attention_plan([3, 0], [2, 3], [np.arange(3, 5), np.arange(3)], 5)


def test_layout_to_device_moves_the_plan():
    lay = layout_from_sequences([[1, 2, 3] * 7, [4] * 40], conv_kernel=4, chunk_size=16).to("meta")
    assert all(s.kv.is_meta and all(b.visible.is_meta for b in s.blocks) for s in lay.attention.segments)
