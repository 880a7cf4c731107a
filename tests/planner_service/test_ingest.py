"""planner_service.ingest: prefix forests against an independent oracle, Numba vs reference,
explicit form vs flat form, JSON vs protobuf.

The oracle never looks at the builders: it rebuilds every trajectory from the forest
(`Forest.path_tokens`), counts distinct tokens as distinct (tree, prefix) pairs and segments as
radix-tree nodes (prefixes where a trajectory ends or the continuations are not exactly one).
"""
from __future__ import annotations

import copy
import json
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner_service.forest import Forest
from planner_service.ingest import forest_from_json, forest_from_proto, json_to_proto, proto_to_json, warmup
from planner_service.ingest.radix import radix_forest
from planner_service.ingest.radix_ref import radix_forest_reference

warmup()


def _assert_forests_equal(a: Forest, b: Forest) -> None:
    for name in Forest.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None, name
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


@st.composite
def trajectory_sets(draw, max_trees: int = 8, alphabet: int = 3):
    """(tree index, tokens) lists with shared prefixes, prefixes of others, duplicates, singletons."""
    n_trees = draw(st.integers(1, max_trees))
    base = draw(st.lists(st.tuples(st.integers(0, n_trees - 1),
                                   st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=9)),
                         min_size=1, max_size=14))
    out = list(base)
    for _ in range(draw(st.integers(0, 6))):
        tree, toks = out[draw(st.integers(0, len(out) - 1))]
        kind = draw(st.sampled_from(["prefix", "duplicate", "extend", "single"]))
        if kind == "prefix":
            toks = toks[: draw(st.integers(1, len(toks)))]
        elif kind == "extend":
            toks = toks[: draw(st.integers(1, len(toks)))] + draw(st.lists(st.integers(0, alphabet - 1), min_size=1, max_size=4))
        elif kind == "single":
            toks = toks[:1]
        out.insert(draw(st.integers(0, len(out))), (tree, list(toks)))
    return out


def _flat_doc(trajs, vocab: int = 4, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    items = []
    for i, (tree, toks) in enumerate(trajs):
        L = len(toks)
        items.append({"id": f"t{i}", "tree_id": f"tree-{tree}", "tokens": toks,
                      "loss_mask": rng.integers(0, 2, L).tolist(),
                      "old_logprobs": (-rng.random(L)).tolist(),
                      "advantage": float(rng.standard_normal()) if i % 2 else rng.standard_normal(L).tolist(),
                      "reward": float(i), "group_id": f"g{tree}", **({"weight": 0.5} if i % 3 == 0 else {})})
    return {"batch_id": "b", "vocab_size": vocab, "trajectories": items}


def _oracle(forest: Forest, trajs) -> None:
    """Independent checks of a forest built from (tree, tokens) trajectories."""
    forest.check()
    names = list(dict.fromkeys(f"tree-{tree}" for tree, _ in trajs))
    assert forest.tree_ids == names
    for t, (tree, toks) in enumerate(trajs):
        np.testing.assert_array_equal(forest.path_tokens(t), toks)
        assert forest.tree_ids[forest.seg_tree[forest.traj_seg[t]]] == f"tree-{tree}"
    prefixes = {(tree, tuple(toks[:i])) for tree, toks in trajs for i in range(1, len(toks) + 1)}
    assert forest.unique_tokens == len(prefixes)
    ends = {(tree, tuple(toks)) for tree, toks in trajs}
    nexts: dict = {}
    for tree, toks in trajs:
        for i in range(1, len(toks)):
            nexts.setdefault((tree, tuple(toks[:i])), set()).add(toks[i])
    radix_nodes = [p for p in prefixes if p in ends or len(nexts.get(p, ())) != 1]
    assert forest.num_segments == len(radix_nodes)
    assert forest.expanded_tokens == sum(len(toks) for _, toks in trajs)
    # Deterministic order: siblings (and roots of a tree) by first token, trees by first appearance.
    first = forest.tokens[forest.seg_offset]
    for s in range(forest.num_segments):
        sibs = np.flatnonzero((forest.seg_parent == forest.seg_parent[s]) & (forest.seg_tree == forest.seg_tree[s]))
        assert (np.diff(first[sibs]) > 0).all(), "siblings must start with distinct, increasing tokens"
    assert (np.diff(forest.seg_tree) >= 0).all()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectory_sets())
def test_flat_forest_matches_oracle_numba_and_reference(trajs):
    doc = _flat_doc(trajs)
    fast = forest_from_json(doc)
    _oracle(fast, trajs)
    _assert_forests_equal(fast, forest_from_json(doc, numba=False))
    # trajectory-space arrays are the submitted ones, concatenated in submission order
    items = doc["trajectories"]
    np.testing.assert_array_equal(fast.loss_mask, np.concatenate([it["loss_mask"] for it in items]))
    np.testing.assert_array_equal(fast.old_logprobs, np.concatenate([it["old_logprobs"] for it in items]).astype(np.float32))
    adv = [np.broadcast_to(np.float32(it["advantage"]), len(it["tokens"])) for it in items]
    np.testing.assert_array_equal(fast.advantages, np.concatenate(adv))
    np.testing.assert_array_equal(fast.weight, [0.5 if i % 3 == 0 else 1.0 for i in range(len(items))])
    assert fast.ref_logprobs is None
    assert fast.group_ids == [it["group_id"] for it in items]


@pytest.mark.parametrize("seed", range(6))
def test_radix_numba_equals_reference_on_random_inputs(seed):
    rng = np.random.default_rng(seed)
    T = int(rng.integers(50, 400))
    F = int(rng.integers(1, 6))
    pool = [rng.integers(0, 4, int(rng.integers(1, 60))) for _ in range(8)]
    trajs = []
    for _ in range(T):
        head = pool[int(rng.integers(len(pool)))]
        head = head[: int(rng.integers(1, len(head) + 1))]
        tail = rng.integers(0, 4 if seed % 2 else 1000, int(rng.integers(0, 30)))
        trajs.append(np.concatenate([head, tail]).astype(np.int32))
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in trajs])]).astype(np.int64)
    tokens = np.concatenate(trajs)
    tree = rng.integers(0, F, T).astype(np.int32)
    fast = radix_forest(tokens, offsets, tree, F)
    ref = radix_forest_reference(tokens, offsets, tree, F)
    for name in fast.__slots__:
        np.testing.assert_array_equal(getattr(fast, name), getattr(ref, name), err_msg=name)


def _explicit_doc_from(forest: Forest, flat_doc: dict, seed: int) -> dict:
    """The same content as an explicit-trees document: segments become nodes (shuffled, renamed)."""
    rng = random.Random(seed)
    S = forest.num_segments
    new_id = list(range(1000, 1000 + 3 * S, 3))
    rng.shuffle(new_id)
    trees = []
    for k, name in enumerate(forest.tree_ids):
        segs = [s for s in range(S) if forest.seg_tree[s] == k]
        rng.shuffle(segs)
        nodes = [{"id": new_id[s], "parent": None if forest.seg_parent[s] < 0 else new_id[forest.seg_parent[s]],
                  "tokens": forest.tokens[forest.seg_offset[s]: forest.seg_offset[s] + forest.seg_length[s]].tolist()}
                 for s in segs]
        trajs = []
        for t, item in enumerate(flat_doc["trajectories"]):
            if item["tree_id"] == name:
                obj = {k2: v for k2, v in item.items() if k2 not in ("tree_id", "tokens")}
                obj["node"] = new_id[forest.traj_seg[t]]
                trajs.append(obj)
        trees.append({"id": name, "nodes": nodes, "trajectories": trajs})
    return {"batch_id": flat_doc["batch_id"], "vocab_size": flat_doc["vocab_size"], "trees": trees}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectory_sets(), st.integers(0, 1000))
def test_explicit_form_equals_flat_form(trajs, seed):
    # explicit trees list their trajectories tree by tree: submit the flat ones grouped alike
    order = {tree: i for i, tree in enumerate(dict.fromkeys(tree for tree, _ in trajs))}
    trajs = sorted(trajs, key=lambda item: order[item[0]])
    flat_doc = _flat_doc(trajs)
    flat = forest_from_json(flat_doc)
    explicit = forest_from_json(_explicit_doc_from(flat, flat_doc, seed))
    explicit.check()
    _assert_forests_equal(flat, explicit)


def _mixed_doc() -> dict:
    doc = _flat_doc([(0, [1, 2, 3]), (0, [1, 2]), (1, [3, 3, 1, 0]), (0, [1, 2, 3, 0])])
    doc["trajectories"][1]["ref_logprobs"] = [0.0, -1.0]
    for item in doc["trajectories"]:
        item.setdefault("ref_logprobs", [-0.5] * len(item["tokens"]))
    doc["trees"] = [
        {"id": "explicit-a",
         "nodes": [{"id": 7, "parent": 3, "tokens": [2]}, {"id": 3, "tokens": [0, 1]}, {"id": -4, "parent": 3, "tokens": [2, 2]},
                   {"id": 9, "parent": None, "tokens": [0]}],
         "trajectories": [{"id": "x1", "node": 7, "advantage": 2.0, "old_logprobs": [0.0, 0.0, -1.0], "ref_logprobs": [0.0, 0.0, -2.0]},
                          {"id": "x2", "node": -4, "loss_mask": [0, 0, 1, 1], "advantage": [1, 2, 3, 4],
                           "old_logprobs": [0.0, 0.0, -1.0, -0.5], "ref_logprobs": [0.0, 0.0, -1.0, -0.25], "weight": 2.0},
                          {"id": "x3", "node": 3, "old_logprobs": [0.0, -0.1], "ref_logprobs": [0.0, 0.0]}]},
        {"id": "explicit-b", "nodes": [{"id": 0, "tokens": [3]}], "trajectories": []},
    ]
    return doc


def test_mixed_batch_layout():
    forest = forest_from_json(_mixed_doc())
    forest.check()
    assert forest.tree_ids == ["tree-0", "tree-1", "explicit-a", "explicit-b"]
    assert forest.traj_ids == ["t0", "t1", "t2", "t3", "x1", "x2", "x3"]
    np.testing.assert_array_equal(forest.path_tokens(4), [0, 1, 2])
    np.testing.assert_array_equal(forest.path_tokens(5), [0, 1, 2, 2])
    np.testing.assert_array_equal(forest.path_tokens(6), [0, 1])
    # siblings by (first token, id): node -4 [2, 2] before node 7 [2]; root 9 [0] is on no path: dropped
    a = forest.tree_ids.index("explicit-a")
    segs = np.flatnonzero(forest.seg_tree == a)
    seg_tokens = [forest.tokens[forest.seg_offset[s]: forest.seg_offset[s] + forest.seg_length[s]].tolist() for s in segs]
    assert seg_tokens == [[0, 1], [2, 2], [2]]
    x2 = slice(forest.traj_offset[5], forest.traj_offset[6])
    np.testing.assert_array_equal(forest.advantages[x2], [1, 2, 3, 4])
    np.testing.assert_array_equal(forest.loss_mask[x2], [0, 0, 1, 1])
    np.testing.assert_array_equal(forest.ref_logprobs[x2], [0, 0, -1, -0.25])
    assert forest.weight[5] == 2.0 and forest.reward[5] == 0.0
    assert forest.stats()["trees"] == 3  # explicit-b has no trajectory, so no segment


def test_explicit_nodes_on_no_trajectory_path_are_not_computed():
    doc = {"batch_id": "b", "vocab_size": 16, "trees": [{"id": "t", "nodes": [
        {"id": 0, "parent": None, "tokens": [1, 2]}, {"id": 1, "parent": 0, "tokens": [3]},
        {"id": 2, "parent": 0, "tokens": [4, 5, 6]}, {"id": 3, "parent": 2, "tokens": [7]}],
        "trajectories": [{"id": "a", "node": 1}]}]}
    for numba in (True, False):
        forest = forest_from_json(doc, numba=numba)
        forest.check()
        assert forest.unique_tokens == 3 and forest.num_segments == 2
        np.testing.assert_array_equal(forest.path_tokens(0), [1, 2, 3])


def test_json_and_proto_build_the_same_forest_and_round_trip():
    doc = _mixed_doc()
    batch = json_to_proto(doc)
    from_json = forest_from_json(doc)
    _assert_forests_equal(from_json, forest_from_proto(batch))
    _assert_forests_equal(from_json, forest_from_proto(batch.SerializeToString()))
    back = proto_to_json(batch)
    _assert_forests_equal(from_json, forest_from_json(back))
    assert json_to_proto(back) == batch
    assert "weight" not in back["trajectories"][1] and back["trajectories"][0]["weight"] == 0.5
    assert back["trees"][0]["nodes"][1]["parent"] is None


def test_json_text_and_bytes_inputs():
    doc = _mixed_doc()
    _assert_forests_equal(forest_from_json(doc), forest_from_json(json.dumps(doc)))
    _assert_forests_equal(forest_from_json(doc), forest_from_json(json.dumps(doc).encode()))


def test_defaults_without_optional_fields():
    forest = forest_from_json({"batch_id": "d", "vocab_size": 10, "trajectories": [{"id": "a", "tokens": [1, 2, 3]}]})
    assert forest.tree_ids == [""]
    np.testing.assert_array_equal(forest.loss_mask, [1, 1, 1])
    np.testing.assert_array_equal(forest.advantages, [0, 0, 0])
    assert forest.old_logprobs is None and forest.ref_logprobs is None
    np.testing.assert_array_equal(forest.weight, [1.0])
    assert forest.group_ids == [""]


def test_identical_duplicates_share_one_segment():
    forest = forest_from_json({"batch_id": "d", "vocab_size": 10,
                               "trajectories": [{"id": str(i), "tokens": [4, 5, 6]} for i in range(5)]})
    assert forest.num_segments == 1 and forest.unique_tokens == 3 and forest.expanded_tokens == 15
    assert forest.traj_seg.tolist() == [0] * 5
    assert forest.stats()["compression"] == 5.0


def test_trajectory_ending_inside_a_segment_splits_it():
    doc = {"batch_id": "d", "vocab_size": 10, "trajectories": [{"id": "long", "tokens": [1, 2, 3, 4]},
                                                                {"id": "short", "tokens": [1, 2]}]}
    forest = forest_from_json(doc)
    assert forest.seg_length.tolist() == [2, 2] and forest.seg_parent.tolist() == [-1, 0]
    assert forest.traj_seg.tolist() == [1, 0]


def test_larger_batch_is_deterministic_under_copy():
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 50, 300).tolist()
    trajs = [(i % 3, prefix[: rng.integers(1, 300)] + rng.integers(0, 50, rng.integers(1, 100)).tolist()) for i in range(60)]
    doc = _flat_doc(trajs, vocab=50)
    a = forest_from_json(doc)
    _oracle(a, trajs)
    _assert_forests_equal(a, forest_from_json(copy.deepcopy(doc)))
    _assert_forests_equal(a, forest_from_json(doc, numba=False))


def test_bench_forest_quick_smoke():
    from benchmarks import bench_forest

    out = bench_forest.run(quick=True)
    assert out["expanded_tokens"] == 16 * 4096 and out["unique_tokens"] == 2048 + 16 * 2048
    assert out["segments"] == 17
    for key in ("json_numba_s", "proto_numba_s", "json_python_s", "proto_python_s", "radix_numba_s", "radix_python_s"):
        assert out[key] > 0
