"""Batched tile attention (`tree_ops.tiled_attention`) against the per-segment reference, bitwise.

Random trees of segments (each segment's keys: a prefix of an earlier segment's path, then its own
rows) in fp32 on CPU: the batched tile plan must give the same bits as `ancestor_attention_segments`
(one `_attend` per segment, every key tile of the segment), and gradients within fp32 rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import tree_ops as T
from trainer.layout import layout_from_sequences


def _random_segments(rng: np.random.Generator, n: int, max_len: int) -> tuple[list[T.AttnSegment], int]:
    segs, paths, R = [], [], 0
    for _ in range(n):
        anc = np.zeros(0, np.int64)
        if paths and rng.random() < 0.8:
            anc = paths[int(rng.integers(len(paths)))]
            anc = anc[: int(rng.integers(0, len(anc) + 1))]
        L = int(rng.integers(1, max_len))
        path = np.concatenate([anc, np.arange(R, R + L)])
        segs.append(T.AttnSegment(q_start=R, q_len=L, kv_idx=torch.from_numpy(path)))
        paths.append(path)
        R += L
    order = rng.permutation(n)  # the reference sorts; the tile plan must not care about the order
    return [segs[i] for i in order], R


@pytest.mark.parametrize("seed", range(6))
def test_tiled_attention_bitwise_equals_per_segment_reference(seed):
    rng = np.random.default_rng(seed)
    segs, R = _random_segments(rng, int(rng.integers(1, 14)), 70)
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(R, h, 16, generator=gen, requires_grad=True) for h in (4, 2, 2)]
    got = T.tiled_attention(*leaves, T.tiles_from_segments(segs, R), scale=0.25)
    want = T.ancestor_attention_segments(*leaves, segs, scale=0.25)
    assert torch.equal(got, want)
    w = torch.randn(got.shape, generator=gen)
    g_got = torch.autograd.grad((got * w).sum(), leaves)
    g_want = torch.autograd.grad((want * w).sum(), leaves)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_tile_groups_bounded_and_cover_every_row_once(monkeypatch):
    monkeypatch.setattr(T, "MAX_TILE_PAIRS", 8)
    segs, R = _random_segments(np.random.default_rng(7), 9, 90)
    tiles = T.tiles_from_segments(segs, R)
    assert len(tiles.groups) > 1
    slots = torch.cat([g.q_rows.reshape(-1) for g in tiles.groups])
    real = slots[slots < R]
    assert sorted(real.tolist()) == list(range(R))
    assert torch.equal(slots[tiles.row_slot], torch.arange(R))
    pad_tile = tiles.key_rows.shape[0] - 1
    assert (tiles.key_rows[pad_tile] == R).all()
    assert len({tuple(r) for r in tiles.key_rows.tolist()}) == tiles.key_rows.shape[0]  # stored once each
    for g in tiles.groups:
        nk = g.kv_tiles.shape[1]
        assert g.kv_tiles.shape[0] * nk <= max(8, nk)
        # every group folds over no fewer key tiles than its queries can see
        assert int(g.visible.max()) <= nk * T.TILE_K
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(R, 4, 16, generator=gen), torch.randn(R, 2, 16, generator=gen), torch.randn(R, 2, 16, generator=gen)
    assert torch.equal(T.tiled_attention(q, k, v, tiles, scale=0.25), T.ancestor_attention_segments(q, k, v, segs, scale=0.25))


def test_bucket_widths_exact_to_16_then_within_an_eighth():
    nk = np.arange(1, 5000)
    b = T._bucket(nk)
    assert (b[:16] == nk[:16]).all()
    assert (b >= nk).all() and (b <= 1.125 * nk).all()
    assert len(np.unique(b)) <= 16 + 8 * 9


def test_layout_carries_the_tile_plan():
    lay = layout_from_sequences([[1, 2, 3] * 7, [4] * 40], conv_kernel=4, chunk_size=16)
    gen = torch.Generator().manual_seed(2)
    R = lay.num_rows
    q, k, v = torch.randn(R, 4, 16, generator=gen), torch.randn(R, 2, 16, generator=gen), torch.randn(R, 2, 16, generator=gen)
    want = T.ancestor_attention_segments(q, k, v, lay.attn_segments, scale=0.25)
    assert torch.equal(T.tiled_attention(q, k, v, lay.attn_tiles, scale=0.25), want)


@pytest.mark.parametrize("seed", range(4))
def test_fold_tiles_bitwise_equals_cumsum_last(seed):
    gen = torch.Generator().manual_seed(seed)
    nk = int(torch.randint(1, 40, (1,), generator=gen))
    # magnitudes spread over ~2^20 so that float32 and float64 accumulation would differ
    x = (torch.randn(3, nk, 4, 16, generator=gen) * torch.exp(3 * torch.randn(3, nk, 1, 1, generator=gen))).requires_grad_()
    got, want = T.fold_tiles(x), T.fold_tiles_ref(x)
    assert torch.equal(got, want)
    g = torch.randn(got.shape, generator=gen)
    assert torch.equal(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])


def test_key_tiles_that_share_a_last_row_but_not_the_ancestry_stay_distinct():
    # not a tree: two segments whose first key tiles both end at row 15 with 16 rows, in different orders
    segs = [T.AttnSegment(q_start=0, q_len=16, kv_idx=torch.arange(16)),
            T.AttnSegment(q_start=16, q_len=4, kv_idx=torch.cat([torch.arange(16), torch.arange(16, 20)])),
            T.AttnSegment(q_start=20, q_len=4, kv_idx=torch.cat([torch.arange(14, -1, -1), torch.tensor([15]), torch.arange(20, 24)]))]
    tiles = T.tiles_from_segments(segs, 24)
    assert tiles.key_rows.shape[0] == 5  # [0..15], [16..19], [14..0, 15], [20..23], padding
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(24, 4, 16, generator=gen), torch.randn(24, 2, 16, generator=gen), torch.randn(24, 2, 16, generator=gen)
    assert torch.equal(T.tiled_attention(q, k, v, tiles, scale=0.25), T.ancestor_attention_segments(q, k, v, segs, scale=0.25))


def test_layout_to_device_moves_the_tile_plan():
    lay = layout_from_sequences([[1, 2, 3] * 7, [4] * 40], conv_kernel=4, chunk_size=16).to("meta")
    t = lay.attn_tiles
    assert t.key_rows.is_meta and t.row_slot.is_meta
    assert all(g.q_rows.is_meta and g.kv_tiles.is_meta and g.visible.is_meta for g in t.groups)
