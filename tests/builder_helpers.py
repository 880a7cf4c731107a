"""Test helpers for the plan builder: a plain trie from trajectories to a Forest, random batches.

Kept independent of `planner_service.ingest` so the builder tests do not depend on ingestion.
"""
from __future__ import annotations

import numpy as np

from planner_service.forest import Forest
from planner_service.planner import lockstep, lockstep_ref
from planner_service.planner.spec import MicrobatchSpec, Partition


def forest_from_trajectories(
    trajs: list[list[int]],
    *,
    tree_of: list[str] | None = None,
    loss_masks: list[list[int]] | None = None,
    vocab_size: int = 1000,
    seed: int = 0,
    with_logprobs: bool = True,
) -> Forest:
    """Radix forest of `trajs` (one trie per tree id), segments in depth-first preorder."""
    rng = np.random.default_rng(seed)
    tree_of = tree_of or [""] * len(trajs)
    tree_ids = sorted(set(tree_of))
    # Trie node: [token, children dict, ends]
    roots = {t: {} for t in tree_ids}
    end_node = []
    for traj, tree in zip(trajs, tree_of):
        assert len(traj) >= 1
        level = roots[tree]
        node = None
        for tok in traj:
            if tok not in level:
                level[tok] = {"kids": {}, "ends": 0, "tok": tok}
            node = level[tok]
            level = node["kids"]
        node["ends"] += 1
        end_node.append(node)
    seg_parent, seg_depth, seg_len, seg_tree, tokens = [], [], [], [], []
    seg_of_node: dict[int, int] = {}

    def walk(node, parent_seg, depth, tree_idx):
        # Start a segment at `node`, extend while single child and no trajectory ends.
        s = len(seg_parent)
        seg_parent.append(parent_seg)
        seg_depth.append(depth)
        seg_tree.append(tree_idx)
        n = 0
        cur = node
        while True:
            tokens.append(cur["tok"])
            n += 1
            if cur["ends"] or len(cur["kids"]) != 1:
                break
            cur = next(iter(cur["kids"].values()))
        seg_len.append(n)
        seg_of_node[id(cur)] = s
        for tok in sorted(cur["kids"]):
            walk(cur["kids"][tok], s, depth + n, tree_idx)

    for ti, tree in enumerate(tree_ids):
        for tok in sorted(roots[tree]):
            walk(roots[tree][tok], -1, 0, ti)
    S = len(seg_parent)
    seg_length = np.array(seg_len, np.int32)
    seg_offset = np.concatenate([[0], np.cumsum(seg_length)[:-1]]).astype(np.int64) if S else np.zeros(0, np.int64)
    lengths = [len(t) for t in trajs]
    traj_offset = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n_e = int(traj_offset[-1])
    if loss_masks is None:
        loss_mask = (rng.random(n_e) < 0.6).astype(np.uint8)
    else:
        loss_mask = np.concatenate([np.asarray(m, np.uint8) for m in loss_masks])
    forest = Forest(
        batch_id="test",
        vocab_size=vocab_size,
        tokens=np.array(tokens, np.int32),
        seg_parent=np.array(seg_parent, np.int32),
        seg_offset=seg_offset,
        seg_length=seg_length,
        seg_depth=np.array(seg_depth, np.int32),
        seg_tree=np.array(seg_tree, np.int32),
        tree_ids=tree_ids,
        traj_ids=[f"t{i}" for i in range(len(trajs))],
        traj_seg=np.array([seg_of_node[id(n)] for n in end_node], np.int32),
        traj_offset=traj_offset,
        loss_mask=loss_mask,
        advantages=rng.standard_normal(n_e).astype(np.float32),
        old_logprobs=(-rng.random(n_e)).astype(np.float32) if with_logprobs else None,
        ref_logprobs=None,
        reward=rng.standard_normal(len(trajs)).astype(np.float32),
        weight=np.ones(len(trajs), np.float32),
        group_ids=[""] * len(trajs),
    )
    forest.check()
    return forest


def random_trajectories(
    rng: np.random.Generator, *, n: int, max_len: int, vocab: int = 50, trees: int = 1, chunk: int = 8
) -> tuple[list[list[int]], list[str]]:
    """Trajectories that branch from earlier ones at random (often chunk-aligned) depths."""
    trajs: list[list[int]] = []
    tree_of: list[str] = []
    for i in range(n):
        tree = f"tree{rng.integers(trees)}"
        same = [j for j in range(len(trajs)) if tree_of[j] == tree]
        if same and rng.random() < 0.85:
            base = trajs[same[rng.integers(len(same))]]
            if rng.random() < 0.3:
                cut = int(min(len(base), chunk * rng.integers(0, len(base) // chunk + 1)))
            else:
                cut = int(rng.integers(0, len(base) + 1))
            prefix = base[:cut]
        else:
            prefix = []
        extra = int(rng.integers(0 if prefix else 1, max(2, max_len - len(prefix)) + 1))
        if rng.random() < 0.1 and prefix:
            extra = 0  # a trajectory that ends inside the tree
        t = prefix + [int(x) for x in rng.integers(0, vocab, extra)]
        if not t:
            t = [int(rng.integers(vocab))]
        trajs.append(t)
        tree_of.append(tree)
    return trajs, tree_of


def random_partition(forest: Forest, rng: np.random.Generator, *, chunk: int, world_size: int = 1,
                     windows: bool = True, cut_prob: float = 0.3, merge_prob: float = 0.5):
    """A random valid Partition: forest cut into connected pieces at segment starts and at
    chunk-aligned depths inside segments; sibling pieces sometimes share a microbatch; edges shared
    or duplicated at random; a window group stays on one rank. rank_steps left empty (default order)."""
    units = []  # (segment, start offset, end offset, parent unit)
    last_unit = {}
    for s in range(forest.num_segments):
        d, n = int(forest.seg_depth[s]), int(forest.seg_length[s])
        cuts = [o for o in range(1, n) if (d + o) % chunk == 0 and rng.random() < cut_prob]
        bounds = [0] + cuts + [n]
        p = last_unit.get(int(forest.seg_parent[s]), -1)
        for a, b in zip(bounds[:-1], bounds[1:]):
            units.append((s, a, b, p))
            p = len(units) - 1
        last_unit[s] = p
    piece_of = []
    piece_parent = []
    for u, (s, a, b, p) in enumerate(units):
        if p < 0 or rng.random() < cut_prob:
            piece_of.append(len(piece_parent))
            piece_parent.append(piece_of[p] if p >= 0 else -1)
        else:
            piece_of.append(piece_of[p])
    # Group pieces into microbatches: sibling pieces (same parent piece) may merge.
    mb_of_piece = [-1] * len(piece_parent)
    mb_parent: list[int] = []
    group_by_parent: dict[int, int] = {}
    for q, pp in enumerate(piece_parent):
        parent_mb = mb_of_piece[pp] if pp >= 0 else -1
        key = pp
        if key in group_by_parent and rng.random() < merge_prob:
            mb_of_piece[q] = group_by_parent[key]
        else:
            mb_of_piece[q] = len(mb_parent)
            mb_parent.append(parent_mb)
            group_by_parent[key] = mb_of_piece[q]
    ranges: list[list] = [[] for _ in mb_parent]
    for u, (s, a, b, _) in enumerate(units):
        ranges[mb_of_piece[piece_of[u]]].append((s, a, b))
    specs = []
    for m, pm in enumerate(mb_parent):
        shared = bool(windows and pm >= 0 and rng.random() < 0.6)
        rank = specs[pm].rank if shared else int(rng.integers(world_size))
        specs.append(MicrobatchSpec(ranges=np.array(ranges[m], np.int64).reshape(-1, 3), parent=pm, shared=shared,
                                    rank=rank, recompute=bool(rng.random() < 0.2)))
    return Partition(microbatches=specs, rank_steps=[])


def random_window_forest(rng: np.random.Generator, M: int, W: int, *, crossing: bool = False):
    """Random window forests of M microbatches on W ranks for the lock-step aligner (ids
    topological): a window parent on the same rank, or, with `crossing`, on any rank. Returns
    (mb_rank, wparent, cost, forced, full, win, exports, budget, priority): forced windows are
    recomputed and live as their exports, the others as their full activations; the budget is
    1-3x the deepest same-rank window stack (the partitioner keeps that stack within M); priority
    ties are broken by id."""
    mb_rank = rng.integers(0, W, M).astype(np.int64)
    wparent = np.full(M, -1, np.int64)
    for m in range(1, M):
        if crossing:
            if rng.random() < 0.7:
                wparent[m] = int(rng.integers(0, m))
            continue
        same = np.flatnonzero(mb_rank[:m] == mb_rank[m])
        if same.shape[0] and rng.random() < 0.7:
            wparent[m] = int(rng.choice(same))
    cost = rng.integers(1, 60, M).astype(np.float64)
    full = (cost * 10).astype(np.int64)
    exports = rng.integers(0, 20, M).astype(np.int64)
    forced = (rng.random(M) < 0.2) & np.isin(np.arange(M), wparent)
    win = np.where(forced, exports, full)
    local = np.where((wparent >= 0) & (mb_rank[np.maximum(wparent, 0)] == mb_rank), wparent, -1)
    need = full.copy()  # the live bytes of each same-rank window subtree's deepest stack
    for m in range(M - 1, -1, -1):
        if local[m] >= 0:
            need[local[m]] = max(need[local[m]], win[local[m]] + need[m])
    budget = int(need.max() * rng.uniform(1.0, 3.0))
    priority = rng.integers(0, 5, M).astype(np.float64)
    return mb_rank, wparent, cost, forced, full, win, exports, budget, priority


def aligned_by_both(args: tuple):
    """`lockstep.align_phases(*args)` after checking that its plain-Python twin gives the same
    phases, steps, voluntary recomputes and makespan."""
    got, want = lockstep.align_phases(*args), lockstep_ref.align_phases_ref(*args)
    for a, b in zip(got[:4], want[:4]):
        np.testing.assert_array_equal(a, b)
    assert got[4] == want[4]
    return got
