"""The two-level partitioner: Kundu-Misra optimality, budgets, packing, placement, order, memory.

Numba kernels are compared with their plain-Python oracles (`partition_ref.py`) on seeded random
forests; the whole partitioner runs on both and must agree exactly.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner import level1, level2, partition_ref
from planner_service.planner.config import PlanConfig
from planner_service.planner.expand import expand_forest
from planner_service.planner.partition import partition, partition_with_report
from plan.memory_model import RowSizes


# Forests built by hand (a plain trie).
def make_forest(trajs: list[list[int]], trees: list[str] | None = None, vocab: int = 1000) -> Forest:
    """Radix forest of `trajs` (merged within each tree id) in DFS preorder, children by token."""
    trees = trees or [""] * len(trajs)
    tree_names = list(dict.fromkeys(trees))
    tries = {name: {} for name in tree_names}
    ends: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for t, (toks, name) in enumerate(zip(trajs, trees)):
        node = tries[name]
        for x in toks:
            node = node.setdefault(x, {})
        ends.setdefault((name, tuple(toks)), []).append(t)
    seg_parent, seg_tokens, seg_depth, seg_tree = [], [], [], []
    traj_seg = [0] * len(trajs)

    def emit(name, node, prefix, parent, depth):
        for x in sorted(node):
            run, child, path = [x], node[x], prefix + [x]
            while len(child) == 1 and (name, tuple(path)) not in ends:
                (y,) = child
                run.append(y)
                path.append(y)
                child = child[y]
            s = len(seg_parent)
            seg_parent.append(parent)
            seg_tokens.append(run)
            seg_depth.append(depth)
            seg_tree.append(tree_names.index(name))
            for t in ends.get((name, tuple(path)), []):
                traj_seg[t] = s
            emit(name, child, path, s, depth + len(run))

    for name in tree_names:
        emit(name, tries[name], [], -1, 0)
    lengths = np.array([len(x) for x in trajs], np.int64)
    n_e = int(lengths.sum())
    seg_length = np.array([len(x) for x in seg_tokens], np.int32)
    rng = np.random.default_rng(len(trajs))
    forest = Forest(
        batch_id="test",
        vocab_size=vocab,
        tokens=np.array([x for run in seg_tokens for x in run], np.int32),
        seg_parent=np.array(seg_parent, np.int32),
        seg_offset=(np.cumsum(seg_length, dtype=np.int64) - seg_length),
        seg_length=seg_length,
        seg_depth=np.array(seg_depth, np.int32),
        seg_tree=np.array(seg_tree, np.int32),
        tree_ids=tree_names,
        traj_ids=[f"t{t}" for t in range(len(trajs))],
        traj_seg=np.array(traj_seg, np.int32),
        traj_offset=np.r_[0, np.cumsum(lengths)].astype(np.int64),
        loss_mask=(rng.random(n_e) < 0.7).astype(np.uint8),
        advantages=rng.standard_normal(n_e).astype(np.float32),
        old_logprobs=-rng.random(n_e).astype(np.float32),
        reward=np.zeros(len(trajs), np.float32),
        weight=np.ones(len(trajs), np.float32),
        group_ids=[""] * len(trajs),
    )
    forest.check()
    return forest


def random_trajs(rng: np.random.Generator, n_trees: int, per_tree: int, max_len: int, vocab: int = 4) -> tuple[list, list]:
    """Random branching trajectories: each new one copies a random prefix of an earlier one."""
    trajs, trees = [], []
    for tree in range(n_trees):
        mine: list[list[int]] = []
        for _ in range(per_tree):
            if mine and rng.random() < 0.85:
                base = mine[rng.integers(len(mine))]
                p = int(rng.integers(0, len(base) + 1))
                tail = rng.integers(0, vocab, size=int(rng.integers(1, max_len))).tolist()
                toks = (base[:p] + tail)[:max_len]
            else:
                toks = rng.integers(0, vocab, size=int(rng.integers(1, max_len))).tolist()
            mine.append(toks)
            trajs.append(toks)
            trees.append(f"tree{tree}")
    return trajs, trees


def random_forest(seed: int, n_trees: int = 3, per_tree: int = 6, max_len: int = 40) -> Forest:
    rng = np.random.default_rng(seed)
    return make_forest(*random_trajs(rng, n_trees, per_tree, max_len))


# Units.
@pytest.mark.parametrize("chunk", [1, 4, 8, 64], ids=lambda c: f"C{c}")
def test_units_match_reference_and_split_at_chunk_depths(chunk):
    f = random_forest(1, max_len=60)
    got = level1.build_units(f.seg_parent, f.seg_length, f.seg_depth, chunk)
    want = partition_ref.build_units(f.seg_parent, f.seg_length, f.seg_depth, chunk)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    unit_seg, unit_off, unit_len, unit_depth, unit_parent = got
    assert (unit_len <= chunk).all() or chunk >= 64
    assert unit_len.sum() == f.unique_tokens
    inner = unit_off > 0
    assert (unit_depth[inner] % chunk == 0).all(), "a cut inside a segment must be chunk-aligned"
    assert (unit_parent < np.arange(unit_parent.shape[0])).all()


# Kundu-Misra.
def _brute_min_pieces(parent: list[int], weight: list[int], budget: int) -> int:
    """Fewest connected pieces of weight <= budget, over every subset of cut edges."""
    n = len(parent)
    edges = [u for u in range(n) if parent[u] >= 0]
    best = None
    for r in range(len(edges) + 1):
        for cut in itertools.combinations(edges, r):
            cutset = set(cut)
            root = list(range(n))
            for u in range(n):
                if parent[u] >= 0 and u not in cutset:
                    root[u] = root[parent[u]]
            sums: dict[int, int] = {}
            for u in range(n):
                sums[root[u]] = sums.get(root[u], 0) + weight[u]
            if max(sums.values()) <= budget:
                pieces = len(sums)
                best = pieces if best is None else min(best, pieces)
        if best is not None:
            return best  # fewer cuts cannot follow from more cuts: pieces = roots + cuts
    raise AssertionError("no feasible cut")


@pytest.mark.parametrize("seed", range(12))
def test_kundu_misra_gives_the_fewest_pieces(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 12))
    parent = [-1] + [int(rng.integers(-1, u)) if rng.random() < 0.9 else -1 for u in range(1, n)]
    parent = [p if p < u else -1 for u, p in enumerate(parent)]
    weight = rng.integers(1, 9, size=n).tolist()
    budget = int(rng.integers(max(weight), 3 * max(weight) + 1))
    up = np.array(parent, np.int64)
    ul = np.array(weight, np.int32)
    ud = np.zeros(n, np.int64)  # additive weights: no replay (replay=False), no context (dup=False)
    want = _brute_min_pieces(parent, weight, budget)
    for impl in (level1, partition_ref):
        cut, resid, bad = impl.cut_pieces(up, ul, ud, 1 << 20, np.full(n, budget, np.int64), False, False,
                                          np.zeros(n, np.bool_))
        assert bad == -1
        roots = np.asarray(impl.piece_roots(up, cut))
        pieces = np.unique(roots)
        assert pieces.shape[0] == want, impl.__name__
        for p in pieces:
            assert ul[roots == p].sum() <= budget


@pytest.mark.parametrize("seed", range(8))
def test_partition_cuts_token_trees_into_the_fewest_pieces(seed):
    """C = 1: every depth is chunk-aligned, so any edge of the token tree may be cut for free."""
    rng = np.random.default_rng(seed)
    f = make_forest(*random_trajs(rng, 2, 3, 7, vocab=3))
    if f.unique_tokens > 13:
        f = make_forest(*random_trajs(np.random.default_rng(seed + 100), 1, 3, 6, vocab=3))
    parent = []
    for s in range(f.num_segments):
        p = int(f.seg_parent[s])
        for o in range(int(f.seg_length[s])):
            if o > 0:
                parent.append(len(parent) - 1)
            elif p < 0:
                parent.append(-1)
            else:
                parent.append(int(f.seg_offset[p] + f.seg_length[p] - 1))
    budget = int(rng.integers(2, 6))
    cfg = PlanConfig(world_size=1, microbatch_tokens=budget, chunk_size=1, memory_tokens=1000)
    _, report = partition_with_report(f, cfg)
    assert report.pieces == _brute_min_pieces(parent, [1] * len(parent), budget)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dup,replay", [(False, True), (True, True), (False, False)], ids=["window", "dup", "noreplay"])
def test_cut_pieces_numba_matches_reference(seed, dup, replay):
    f = random_forest(seed, max_len=50)
    units = level1.build_units(f.seg_parent, f.seg_length, f.seg_depth, 8)
    _, _, unit_len, unit_depth, unit_parent = units
    budget = 64 if dup else 24
    rng = np.random.default_rng(seed)
    U = unit_parent.shape[0]
    for force in (np.zeros(U, np.bool_), (unit_parent >= 0) & (rng.random(U) < 0.2)):
        caps = np.full(U, budget, np.int64)
        got = level1.cut_pieces(unit_parent, unit_len, unit_depth, 8, caps, dup, replay, force)
        want = partition_ref.cut_pieces(unit_parent, unit_len, unit_depth, 8, caps, dup, replay, force)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert got[2] == want[2]
        assert got[0][force].all(), "a forced unit that does not root a piece"


# Bin packing and placement kernels.
def test_first_fit_decreasing_matches_reference_and_first_fit_rule():
    rng = np.random.default_rng(3)
    sizes, group_off, caps = [], [0], []
    for g in range(5):
        cap = int(rng.integers(10, 40))
        items = sorted(rng.integers(1, cap + 1, size=int(rng.integers(1, 30))).tolist(), reverse=True)
        sizes += items
        group_off.append(len(sizes))
        caps.append(cap)
    opens = np.zeros(len(sizes), np.bool_)
    args = (np.array(sizes, np.int64), np.array(group_off, np.int64), np.array(caps, np.int64), opens)
    got, nb = level1.first_fit_decreasing(*args)
    want, nb_ref = partition_ref.first_fit_decreasing(*args)
    np.testing.assert_array_equal(got, want)
    assert nb == nb_ref
    # items that open their own bin (window-group roots) never share one with each other
    opens[group_off[0] : group_off[0] + 3] = True
    got2, _ = level1.first_fit_decreasing(*args)
    np.testing.assert_array_equal(got2, partition_ref.first_fit_decreasing(*args)[0])
    assert len(set(got2[:3].tolist())) == 3
    for g in range(5):
        sl = slice(group_off[g], group_off[g + 1])
        load = np.bincount(got[sl], weights=np.array(sizes[sl]))
        used = load[load > 0]
        assert (used <= caps[g]).all()
        # first fit never leaves two bins that could be merged at most half full
        assert (used <= caps[g] / 2).sum() <= 1
    assert len(set(got[group_off[0] : group_off[1]]) & set(got[group_off[1] : group_off[2]])) == 0


def test_lpt_matches_reference_and_bound():
    rng = np.random.default_rng(4)
    costs = np.sort(rng.integers(1, 100, size=60).astype(np.float64))[::-1].copy()
    r1, l1 = level2.lpt_place(costs, 7)
    r2, l2 = partition_ref.lpt_place(costs, 7)
    np.testing.assert_array_equal(r1, r2)
    np.testing.assert_allclose(l1, l2)
    # Graham's bound for LPT: max load <= 4/3 OPT, and OPT >= mean load, OPT >= largest item
    opt_lb = max(costs.sum() / 7, costs.max())
    assert l1.max() <= 4 / 3 * opt_lb + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_order_and_live_stack_match_reference(seed):
    rng = np.random.default_rng(seed)
    M, W = 40, 3
    parent = np.array([-1] + [int(rng.integers(-1, m)) for m in range(1, M)], np.int64)
    shared = (parent >= 0) & (rng.random(M) < 0.7)
    rank = np.array([0] * M, np.int64)
    for m in range(M):  # a window child runs on its parent's rank
        rank[m] = rank[parent[m]] if shared[m] else rng.integers(W)
    rows = rng.integers(1, 50, size=M).astype(np.int64)
    cost = np.where(rng.random(M) < 0.5, rows, rows // 3)
    for got, want in zip(level2.dfs_order(parent, shared, rank, W), partition_ref.dfs_order(parent, shared, rank, W)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(level2.live_stack(parent, shared, rows, cost), partition_ref.live_stack(parent, shared, rows, cost)):
        np.testing.assert_array_equal(got, want)
    groups = level2.window_groups(parent, shared)
    np.testing.assert_array_equal(groups, partition_ref.window_groups(parent, shared))
    sub = level2.subtree_costs(parent, shared, rows)
    np.testing.assert_allclose(sub, partition_ref.subtree_costs(parent, shared, rows))
    roots = np.flatnonzero(groups == np.arange(M))
    np.testing.assert_allclose(sub[roots], np.bincount(groups, weights=rows)[roots])


@pytest.mark.parametrize("seed", range(4))
def test_context_costs_match_reference(seed):
    f = random_forest(seed, max_len=50)
    _, _, unit_len, unit_depth, unit_parent = level1.build_units(f.seg_parent, f.seg_length, f.seg_depth, 4)
    rng = np.random.default_rng(seed)
    U = unit_parent.shape[0]
    M = 6
    roots_sel = np.sort(rng.choice(U, size=min(U, 18), replace=False))
    mb_of = rng.integers(0, M, size=roots_sel.shape[0])
    order = np.argsort(mb_of, kind="stable")
    roots = roots_sel[order].astype(np.int64)
    roots_off = np.r_[0, np.cumsum(np.bincount(mb_of, minlength=M))].astype(np.int64)
    args = (roots_off, roots, unit_parent, unit_len, unit_depth, 4, True)
    for got, want in zip(level2.context_cost(*args), partition_ref.context_cost(*args)):
        np.testing.assert_array_equal(got, want)


# The whole partitioner.
def _check_partition(f: Forest, cfg: PlanConfig, part, report) -> None:
    mbs = part.microbatches
    M = len(mbs)
    assert report.rows.shape == (M,)
    assert (report.rows <= cfg.microbatch_tokens).all(), "a microbatch over budget B"
    # every distinct token kept exactly once
    covered = np.zeros(f.unique_tokens, np.int64)
    for m, spec in enumerate(mbs):
        assert spec.ranges.ndim == 2 and spec.ranges.shape[1] == 3
        for s, a, b in spec.ranges.tolist():
            assert 0 <= a < b <= f.seg_length[s]
            if a > 0:
                assert (f.seg_depth[s] + a) % cfg.chunk_size == 0, "segment split at an unaligned depth"
            covered[f.seg_offset[s] + a : f.seg_offset[s] + b] += 1
        assert report.kept[m] == (spec.ranges[:, 2] - spec.ranges[:, 1]).sum()
        assert 0 <= spec.rank < cfg.world_size
        if spec.parent >= 0:
            assert spec.parent < m
            if spec.shared:
                assert mbs[spec.parent].rank == spec.rank, "a window group split across ranks"
        if not cfg.windows:
            assert not spec.shared
    assert (covered == 1).all()
    # piece roots of a microbatch hang below its own rows or its parent microbatch's (kept or
    # duplicated by placement), or start at forest roots
    local = [set() for _ in mbs]
    for m, spec in enumerate(mbs):
        for s, a, b in spec.ranges.tolist() + spec.dup_ranges.tolist():
            local[m].update((s, o) for o in range(a, b))
    for m, spec in enumerate(mbs):
        for s, a, _ in spec.ranges.tolist() + spec.dup_ranges.tolist():
            if a > 0:
                prev = (s, a - 1)
            elif f.seg_parent[s] >= 0:
                p = int(f.seg_parent[s])
                prev = (p, int(f.seg_length[p]) - 1)
            else:
                continue
            assert prev in local[m] or (spec.parent >= 0 and prev in local[spec.parent]), f"microbatch {m}: a piece hangs below another microbatch"
        for s, a, b in spec.dup_ranges.tolist():  # duplicated rows are kept on another rank
            for o in range(a, b):
                keeper = next(q for q, sp in enumerate(mbs) if any(x == s and y <= o < z for x, y, z in sp.ranges.tolist()))
                assert mbs[keeper].rank != spec.rank, "a rank duplicates a token it keeps"
    # execution order: each microbatch forwarded and backwarded once on its rank, depth-first
    assert len(part.rank_steps) == cfg.world_size
    for r, steps in enumerate(part.rank_steps):
        stack: list[int] = []
        for kind, m in steps:
            assert mbs[m].rank == r
            if kind == "F":
                if mbs[m].parent >= 0 and mbs[m].shared:
                    assert stack and stack[-1] == mbs[m].parent, "a window child outside its parent's window"
                stack.append(m)
            else:
                assert stack and stack[-1] == m
                stack.pop()
        assert not stack
    seen = sorted(m for steps in part.rank_steps for kind, m in steps if kind == "F")
    assert seen == list(range(M))
    assert report.peak_live <= cfg.memory_bytes


CASES = [
    dict(world_size=1, microbatch_tokens=64, chunk_size=8),
    dict(world_size=6, microbatch_tokens=24, chunk_size=4, memory_tokens=30),
    dict(world_size=3, microbatch_tokens=32, chunk_size=8),
    dict(world_size=2, microbatch_tokens=48, chunk_size=16, windows=False),
    dict(world_size=4, microbatch_tokens=16, chunk_size=4, replay=False),
    dict(world_size=2, microbatch_tokens=40, chunk_size=8, memory_tokens=40),
]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k[:3]}{int(v)}" for k, v in kw.items()))
def test_partition_numba_matches_reference_and_invariants(seed, kw):
    f = random_forest(seed, n_trees=4, per_tree=8, max_len=40)
    cfg = PlanConfig(**kw)
    try:
        part, report = partition_with_report(f, cfg)
    except PlanningError:
        with pytest.raises(PlanningError):
            partition_with_report(f, cfg, impl="ref")
        return
    ref, ref_report = partition_with_report(f, cfg, impl="ref")
    assert part.rank_steps == ref.rank_steps
    for a, b in zip(part.microbatches, ref.microbatches, strict=True):
        np.testing.assert_array_equal(a.ranges, b.ranges)
        assert (a.parent, a.shared, a.rank, a.recompute) == (b.parent, b.shared, b.rank, b.recompute)
    np.testing.assert_array_equal(report.rows, ref_report.rows)
    np.testing.assert_array_equal(report.exports, ref_report.exports)
    np.testing.assert_array_equal(report.live, ref_report.live)
    for a, b in zip(part.microbatches, ref.microbatches):
        np.testing.assert_array_equal(a.dup_ranges, b.dup_ranges)
    _check_partition(f, cfg, part, report)


def test_small_trees_are_packed_whole_and_balanced():
    rng = np.random.default_rng(7)
    f = make_forest(*random_trajs(rng, 40, 4, 30))
    cfg = PlanConfig(world_size=4, microbatch_tokens=512, chunk_size=8)
    part, report = partition_with_report(f, cfg)
    assert all(spec.parent < 0 for spec in part.microbatches), "a tree that fits B was cut"
    top = np.arange(f.num_segments)
    for s in range(f.num_segments):  # root segment of every segment (preorder)
        if f.seg_parent[s] >= 0:
            top[s] = top[f.seg_parent[s]]
    owner = {}
    for m, spec in enumerate(part.microbatches):  # each rooted subtree lies in one microbatch
        for s in spec.ranges[:, 0].tolist():
            assert owner.setdefault(int(top[s]), m) == m
    # W = 4: the root bins are re-packed into a multiple of W microbatches of about equal size
    assert len(part.microbatches) % 4 == 0
    assert report.imbalance <= 1.05
    _check_partition(f, cfg, part, report)
    # W = 1: plain first fit decreasing, within its 11/9 OPT + 1 bound (OPT >= total / B)
    one = PlanConfig(world_size=1, microbatch_tokens=512, chunk_size=8)
    part1, report1 = partition_with_report(f, one)
    assert report1.rows.sum() == report.rows.sum()
    assert len(part1.microbatches) <= 11 / 9 * np.ceil(report1.rows.sum() / 512) + 1
    assert len(part1.microbatches) < len(part.microbatches)


def test_long_segment_is_split_at_chunk_boundaries_into_a_window_chain():
    f = make_forest([list(range(100))])
    cfg = PlanConfig(world_size=1, microbatch_tokens=32, chunk_size=8, memory_tokens=4096)
    part, report = partition_with_report(f, cfg)
    assert len(part.microbatches) == 4  # ceil(100 / 32)
    # bottom-up greedy: the pieces fill from the leaf end
    assert [spec.ranges.tolist() for spec in part.microbatches] == [[[0, 0, 8]], [[0, 8, 40]], [[0, 40, 72]], [[0, 72, 100]]]
    assert [spec.parent for spec in part.microbatches] == [-1, 0, 1, 2]
    assert all(spec.shared for spec in part.microbatches[1:])
    assert part.rank_steps[0] == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 3), ("B", 2), ("B", 1), ("B", 0)]
    _check_partition(f, cfg, part, report)


def test_replay_rows_count_against_the_budget():
    # prefix of 7 then 5 branches of 9 tokens, C = 8: every extra branch replays 7 rows
    trajs = [list(range(7)) + [100 + b] * 9 for b in range(5)]
    f = make_forest(trajs)
    whole = 7 + 5 * 9 + 4 * 7
    part, report = partition_with_report(f, PlanConfig(microbatch_tokens=whole, chunk_size=8))
    assert len(part.microbatches) == 1 and report.rows[0] == whole
    part, report = partition_with_report(f, PlanConfig(microbatch_tokens=whole - 1, chunk_size=8))
    assert len(part.microbatches) == 2
    assert (report.rows <= whole - 1).all()


def test_no_windows_duplicates_every_edge_and_rejects_long_trajectories():
    trajs = [list(range(20)) + [100 + b] * 30 for b in range(6)]
    f = make_forest(trajs)
    cfg = PlanConfig(world_size=2, microbatch_tokens=64, chunk_size=8, windows=False)
    part, report = partition_with_report(f, cfg)
    children = [spec for spec in part.microbatches if spec.parent >= 0]
    assert children and not any(spec.shared for spec in children)
    assert (report.duplicated[[m for m, s in enumerate(part.microbatches) if s.parent >= 0]] >= 20).all()
    _check_partition(f, cfg, part, report)
    with pytest.raises(PlanningError, match=r"trajectory 't0' has 50 tokens.*raise microbatch_tokens to >= 50 or enable windows"):
        partition(f, PlanConfig(microbatch_tokens=48, chunk_size=8, windows=False))


def test_short_prefix_is_duplicated_instead_of_shared():
    # a 3-token prefix below 4 large branches: cut edges carry a prefix < C -> duplicated
    trajs = [[1, 2, 3] + [10 + b] * 60 for b in range(4)]
    f = make_forest(trajs)
    part, report = partition_with_report(f, PlanConfig(world_size=1, microbatch_tokens=128, chunk_size=8))
    children = [spec for spec in part.microbatches if spec.parent >= 0]
    assert children and not any(spec.shared for spec in children)
    # a long prefix is shared through a window
    trajs = [list(range(200, 300)) + [10 + b] * 60 for b in range(4)]
    f = make_forest(trajs)
    part, _ = partition_with_report(f, PlanConfig(world_size=1, microbatch_tokens=128, chunk_size=8))
    assert any(spec.shared for spec in part.microbatches)


def test_memory_budget_marks_recompute_then_duplicates():
    # a 30-token prompt (parent window, 60 rows with one branch) and 3 cut-off 30-token branches,
    # each 36 rows with its 6 replay rows: stack = 60 + 36; recomputation keeps only the 30 exports
    trajs = [list(range(30)) + [1000 + b] * 30 for b in range(4)]
    f = make_forest(trajs)

    def run(memory):  # row-counting sizes: a computed row and an exported ATTN row are one unit each
        cfg = PlanConfig(world_size=1, microbatch_tokens=64, chunk_size=8, memory_tokens=memory, row_sizes=RowSizes.rows())
        part, report = partition_with_report(f, cfg)
        _check_partition(f, cfg, part, report)
        kids = [spec for spec in part.microbatches if spec.parent >= 0]
        assert len(kids) == 3
        return part, kids, report

    part, kids, report = run(10_000)
    assert all(k.shared for k in kids) and not any(s.recompute for s in part.microbatches)
    assert report.peak_live == 96
    part, kids, report = run(90)
    assert all(k.shared for k in kids) and part.microbatches[0].recompute
    assert report.peak_live == 30 + 36
    part, kids, report = run(64)
    assert not any(k.shared for k in kids) and not any(s.recompute for s in part.microbatches)
    assert report.peak_live == 60
    # a chain of windows over one 300-token trajectory cannot fit M = 128, nor be duplicated
    deep = make_forest([list(range(300))])
    with pytest.raises(PlanningError, match=r"memory_tokens: microbatch \d+ holds \d+ bytes .* raise memory_tokens to >= "):
        partition(deep, PlanConfig(microbatch_tokens=64, chunk_size=8, memory_tokens=128, row_sizes=RowSizes.rows()))


def test_open_windows_keep_their_checkpointed_rows_only():
    # the forest above: a 60-row parent window and 36-row children. Under activation checkpointing a
    # row keeps 1 byte from forward to backward and holds 1 more while its backward recomputes: the
    # open parent keeps 60, the running child holds 72, 132 bytes = 66 rows of 2 bytes, no recompute
    trajs = [list(range(30)) + [1000 + b] * 30 for b in range(4)]
    f = make_forest(trajs)
    sizes = RowSizes(activation_row_bytes=1, attn_row_bytes=1, conv_row_bytes=0, kernel_row_bytes=0, state_bytes=0,
                     recompute_row_bytes=1)
    for memory, recompute in ((66, False), (65, True)):
        cfg = PlanConfig(world_size=1, microbatch_tokens=64, chunk_size=8, memory_tokens=memory, row_sizes=sizes)
        part, report = partition_with_report(f, cfg)
        _check_partition(f, cfg, part, report)
        assert all(s.shared for s in part.microbatches if s.parent >= 0)
        assert part.microbatches[0].recompute == recompute
        assert report.peak_live == (120 if recompute else 60 + 72)  # the parent running alone: 60 x 2


def test_heavy_window_group_is_split_for_balance():
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 50, size=40).tolist()
    trajs = [prompt + rng.integers(0, 50, size=100).tolist() for _ in range(16)]
    f = make_forest(trajs)
    cfg = PlanConfig(world_size=4, microbatch_tokens=256, chunk_size=8)
    part, report = partition_with_report(f, cfg)
    assert len({spec.rank for spec in part.microbatches}) == 4
    assert report.imbalance <= 1.35
    _check_partition(f, cfg, part, report)


def test_expand_forest_gives_each_trajectory_its_own_tree():
    f = random_forest(5)
    e = expand_forest(f)
    e.check()
    assert e.unique_tokens == f.expanded_tokens == e.expanded_tokens
    for t in range(f.num_trajectories):
        np.testing.assert_array_equal(e.path_tokens(t), f.path_tokens(t))
        assert e.path(t) == [t]


def test_empty_forest():
    f = make_forest([])
    part = partition(f, PlanConfig(world_size=2))
    assert part.microbatches == [] and part.rank_steps == [[], []]


def test_more_ranks_than_microbatches_leaves_ranks_idle():
    # Two trajectories share 3 tokens: kept together one rank computes 8 rows plus 3 replay rows;
    # the longest trajectory alone is 6 rows, so placement duplicates the prefix on a second rank
    # (6 and 5 rows: the makespan's lower bound) and leaves the other 6 ranks idle.
    f = make_forest([[1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9]])
    cfg = PlanConfig(world_size=8, microbatch_tokens=64, chunk_size=4)
    part, report = partition_with_report(f, cfg)
    assert len(part.microbatches) == 2
    assert sum(1 for steps in part.rank_steps if steps) == 2
    assert sorted(report.rows.tolist()) == [5, 6] and report.lower_bound == 6
    _check_partition(f, cfg, part, report)


@pytest.mark.parametrize("seed", range(8))
def test_memory_error_names_a_sufficient_budget(seed):
    f = random_forest(seed, n_trees=2, per_tree=6, max_len=60)
    cfg = PlanConfig(world_size=1, microbatch_tokens=16, chunk_size=4, memory_tokens=16)
    try:
        partition(f, cfg)
    except PlanningError as exc:
        need = int(re.search(r"raise memory_tokens to >= (\d+)", str(exc)).group(1))
        roomy = PlanConfig(world_size=1, microbatch_tokens=16, chunk_size=4, memory_tokens=need)
        part, report = partition_with_report(f, roomy)
        _check_partition(f, roomy, part, report)
    else:
        pytest.skip("fits without an error")


def test_window_groups_of_big_trees_stay_apart_when_that_balances_ranks():
    # 4 trees: a 12-token prompt, two 40-token branches (cut off into windows: 44 rows each with
    # replay, too big to duplicate their prompt) and one 3-token branch kept with the prompt
    trajs, trees = [], []
    for t in range(4):
        prompt = [t * 100 + i for i in range(12)]
        for b, n in enumerate((40, 40, 3)):
            trajs.append(prompt + [t * 100 + 50 + b] * n)
            trees.append(f"task{t}")
    f = make_forest(trajs, trees)
    cfg = PlanConfig(world_size=4, microbatch_tokens=48, chunk_size=8)
    part, report = partition_with_report(f, cfg)
    _check_partition(f, cfg, part, report)
    assert all(spec.shared for spec in part.microbatches if spec.parent >= 0)
    assert report.imbalance == pytest.approx(1.0)
    for r in range(4):  # one whole tree per rank
        segs = [s for spec in part.microbatches if spec.rank == r for s in spec.ranges[:, 0].tolist()]
        assert len({int(f.seg_tree[s]) for s in segs}) == 1
    # one rank: the root pieces share microbatches (15 rows each, three per bin)
    part1, _ = partition_with_report(f, PlanConfig(world_size=1, microbatch_tokens=48, chunk_size=8))
    assert len(part1.microbatches) == len(part.microbatches) - 2


def test_balance_bins_matches_reference_and_balances_within_the_cap():
    rng = np.random.default_rng(11)
    changed = 0
    for _ in range(40):
        G = int(rng.integers(1, 5))
        sizes, offs = [], [0]
        for _ in range(G):
            n = int(rng.integers(0, 9))
            sizes += sorted(rng.integers(1, 40, n).tolist(), reverse=True)
            offs.append(offs[-1] + n)
        sizes, group_off = np.array(sizes, np.int64), np.array(offs, np.int64)
        cap = int(rng.integers(40, 90))
        ffd, _ = level1.first_fit_decreasing(sizes, group_off, np.full(G, cap, np.int64), np.zeros(sizes.shape[0], np.bool_))
        got = level1.balance_bins(sizes, group_off, ffd, cap)
        np.testing.assert_array_equal(got, partition_ref.balance_bins(sizes, group_off, ffd, cap))
        changed += int((got != ffd).any())
        for g in range(G):
            a, b = group_off[g], group_off[g + 1]
            if b == a:
                continue
            assert sorted(set(got[a:b].tolist())) == sorted(set(ffd[a:b].tolist())), "the same bins"
            load = np.bincount(got[a:b] - got[a:b].min(), weights=sizes[a:b])
            assert load.max() <= cap
            ffd_load = np.bincount(ffd[a:b] - ffd[a:b].min(), weights=sizes[a:b])
            assert load.max() <= ffd_load.max(), "never a larger largest bin than first fit's"
    assert changed, "some groups are rebalanced"
