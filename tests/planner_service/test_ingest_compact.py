"""The compact explicit-tree form: per-position fields on the tree nodes (shared tokens sent once)
give the same Forest as the per-trajectory form, in JSON and protobuf, and bad node fields are
rejected naming the field."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from planner_service.errors import LimitError, ValidationError
from planner_service.ingest import Limits, forest_from_json, forest_from_proto, json_to_proto, proto_to_json
from proto.arrays import pack
from proto.harts.v1 import rollouts_pb2

NODES = [{"id": 0, "parent": None, "tokens": [5, 6, 7]}, {"id": 1, "parent": 0, "tokens": [8, 9]},
         {"id": 2, "parent": 1, "tokens": [3]}, {"id": 3, "parent": 0, "tokens": [4, 4]}, {"id": 9, "parent": 3, "tokens": [1]}]
MASK = {0: [0, 0, 0], 1: [1, 1], 2: [0], 3: [1, 0], 9: [1]}
OLD = {0: [0.0, 0.0, 0.0], 1: [-0.5, -0.25], 2: [0.0], 3: [-1.0, 0.0], 9: [-2.0]}
PATHS = {"a": [0, 1, 2], "b": [0, 3, 9], "c": [0, 1], "d": [0, 3, 9]}  # d repeats b's path


def _doc(compact: bool) -> dict:
    nodes = [dict(n, loss_mask=MASK[n["id"]], old_logprobs=OLD[n["id"]]) if compact else dict(n) for n in NODES]
    trajs = []
    for j, (tid, path) in enumerate(PATHS.items()):
        t = {"id": tid, "node": path[-1], "advantage": float(j) - 1.5, "reward": float(j % 2)}
        if not compact:
            t["loss_mask"] = [m for n in path for m in MASK[n]]
            t["old_logprobs"] = [x for n in path for x in OLD[n]]
        trajs.append(t)
    flat = [{"id": "f", "tokens": [5, 6, 7, 1], "loss_mask": [0, 0, 1, 1], "old_logprobs": [0, 0, -0.1, -0.2]}]
    return {"batch_id": "b", "vocab_size": 16, "trajectories": flat,
            "trees": [{"id": "t", "nodes": nodes, "trajectories": trajs}]}


def _same(a, b) -> None:
    assert a.traj_ids == b.traj_ids and a.unique_tokens == b.unique_tokens and a.expanded_tokens == b.expanded_tokens
    for name in ("tokens", "loss_mask", "advantages", "old_logprobs", "reward", "traj_offset", "seg_parent"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_node_fields_give_the_forest_of_per_trajectory_fields():
    compact, full = forest_from_json(_doc(True)), forest_from_json(_doc(False))
    _same(compact, full)
    _same(forest_from_proto(json_to_proto(_doc(True))), full)
    back = proto_to_json(json_to_proto(_doc(True)))  # the compact form survives both conversions
    assert back["trees"][0]["nodes"][1]["loss_mask"] == [1, 1] and "loss_mask" not in back["trees"][0]["trajectories"][0]
    _same(forest_from_json(back), full)
    assert forest_from_json(_doc(True), numba=False).loss_mask.tolist() == full.loss_mask.tolist()


def test_node_loss_masks_count_against_the_loss_limit():
    loss = int(forest_from_json(_doc(False)).loss_mask.sum())
    forest_from_json(_doc(True), Limits(max_loss_tokens=loss))
    with pytest.raises(LimitError, match="max_loss_tokens"):
        forest_from_json(_doc(True), Limits(max_loss_tokens=loss - 1))


@pytest.mark.parametrize("case,field,message", [
    ("node_length", "trees[0].nodes[1].loss_mask", "expected 2 values"),
    ("missing_on_a_node", "trees[0].nodes[2].old_logprobs", "on every node of trees[0] or on none"),
    ("both", "trees[0].trajectories[0].loss_mask", "on the nodes of the tree or on its trajectories, got both"),
    ("mask_value", "trees[0].nodes[3].loss_mask", "loss-mask values 0 or 1"),
    ("not_finite", "trees[0].nodes[1].old_logprobs", "finite float32"),
    ("flat_without", "trees[0].trajectories[0].old_logprobs", "got values on its tree nodes"),
], ids=lambda v: v if isinstance(v, str) and " " not in v and "[" not in v else None)
def test_bad_node_fields_name_the_field(case, field, message):
    doc = _doc(True)
    nodes, trajs = doc["trees"][0]["nodes"], doc["trees"][0]["trajectories"]
    if case == "node_length":
        nodes[1]["loss_mask"] = [1]
    elif case == "missing_on_a_node":
        del nodes[2]["old_logprobs"]
    elif case == "both":
        trajs[0]["loss_mask"] = [0, 0, 0, 1, 1, 0]
    elif case == "mask_value":
        nodes[3]["loss_mask"] = [1, 2]
    elif case == "not_finite":
        nodes[1]["old_logprobs"] = [float("nan"), 0.0]
    elif case == "flat_without":
        del doc["trajectories"][0]["old_logprobs"]
    for source in ("json", "proto"):
        if source == "proto" and case in ("not_finite", "mask_value", "node_length"):
            continue  # JSON-only spellings (protobuf carries typed bytes; lengths are checked in bytes)
        with pytest.raises(ValidationError) as err:
            forest_from_json(copy.deepcopy(doc)) if source == "json" else forest_from_proto(_proto(doc))
        assert err.value.field == field and message in str(err.value), (source, str(err.value))


def _proto(doc: dict):
    """The protobuf form of a (possibly invalid) compact document, built field by field."""
    msg = rollouts_pb2.RolloutBatch(batch_id=doc["batch_id"], vocab_size=doc["vocab_size"])
    for t in doc["trajectories"]:
        m = msg.trajectories.add(id=t["id"], tokens=pack(t["tokens"], "int32"), loss_mask=pack(t["loss_mask"], "uint8"))
        if "old_logprobs" in t:
            m.old_logprobs = pack(t["old_logprobs"], "float32")
    tree = msg.trees.add(id="t")
    for n in doc["trees"][0]["nodes"]:
        node = tree.nodes.add(id=n["id"], tokens=pack(n["tokens"], "int32"))
        if n["parent"] is not None:
            node.parent = n["parent"]
        for name, dtype in (("loss_mask", "uint8"), ("old_logprobs", "float32")):
            if name in n:
                setattr(node, name, pack(n[name], dtype))
    for t in doc["trees"][0]["trajectories"]:
        m = tree.trajectories.add(id=t["id"], node=t["node"], advantage=t["advantage"], reward=t["reward"])
        if "loss_mask" in t:
            m.loss_mask = pack(t["loss_mask"], "uint8")
    return msg.SerializeToString()
