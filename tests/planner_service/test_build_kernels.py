"""The plan builder's Numba kernels (build_kernels.py) against their plain-Python twins on seeded
random inputs, plus independent checks of what they compute."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from planner_service.planner import build_kernels as bk
from planner_service.planner import logprob_map as lpm
from planner_service.planner import min_calls as mc
from planner_service.planner.linear_calls_codec import encode_linear_calls, fill_linear_calls_ref
from planner_service.planner.logprob_map import lp_entries
from planner_service.planner.row_layout import TokenIndex
from proto.harts.v1 import plan_pb2
from tests.builder_helpers import forest_from_trajectories, random_trajectories


def _eq(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _random_forest(rng, it):
    trajs, tree_of = random_trajectories(rng, n=int(rng.integers(1, 25)), max_len=40, vocab=3, trees=3)
    return forest_from_trajectories(trajs, tree_of=tree_of, seed=it)


def _random_parents(rng, n, roots_p=0.2):
    """int32 [n] parent < index or -1."""
    par = np.array([-1 if i == 0 or rng.random() < roots_p else int(rng.integers(0, i)) for i in range(n)], np.int32)
    return par


def test_local_segments_match_reference():
    rng = np.random.default_rng(0)
    for it in range(30):
        f = _random_forest(rng, it)
        tix = TokenIndex(f)
        n = f.unique_tokens
        pick = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False)).astype(np.int64)
        dup = (rng.random(pick.shape[0]) < 0.3).astype(np.uint8)
        rest = np.setdiff1d(np.arange(n), pick)
        ctx = np.sort(rng.choice(rest, size=int(rng.integers(0, rest.shape[0] + 1)), replace=False)).astype(np.int64)
        for shared in (False, True):
            got = bk.local_segments(pick, dup, tix.seg, tix.pred, ctx, shared)
            ref = bk.local_segments_ref(pick.tolist(), dup.tolist(), tix.seg, tix.pred, ctx, shared)
            assert int(got[5]) == int(ref[5])
            k = int(got[5])
            if k < 0:
                _eq(got[:5], ref[:5])
            else:  # identical up to the failing segment
                _eq([x[: k + 1] for x in got[:3]], [x[: k + 1] for x in ref[:3]])
            # runs cover the picked tokens exactly
            first, length = got[0], got[1]
            toks = np.concatenate([np.arange(a, a + b) for a, b in zip(first, length)]) if first.shape[0] else first
            np.testing.assert_array_equal(toks, pick)


def _random_packed(rng, C):
    S = int(rng.integers(1, 12))
    par = _random_parents(rng, S)
    length = rng.integers(1, 2 * C, S).astype(np.int32)
    depth = np.zeros(S, np.int32)
    I = int(rng.integers(0, 10))
    imp_parent = np.array([-1 if j == 0 or rng.random() < 0.3 else j - 1 if rng.random() < 0.7 else int(rng.integers(0, j))
                           for j in range(I)], np.int64)
    attach = np.full(S, -1, np.int32)
    for s in range(S):
        if par[s] >= 0:
            depth[s] = depth[par[s]] + length[par[s]]
        elif I and rng.random() < 0.7:
            attach[s] = int(rng.integers(0, I))
            depth[s] = 1 + int(rng.integers(0, 5))
    P = mc.pack(par, depth, length, attach, C)
    R = P["num_rows"]
    ext_parent = np.concatenate([P["row_parent"], np.where(imp_parent >= 0, R + imp_parent, -1)]).astype(np.int32)
    return P, ext_parent


def test_attn_ranges_and_conv_ancestors_match_reference():
    rng = np.random.default_rng(1)
    for _ in range(60):
        C = int(rng.choice([2, 4, 8]))
        P, ext_parent = _random_packed(rng, C)
        args = (P["seg_start"], P["seg_length"], P["seg_parent"], P["row_parent"], ext_parent)
        offs, ranges = bk.attn_ranges(*args)
        _eq((offs, ranges), bk.attn_ranges_ref(*args))
        # independent check: the ranges list exactly the segment's strict ancestors, in path order
        for s in range(P["seg_start"].shape[0]):
            rows = [y for a, b in ranges[offs[s] : offs[s + 1]].tolist() for y in range(a, b)]
            anc = []
            y = int(P["row_parent"][P["seg_start"][s]])
            while y >= 0:
                anc.append(y)
                y = int(ext_parent[y])
            assert rows == anc[::-1]  # root first
        R = P["num_rows"]
        for K in (1, 2, 4):
            _eq([bk.conv_ancestors(ext_parent, R, K)], [bk.conv_ancestors_ref(ext_parent, R, K)])


def test_occurrence_kernels_match_reference():
    rng = np.random.default_rng(2)
    for _ in range(30):
        S = int(rng.integers(1, 40))
        par = _random_parents(rng, S)
        traj_seg = rng.integers(0, S, int(rng.integers(0, 30))).astype(np.int32)
        occ = bk.subtree_occurrence(traj_seg, par)
        np.testing.assert_array_equal(occ, bk.subtree_occurrence_ref(traj_seg, par))
        for s in range(S):  # trajectories ending at s or below
            below = {s}
            for u in range(s + 1, S):
                if par[u] in below:
                    below.add(u)
            assert occ[s] == sum(int(t) in below for t in traj_seg)
        row_seg = rng.integers(0, 5, 20).astype(np.int32)
        seg_forest = rng.integers(0, S, 5).astype(np.int32)
        seg_dup = (rng.random(5) < 0.4).astype(np.uint8)
        np.testing.assert_array_equal(bk.row_occurrence(row_seg, seg_forest, seg_dup, occ),
                                      bk.row_occurrence_ref(row_seg, seg_forest, seg_dup, occ))


@pytest.mark.parametrize("all_positions", [False, True], ids=["loss", "all"])
def test_lp_grouped_matches_reference_and_ungrouped_entries(all_positions):
    rng = np.random.default_rng(3)
    for it in range(10):
        f = _random_forest(rng, it)
        if it % 2:  # reference log-probs present, old ones absent
            f = dataclasses.replace(f, old_logprobs=None, ref_logprobs=rng.random(f.expanded_tokens).astype(np.float32))
        M = int(rng.integers(1, 5))
        kept_mb = rng.integers(0, M, f.unique_tokens).astype(np.int64)
        kept_row = rng.integers(0, 100, f.unique_tokens).astype(np.int64)
        args = (f.traj_offset, f.traj_seg, f.seg_parent, f.seg_offset, f.seg_depth, f.seg_length, f.loss_mask,
                all_positions, kept_mb, kept_row, f.tokens, M)
        none = np.zeros(0, np.float32)
        old = f.old_logprobs if f.old_logprobs is not None else none
        ref = f.ref_logprobs if f.ref_logprobs is not None else none
        got = lpm.lp_grouped(*args, f.advantages, old, ref)
        _eq(got, lpm.lp_grouped_ref(*args, f.advantages, old, ref))
        bounds, row, label, traj, pos, mask, adv, old_g, ref_g = got
        g0, traj0, pos0, prev0, tok0 = lp_entries(*args[:8])
        order = np.argsort(kept_mb[prev0], kind="stable")
        g = g0[order]
        np.testing.assert_array_equal(bounds, np.searchsorted(np.sort(kept_mb[prev0]), np.arange(M + 1)))
        np.testing.assert_array_equal(row, kept_row[prev0[order]])
        np.testing.assert_array_equal(label, f.tokens[tok0[order]])
        np.testing.assert_array_equal(traj, traj0[order])
        np.testing.assert_array_equal(pos, pos0[order])
        np.testing.assert_array_equal(mask, f.loss_mask[g])
        np.testing.assert_array_equal(adv, f.advantages[g])
        np.testing.assert_array_equal(old_g, old[g] if old.shape[0] else none)
        np.testing.assert_array_equal(ref_g, ref[g] if ref.shape[0] else none)

def test_pack_rows_layout_and_ext_rows_match_reference():
    rng = np.random.default_rng(4)
    for it in range(30):
        C = int(rng.choice([2, 4, 8]))
        S = int(rng.integers(1, 12))
        par = _random_parents(rng, S)
        length = rng.integers(1, 2 * C, S).astype(np.int32)
        depth = np.array([0] * S, np.int32)
        attach = np.where(par < 0, rng.integers(-1, 4, S), -1).astype(np.int32)
        for s in range(S):
            depth[s] = depth[par[s]] + length[par[s]] if par[s] >= 0 else (0 if attach[s] < 0 else 3)
        got, ref = mc.pack(par, depth, length, attach, C), mc.pack(par, depth, length, attach, C, use_numba=False)
        assert got.keys() == ref.keys()
        _eq([got[k] for k in sorted(got)], [ref[k] for k in sorted(ref)])

        f = _random_forest(rng, it)
        tix = TokenIndex(f)
        n = f.unique_tokens
        order = rng.permutation(S).astype(np.int32)
        first = rng.integers(0, n, S).astype(np.int64)
        seg_dup = (rng.random(S) < 0.3).astype(np.uint8)
        R = int(rng.integers(0, 20))
        row_seg = np.sort(rng.integers(0, S, R)).astype(np.int32)
        seg_start = np.searchsorted(row_seg, np.arange(S)).astype(np.int32)
        kept = [np.full(n + 20, -1, np.int64) for _ in range(2)]
        a = bk.local_rows_layout(order, first, seg_dup, row_seg, seg_start, tix.seg, tix.off, kept[0])
        b = bk.local_rows_layout_ref(order, first, seg_dup, row_seg, seg_start, tix.seg, tix.off, kept[1])
        _eq(a, b)
        _eq(kept[:1], kept[1:])

        # imported context: the union of some tokens' root paths (sorted), as the builder forms it
        ctx = set()
        for x in rng.choice(n, size=min(n, 3), replace=False).tolist():
            while x >= 0 and x not in ctx:
                ctx.add(x)
                x = int(tix.pred[x])
        imp = np.array(sorted(ctx), np.int64)
        row_parent = rng.integers(-1, R + imp.shape[0], R).astype(np.int32)
        row_depth = rng.integers(0, 50, R).astype(np.int32)
        a = bk.ext_parent_depth(row_parent, row_depth, imp, tix.pred, tix.depth)
        _eq(a, bk.ext_parent_depth_ref(row_parent, row_depth, imp, tix.pred, tix.depth))
        for i, t in enumerate(imp.tolist()):  # an imported row's parent is its predecessor's row
            p = int(a[0][R + i])
            assert (p < 0 and tix.pred[t] < 0) or imp[p - R] == tix.pred[t]


def test_encode_linear_calls_matches_protobuf_api():
    rng = np.random.default_rng(5)
    for _ in range(40):
        Q = int(rng.integers(0, 12))
        i32 = lambda a: np.asarray(a, np.int32)  # noqa: E731
        q_start, q_end = i32(rng.integers(0, 3, Q) * rng.integers(0, 300, Q)), i32(rng.integers(0, 5000, Q))
        q_depth, q_call = i32(rng.integers(0, 2, Q) * rng.integers(0, 1 << 20, Q)), i32(rng.integers(0, 4, Q))
        n_rep = rng.integers(0, 3, Q) * rng.integers(0, 70, Q)
        r_off = np.r_[0, np.cumsum(n_rep)].astype(np.int64)
        r_rows = i32(rng.integers(0, 1 << 30, int(r_off[-1])))
        kind, state = i32(rng.integers(0, 3, Q)), i32(rng.integers(0, 2, Q) * rng.integers(0, 400, Q))
        E = int(rng.integers(0, 10)) if Q else 0
        ex = np.array(sorted(zip(rng.integers(0, max(Q, 1), E).tolist(), rng.integers(0, 200, E).tolist(),
                                 rng.integers(0, 300, E).tolist())), np.int64).reshape(-1, 3)
        n_calls = int(q_call.max()) + 2 if Q else int(rng.integers(0, 2))
        got = plan_pb2.Microbatch()
        got.MergeFromString(encode_linear_calls(q_start, q_end, q_depth, q_call, r_off, r_rows, kind, state,
                                                ex[:, 0], ex[:, 1], ex[:, 2], n_calls).tobytes())
        want = plan_pb2.Microbatch()
        sched = (q_start, q_end, q_depth, None, q_call, r_off, r_rows, None)
        fill_linear_calls_ref(want, sched, kind, state, ex[:, 0], ex[:, 1], ex[:, 2], n_calls)
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
        assert len(got.linear_calls) == n_calls


def test_token_index_and_ranges_match_reference():
    rng = np.random.default_rng(6)
    for it in range(15):
        f = _random_forest(rng, it)
        args = (f.seg_parent, f.seg_offset, f.seg_length, f.seg_depth)
        seg, off, depth, pred = bk.token_index(*args)
        _eq((seg, off, depth, pred), bk.token_index_ref(*args))
        np.testing.assert_array_equal(seg, np.repeat(np.arange(f.num_segments), f.seg_length))
        for t in range(f.num_trajectories):  # predecessors chain every trajectory's tokens
            path = np.concatenate([np.arange(f.seg_offset[s], f.seg_offset[s] + f.seg_length[s]) for s in f.path(t)])
            np.testing.assert_array_equal(pred[path], np.r_[-1, path[:-1]])
            np.testing.assert_array_equal(depth[path], np.arange(path.shape[0]))
        start, length = rng.integers(0, 100, 6), rng.integers(0, 5, 6)
        np.testing.assert_array_equal(bk.expand_ranges(start, length), bk.expand_ranges_ref(start, length))
        np.testing.assert_array_equal(bk.expand_ranges(start, length),
                                      np.concatenate([np.arange(a, a + n) for a, n in zip(start, length)]))


def test_sorted_union_matches_reference():
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(1, 50))
        rows = rng.integers(0, n, int(rng.integers(0, 80))).astype(np.int64)
        got = bk.sorted_union(rows, n)
        np.testing.assert_array_equal(got, bk.sorted_union_ref(rows, n))
        np.testing.assert_array_equal(got, np.unique(rows))
