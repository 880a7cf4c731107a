"""Tests of kernels.tree_attention: the per-segment reference against a dense visibility-mask oracle
on random trees (float64, outputs and gradients), the backward block map, input validation, and
(in a subprocess under TRITON_INTERPRET=1) the Triton kernels against the reference."""
from __future__ import annotations


import pytest
import torch

from kernels.tree_attention import BACKENDS, attention_backend, prepare_tree_layout, tree_attention
from tests.triton_interpreter import run_under_interpreter
from tests.tree_attention_helpers import Tree, random_qkv, random_tree


def dense_visibility(tree: Tree) -> torch.Tensor:
    """bool [R, Rk]: row r sees column c (its segment's ancestor ranges, its own rows up to r)."""
    vis = torch.zeros(tree.R, tree.Rk, dtype=torch.bool)
    off = tree.attn_offsets.tolist()
    for s, (a0, L) in enumerate(zip(tree.seg_start.tolist(), tree.seg_len.tolist())):
        for a, b in tree.attn_ranges[off[s] : off[s + 1]].tolist():
            vis[a0 : a0 + L, a:b] = True
        vis[a0 : a0 + L, a0 : a0 + L] = torch.ones(L, L, dtype=torch.bool).tril()
    return vis


def dense_attention(q, k, v, vis_RK, scale):
    """Full [H, R, Rk] attention under the visibility mask; head h uses kv head h // G."""
    H, Hkv = q.shape[1], k.shape[1]
    kv_head = torch.arange(H) // (H // Hkv)
    s_HRK = torch.einsum("rhd,khd->hrk", q, k[:, kv_head]) * scale
    p_HRK = torch.softmax(s_HRK.masked_fill(~vis_RK, float("-inf")), dim=-1)
    return torch.einsum("hrk,khd->rhd", p_HRK, v[:, kv_head])


# (tree kwargs, H, Hkv, D)
CASES = {
    "single_segment": (dict(num_segments=1, min_len=37, max_len=37), 2, 2, 8),
    "deep_chain": (dict(num_segments=12, max_len=9, kind="chain"), 2, 1, 8),
    "wide_branching": (dict(num_segments=10, min_len=3, max_len=15, kind="wide"), 4, 2, 16),
    "random_forest_gqa_4_1": (dict(num_segments=15, max_len=12), 4, 1, 16),
    "short_segments": (dict(num_segments=20, max_len=3), 2, 2, 4),
    "imported_rows": (dict(num_segments=8, max_len=10, num_imported=3), 4, 2, 8),
    "imported_unmerged": (dict(num_segments=8, max_len=10, num_imported=2, merge_adjacent=False), 3, 3, 8),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_ref_matches_dense_oracle_float64(case):
    kwargs, H, Hkv, D = case
    tree = random_tree(11, **kwargs)
    q, k, v = random_qkv(tree, H, Hkv, D, seed=12, dtype=torch.float64)
    scale = D**-0.5
    o = tree_attention(q, k, v, tree.prepare(), scale=scale)
    o_dense = dense_attention(q, k, v, dense_visibility(tree), scale)
    assert o.shape == (tree.R, H, D) and o.dtype == torch.float64
    torch.testing.assert_close(o, o_dense, rtol=1e-10, atol=1e-10)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    grads = torch.autograd.grad(o, [q, k, v], do)
    grads_dense = torch.autograd.grad(o_dense, [q, k, v], do)
    for name, a, b in zip("qkv", grads, grads_dense):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


def test_tree_rows_equal_causal_attention_on_their_path():
    """A row's output is plain causal attention over its root-to-row path, as in the expanded sequence."""
    tree = random_tree(21, num_segments=9, max_len=8, num_imported=2)
    q, k, v = random_qkv(tree, 2, 1, 8, seed=22, dtype=torch.float64)
    o = tree_attention(q, k, v, tree.prepare(), scale=0.3)
    vis = dense_visibility(tree)
    for r in range(tree.R):
        path = vis[r].nonzero().flatten()
        seq_q = torch.cat([k.new_zeros(path.numel() - 1, 2, 8), q[r : r + 1]])  # only the last query matters
        o_seq = torch.nn.functional.scaled_dot_product_attention(
            seq_q.transpose(0, 1), k[path].expand(-1, 2, -1).transpose(0, 1), v[path].expand(-1, 2, -1).transpose(0, 1),
            is_causal=True, scale=0.3,
        ).transpose(0, 1)
        torch.testing.assert_close(o[r], o_seq[-1], rtol=1e-10, atol=1e-10)


def test_gradcheck_tiny_float64():
    tree = random_tree(31, num_segments=4, max_len=3, num_imported=1)
    q, k, v = random_qkv(tree, 2, 1, 3, seed=32, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda q, k, v: tree_attention(q, k, v, tree.prepare(), scale=0.7), (q, k, v))


def test_ref_fp32_and_bf16_output_dtype():
    tree = random_tree(41, num_segments=5, max_len=6)
    q, k, v = random_qkv(tree, 2, 2, 8, seed=42, dtype=torch.float64)
    o64 = tree_attention(q, k, v, tree.prepare(), scale=0.35)
    o32 = tree_attention(q.float(), k.float(), v.float(), tree.prepare(), scale=0.35)
    o16 = tree_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tree.prepare(), scale=0.35)
    assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16
    torch.testing.assert_close(o32.double(), o64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o16.double(), o64, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("blocks", [(16, 16), (16, 32), (64, 16)], ids=["m16_n16", "m16_n32", "m64_n16"])
def test_kv_pieces_cover_exactly_the_visible_pairs(blocks):
    """The backward's (kv block -> query block pieces) map, expanded to pairs, is the visibility matrix."""
    BM, BN = blocks
    tree = random_tree(51, num_segments=12, min_len=1, max_len=40, num_imported=2)
    layout = tree.prepare(block_m=BM, block_n=BN)
    index, qb, pieces = layout.index, layout.blocks, layout.pieces
    covered = torch.zeros(tree.R, tree.Rk, dtype=torch.int64)
    seg_end = (index.seg_start_S + index.seg_len_S).tolist()
    off = pieces.offsets_NKB1.tolist()
    for j in range(len(off) - 1):
        for p in range(off[j], off[j + 1]):
            lo, hi = int(pieces.lo_P[p]), int(pieces.hi_P[p])
            assert j * BN <= lo < hi <= (j + 1) * BN
            b = int(pieces.qblock_P[p])
            r0 = int(qb.row_NB[b])
            for r in range(r0, min(r0 + BM, seg_end[int(qb.seg_NB[b])])):
                for c in range(lo, hi):
                    if not pieces.causal_P[p] or c <= r:
                        covered[r, c] += 1
    assert torch.equal(covered, dense_visibility(tree).long())


def test_query_blocks_never_span_segments():
    tree = random_tree(61, num_segments=7, max_len=40)
    layout = tree.prepare(block_m=16, block_n=16)
    index, qb = layout.index, layout.blocks
    rows = torch.cat([torch.arange(r, min(r + 16, int(index.seg_start_S[s] + index.seg_len_S[s])))
                      for r, s in zip(qb.row_NB.tolist(), qb.seg_NB.tolist())])
    assert torch.equal(rows.sort().values, torch.arange(tree.R))


def _bad(tree: Tree, **override):
    """Prepare the layout and run the reference, with some layout fields, tensors or options replaced."""
    q, k, v = random_qkv(tree, 4, 2, 8, seed=1, dtype=torch.float32)
    arrays = {**tree.layout(), **{n: override.pop(n) for n in list(override) if n in tree.layout()}}
    sizes = dict(num_rows=override.pop("num_rows", tree.R), num_kv_rows=override.pop("num_kv_rows", tree.Rk))
    layout = prepare_tree_layout(**arrays, **sizes)
    args = dict(q=q, k=k, v=v, scale=1.0)
    args.update(override)
    return tree_attention(args.pop("q"), args.pop("k"), args.pop("v"), layout, **args)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(seg_start=torch.tensor([0, 3])), "seg_len: expected 2 entries"),
        (dict(seg_len=torch.tensor([3, 0, 2])), "seg_len: expected every segment >= 1"),
        (dict(seg_start=torch.tensor([0, 2, 5]), seg_len=torch.tensor([3, 3, 1])), "tile rows"),
        (dict(attn_offsets=torch.tensor([0, 1, 0, 1])), "attn_offsets"),
        (dict(attn_ranges=torch.tensor([[0, 99]])), "attn_ranges: expected 0 <= start <= end <= Rk"),
        (dict(attn_ranges=torch.tensor([[0.0, 1.0]])), "attn_ranges: expected an int32/int64"),
        (dict(attn_ranges=torch.tensor([[2, 4]])), "outside their segment's own rows"),
        (dict(num_kv_rows=5), "num_kv_rows: expected >= num_rows"),
        (dict(k=torch.zeros(6, 3, 8), v=torch.zeros(6, 3, 8)), "H a multiple of Hkv"),
        (dict(k=torch.zeros(7, 2, 8), v=torch.zeros(7, 2, 8)), "extended rows"),
        (dict(q=torch.zeros(5, 4, 8)), "query rows"),
        (dict(backend="cuda"), "backend: expected one of"),
    ],
    ids=["seg_len_count", "empty_segment", "overlap", "offsets", "range_past_rk", "range_dtype", "range_in_own_rows",
         "rk_below_r", "gqa", "kv_rows", "q_rows", "backend"],
)
def test_invalid_inputs_raise(override, match):
    tree = Tree(
        seg_start=torch.tensor([0, 3, 4]), seg_len=torch.tensor([3, 1, 2]),
        attn_offsets=torch.tensor([0, 0, 1, 1]), attn_ranges=torch.tensor([[0, 2]]), R=6, Rk=6,
    )
    _bad(tree)  # the unmodified layout is valid
    with pytest.raises(ValueError, match=match):
        _bad(tree, **override)


def test_backends_are_resolved_once_by_name():
    assert set(BACKENDS) >= {"ref", "triton"}
    assert attention_backend("ref") is BACKENDS["ref"]
    with pytest.raises(ValueError, match="backend: expected one of"):
        attention_backend("flash")


def test_layout_plans_are_built_once():
    """A backend's own index structure (`layout.plan`) is built on first use and shared by every layer."""
    layout = random_tree(71, num_segments=3, max_len=5).prepare()
    calls = []
    first = layout.plan("tiles", lambda lay: calls.append(lay) or object())
    assert layout.plan("tiles", lambda lay: calls.append(lay) or object()) is first
    assert calls == [layout]


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    """The Triton kernels' tests, in a subprocess with TRITON_INTERPRET=1 set before triton loads."""
    run_under_interpreter("kernels/test_tree_attention_triton.py")
