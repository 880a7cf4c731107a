"""planner_service.ingest.Limits: every limit admits a batch exactly at it and rejects one unit
above it, with LimitError naming the limit and, where one field crosses it, that field; JSON and
protobuf alike. Expanded counts are int64."""
from __future__ import annotations

import json

import numpy as np
import pytest

from planner_service.errors import LimitError
from planner_service.ingest import Limits, forest_from_json, forest_from_proto, json_to_proto


def _doc() -> dict:
    """4 flat trajectories of 3 tokens (tree t merges to 6 distinct tokens, tree u has 3) and two
    explicit trees (nodes of 2 + 1 + 2 and 1 tokens; paths of 3, 4 and 1 tokens)."""
    return {
        "batch_id": "lim", "vocab_size": 16,
        "trajectories": [
            {"id": "a", "tree_id": "t", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1]},
            {"id": "b", "tree_id": "t", "tokens": [1, 2, 4], "loss_mask": [0, 0, 1]},
            {"id": "c", "tree_id": "t", "tokens": [1, 5, 6], "loss_mask": [0, 1, 1]},
            {"id": "d", "tree_id": "u", "tokens": [9, 9, 9], "loss_mask": [0, 0, 0]},
        ],
        "trees": [{"id": "e", "nodes": [{"id": 0, "tokens": [7, 7]}, {"id": 1, "parent": 0, "tokens": [8]},
                                        {"id": 2, "parent": 0, "tokens": [3, 4]}],
                   "trajectories": [{"id": "x", "node": 1, "loss_mask": [0, 0, 1]},
                                    {"id": "y", "node": 2, "loss_mask": [0, 0, 1, 1]}]},
                  {"id": "f", "nodes": [{"id": 0, "tokens": [5]}], "trajectories": [{"id": "z", "node": 0}]}],
    }


# (limit, the batch's count, the field at which a limit one below it is crossed, or "")
MEASURED = [
    ("max_trajectories", 7, "trees[1].trajectories[0]"),
    ("max_unique_tokens", 6 + 3 + 5 + 1, ""),
    ("max_tokens", 12 + 3 + 4 + 1, "trees[1].trajectories[0].node"),
    ("max_loss_tokens", 5 + 1 + 2 + 1, ""),
    ("max_trajectory_length", 4, "trees[0].trajectories[1].node"),
    ("max_trees", 2, "trees"),
    ("max_nodes", 4, "trees[1].nodes[0]"),
    ("max_node_tokens", 6, "trees[1].nodes[0].tokens"),
]


@pytest.mark.parametrize("name,count,field", MEASURED, ids=[m[0] for m in MEASURED])
def test_limit_admits_the_batch_at_it_and_rejects_it_one_below(name, count, field):
    doc = _doc()
    body_json = json.dumps(doc).encode()
    body_pb = json_to_proto(doc).SerializeToString()
    for build, body in ((forest_from_json, body_json), (forest_from_json, doc), (forest_from_proto, body_pb)):
        build(body, Limits(**{name: count}))
        with pytest.raises(LimitError) as info:
            build(body, Limits(**{name: count - 1}))
        assert info.value.message.startswith(f"{name}: expected at most {count - 1} "), info.value.message
        assert info.value.field == field, (build.__name__, info.value.message)
        if field:
            assert info.value.message.endswith(f"(at {field})")


def test_counts_are_the_forests():
    f = forest_from_json(_doc())
    assert (f.unique_tokens, f.expanded_tokens, f.num_trajectories) == (15, 20, 7)


def test_body_bytes_limit():
    body = json.dumps(_doc()).encode()
    forest_from_json(body, Limits(max_body_bytes=len(body)))
    with pytest.raises(LimitError, match=f"^max_body_bytes: expected at most {len(body) - 1} bytes of JSON, got {len(body)}"):
        forest_from_json(body, Limits(max_body_bytes=len(body) - 1))
    pb = json_to_proto(_doc()).SerializeToString()
    forest_from_proto(pb, Limits(max_body_bytes=len(pb)))
    with pytest.raises(LimitError, match="^max_body_bytes"):
        forest_from_proto(pb, Limits(max_body_bytes=len(pb) - 1))


def test_expanded_counts_are_int64_beyond_2_31():
    """An explicit tree whose paths sum to more than 2**31 expanded tokens is counted in int64 and
    refused by max_tokens (naming the trajectory that crosses it), not wrapped around."""
    long_node = {"id": 0, "tokens": [1] * 40_000}
    trajs = [{"id": f"t{i}", "node": 0} for i in range(60_000)]
    doc = {"batch_id": "big", "vocab_size": 4, "trees": [{"id": "e", "nodes": [long_node], "trajectories": trajs}]}
    limits = Limits(max_tokens=(1 << 31) + 5, max_loss_tokens=1 << 40)
    with pytest.raises(LimitError) as info:
        forest_from_json(doc, limits)
    assert info.value.message.startswith(f"max_tokens: expected at most {(1 << 31) + 5} expanded tokens, got {60_000 * 40_000}")
    assert info.value.field == f"trees[0].trajectories[{((1 << 31) + 5) // 40_000}].node"


def test_defaults_are_documented_sizes():
    d = Limits()
    assert (d.max_body_bytes, d.max_unique_tokens, d.max_tokens, d.max_loss_tokens) == (1 << 30, 1 << 26, 1 << 30, 1 << 26)
    assert d.max_tokens > 70_085_615 and d.max_unique_tokens > 4_203_689  # the 16-task percall step
    with pytest.raises(ValueError, match="max_unique_tokens: expected an int >= 1, got 0"):
        Limits(max_unique_tokens=0)
    assert np.int64(Limits().max_tokens) == 1 << 30
