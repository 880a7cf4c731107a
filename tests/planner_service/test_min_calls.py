"""Minimum sequential linear-attention calls (planner_service/planner/min_calls.py, docs/design/min-calls.md)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner_service.planner import min_calls as mc
from tests.builder_helpers import forest_from_trajectories, random_trajectories


def _chunk_tree_from_tokens(trajs: list[list[int]], tree_of: list[str], chunk: int):
    """Chunk tree straight from token lists: node = (tree, token prefix up to the chunk's end)."""
    keys = {(tree, tuple(t)) for t, tree in zip(trajs, tree_of)}
    leaves = [k for k in keys if not any(o != k and o[0] == k[0] and o[1][: len(k[1])] == k[1] for o in keys)]
    children: dict[tuple, set] = {}
    roots = set()
    for tree, toks in leaves:
        prev = None
        for k in range((len(toks) - 1) // chunk + 1):
            node = (tree, toks[: min((k + 1) * chunk, len(toks))])
            if prev is None:
                roots.add(node)
            else:
                children.setdefault(prev, set()).add(node)
            prev = node
    return roots, {k: sorted(v) for k, v in children.items()}


def _brute_force_calls(roots, children) -> int:
    """Minimum over ALL path decompositions: each node continues into at most one child."""
    nodes = sorted(set(roots) | set(children) | {c for v in children.values() for c in v})
    internal = [v for v in nodes if children.get(v)]
    best = None
    for choice in itertools.product(*[[None] + children[v] for v in internal]):
        cont = dict(zip(internal, choice))
        worst = 0
        stack = [(r, 1) for r in roots]
        while stack:
            v, call = stack.pop()
            worst = max(worst, call)
            for c in children.get(v, ()):
                stack.append((c, call if cont[v] == c else call + 1))
        best = worst if best is None else min(best, worst)
    return best


def _forest_arrays(forest):
    return forest.seg_parent, forest.seg_depth, forest.seg_length


@pytest.mark.parametrize("chunk", [1, 2, 4, 8], ids=lambda c: f"C{c}")
def test_min_calls_matches_brute_force_on_random_trees(chunk):
    rng = np.random.default_rng(100 + chunk)
    checked = 0
    for _ in range(60):
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(1, 6)), max_len=3 * chunk + 3, vocab=3,
                                             trees=2, chunk=chunk)
        roots, children = _chunk_tree_from_tokens(trajs, tree_of, chunk)
        if np.prod([len(v) + 1 for v in children.values()] or [1]) > 20000:
            continue
        forest = forest_from_trajectories(trajs, tree_of=tree_of)
        want = _brute_force_calls(roots, children)
        assert mc.min_calls(*_forest_arrays(forest), chunk) == want, trajs
        assert mc.min_calls_chunk_tree_ref(*_forest_arrays(forest), chunk) == want, trajs
        # The schedule realises the optimum, with the Numba and the reference twins.
        for use_numba in (True, False):
            assert mc.forest_schedule(*_forest_arrays(forest), chunk, use_numba=use_numba)["calls"] == want
        checked += 1
    assert checked >= 40


@pytest.mark.parametrize("chunk", [1, 2, 4, 8, 64], ids=lambda c: f"C{c}")
def test_numba_twins_match_references(chunk):
    rng = np.random.default_rng(7 * chunk)
    for _ in range(25):
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(1, 30)), max_len=6 * chunk, vocab=4,
                                             trees=3, chunk=chunk)
        forest = forest_from_trajectories(trajs, tree_of=tree_of)
        arrays = [a.astype(np.int32) for a in _forest_arrays(forest)]
        t1, t2 = mc.segment_top2(*arrays, chunk)
        r1, r2 = mc.segment_top2_ref(*arrays, chunk)
        np.testing.assert_array_equal(t1, r1)
        np.testing.assert_array_equal(t2, r2)
        o, c = mc.continuing_order(arrays[0], t1)
        ro, rc = mc.continuing_order_ref(arrays[0], t1)
        np.testing.assert_array_equal(o, ro)
        np.testing.assert_array_equal(c, rc)
        assert mc.min_calls(*arrays, chunk) == mc.min_calls_chunk_tree_ref(*arrays, chunk)
        for replay in (True, False):
            a = mc.forest_schedule(*arrays, chunk, replay=replay)["sched"]
            b = mc.forest_schedule(*arrays, chunk, replay=replay, use_numba=False)["sched"]
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


def _two_branches(p: int) -> list[list[int]]:
    prefix = list(range(1, p + 1))
    return [prefix + [100, 101], prefix + [200, 201]]


@pytest.mark.parametrize(
    "p, calls, replayed, states",
    [(7, 1, 7, 0), (8, 2, 0, 1), (9, 2, 1, 1)],
    ids=["p7_one_call_replay7", "p8_aligned_two_calls_one_state", "p9_two_calls_replay1"],
)
def test_worked_cases_two_branches(p, calls, replayed, states):
    forest = forest_from_trajectories(_two_branches(p))
    out = mc.forest_schedule(*_forest_arrays(forest), 8)
    assert (out["calls"], out["replay_tokens"], out["states"]) == (calls, replayed, states)
    assert mc.min_calls(*_forest_arrays(forest), 8) == calls


def test_worked_case_nested():
    prefix = list(range(1, 8))
    trajs = [prefix + [101, 102, 103], prefix + [101, 102, 201], prefix + [301]]
    forest = forest_from_trajectories(trajs)
    out = mc.forest_schedule(*_forest_arrays(forest), 8)
    assert (out["calls"], out["replay_tokens"], out["states"]) == (2, 8, 1)


def test_trajectory_ending_inside_needs_no_sequence():
    forest = forest_from_trajectories([list(range(20)), list(range(13))])
    out = mc.forest_schedule(*_forest_arrays(forest), 8)
    assert (out["calls"], out["sequences"], out["replay_tokens"]) == (1, 1, 0)


def test_sequences_are_contiguous_with_bounded_aligned_replay():
    rng = np.random.default_rng(3)
    chunk = 4
    for _ in range(20):
        trajs, tree_of = random_trajectories(rng, n=15, max_len=30, vocab=3, trees=2, chunk=chunk)
        forest = forest_from_trajectories(trajs, tree_of=tree_of)
        out = mc.forest_schedule(*_forest_arrays(forest), chunk)
        start, end, depth, init, call, roff, rrows, seq_of_row = out["sched"]
        row_depth = out["packed"]["row_depth"]
        owned = np.zeros(out["packed"]["num_rows"], np.int64)
        for q in range(len(start)):
            owned[start[q]:end[q]] += 1
            reps = rrows[roff[q]:roff[q + 1]]
            assert len(reps) <= chunk - 1 and depth[q] % chunk == 0
            chain = np.concatenate([row_depth[reps], row_depth[start[q]:end[q]]])
            np.testing.assert_array_equal(chain, np.arange(depth[q], depth[q] + len(chain)))
            if init[q] >= 0:
                assert row_depth[init[q]] == depth[q] - 1 and call[seq_of_row[init[q]]] < call[q]
        assert (owned == 1).all()


def test_ablation_without_replay_starts_at_branch_depths():
    forest = forest_from_trajectories(_two_branches(9))
    out = mc.forest_schedule(*_forest_arrays(forest), 8, replay=False)
    start, end, depth, init, call, roff, rrows, _ = out["sched"]
    assert out["replay_tokens"] == 0
    # Parent sequence split at the unaligned depth 9: [0,9) call 0, then two sequences from depth 9.
    assert sorted(depth.tolist()) == [0, 9, 9] and out["calls"] == 2


@pytest.mark.parametrize("chunk", [1, 2, 4], ids=lambda c: f"C{c}")
def test_min_calls_matches_brute_force_on_bushy_trees(chunk):
    """Random subsets of binary strings, each bit a block of 1..C+1 tokens: deep nesting, f up to 4."""
    rng = np.random.default_rng(300 + chunk)
    seen = set()
    for _ in range(80):
        height = int(rng.integers(2, 6))
        block = [int(b) for b in rng.integers(1, chunk + 2, height)]
        words = {tuple(int(x) for x in rng.integers(0, 2, height)) for _ in range(int(rng.integers(2, 13)))}
        trajs = [[tok for b, w in zip(block, word) for tok in [w] * b] for word in sorted(words)]
        roots, children = _chunk_tree_from_tokens(trajs, [""] * len(trajs), chunk)
        if np.prod([len(v) + 1 for v in children.values()] or [1]) > 30000:
            continue
        forest = forest_from_trajectories(trajs)
        want = _brute_force_calls(roots, children)
        seen.add(want)
        assert mc.min_calls(*_forest_arrays(forest), chunk) == want, trajs
        assert mc.forest_schedule(*_forest_arrays(forest), chunk)["calls"] == want, trajs
    assert max(seen) >= 3
