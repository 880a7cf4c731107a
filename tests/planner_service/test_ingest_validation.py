"""planner_service.ingest validation (docs/design/service.md): every rule rejects the whole batch and names the
first offending field, in both input forms; limits raise LimitError naming the limit."""
from __future__ import annotations

import copy
import json
import math
import random

import pytest

from planner_service.errors import LimitError, ValidationError
from planner_service.ingest import Limits, forest_from_json, forest_from_proto, json_to_proto, proto_to_json
from proto import arrays
from proto.harts.v1 import rollouts_pb2


def _base() -> dict:
    return {
        "batch_id": "step-0",
        "vocab_size": 16,
        "trajectories": [
            {"id": "a", "tree_id": "task", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "old_logprobs": [0.0, -1.0, -2.0],
             "advantage": 1.0, "reward": 0.5, "group_id": "g", "weight": 1.0},
            {"id": "b", "tree_id": "task", "tokens": [1, 2, 4, 5], "loss_mask": [0, 0, 1, 1],
             "old_logprobs": [0.0, 0.0, -1.0, -0.5], "advantage": [1.0, 1.0, 2.0, 2.0]},
            {"id": "c", "tokens": [7], "old_logprobs": [-0.1]},
        ],
        "trees": [
            {"id": "tree-x",
             "nodes": [{"id": 0, "parent": None, "tokens": [3, 3]}, {"id": 1, "parent": 0, "tokens": [4]},
                       {"id": 2, "parent": 0, "tokens": [5, 6]}, {"id": 3, "parent": 2, "tokens": [9]}],
             "trajectories": [{"id": "x", "node": 1, "loss_mask": [0, 0, 1], "old_logprobs": [0.0, 0.0, -1.0]},
                              {"id": "y", "node": 3, "old_logprobs": [0.0, 0.0, -1.0, -1.0, -2.0], "advantage": 0.5}]},
        ],
    }


def test_base_document_is_valid():
    forest_from_json(_base()).check()


def _set(path: str, value):
    """Mutation that sets (or deletes, value=...) the field at a dotted path like trees.0.nodes.1.parent."""
    def mutate(doc):
        *parents, last = path.split(".")
        obj = doc
        for p in parents:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        key = int(last) if isinstance(obj, list) else last
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return mutate


CASES = [
    # (id, mutation, field, message fragment)
    ("no-batch-id", _set("batch_id", ...), "batch_id", "expected a non-empty string"),
    ("empty-batch-id", _set("batch_id", ""), "batch_id", "expected a non-empty string"),
    ("vocab-zero", _set("vocab_size", 0), "vocab_size", "expected an integer in [1,"),
    ("vocab-string", _set("vocab_size", "16"), "vocab_size", "expected an integer, got string"),
    ("vocab-bool", _set("vocab_size", True), "vocab_size", "expected an integer, got boolean"),
    ("trajectories-not-list", _set("trajectories", {"a": 1}), "trajectories", "expected a list, got object"),
    ("trajectory-not-object", _set("trajectories.1", [1, 2]), "trajectories[1]", "expected an object"),
    ("missing-id", _set("trajectories.1.id", ...), "trajectories[1].id", "expected a non-empty string, got nothing"),
    ("id-not-string", _set("trajectories.1.id", 5), "trajectories[1].id", "got number 5"),
    ("duplicate-id", _set("trajectories.2.id", "a"), "trajectories[2].id", "expected a unique trajectory id, got 'a' again"),
    ("duplicate-id-tree", _set("trees.0.trajectories.1.id", "b"), "trees[0].trajectories[1].id", "unique trajectory id"),
    ("tree-id-type", _set("trajectories.0.tree_id", 3), "trajectories[0].tree_id", "expected a string"),
    ("tokens-missing", _set("trajectories.1.tokens", ...), "trajectories[1].tokens", "at least one token"),
    ("tokens-empty", _set("trajectories.1.tokens", []), "trajectories[1].tokens", "at least one token"),
    ("tokens-string", _set("trajectories.1.tokens", "1 2 4 5"), "trajectories[1].tokens", "expected a list, got string"),
    ("token-too-large", _set("trajectories.1.tokens.2", 16), "trajectories[1].tokens", "expected token ids in [0, 16), got 16 at position 2"),
    ("token-negative", _set("trajectories.1.tokens.0", -1), "trajectories[1].tokens", "got -1 at position 0"),
    ("token-float", _set("trajectories.1.tokens.3", 1.5), "trajectories[1].tokens", "expected integer token ids, got number 1.5 at position 3"),
    ("token-string", _set("trajectories.1.tokens.3", "5"), "trajectories[1].tokens", "got string '5' at position 3"),
    ("token-huge", _set("trajectories.1.tokens.3", 1 << 70), "trajectories[1].tokens", "expected integer token ids"),
    ("token-nested", _set("trajectories.1.tokens.3", [5]), "trajectories[1].tokens", "got list of 1 at position 3"),
    ("mask-length", _set("trajectories.1.loss_mask", [0, 1, 1]), "trajectories[1].loss_mask", "expected 4 values (one per token), got 3"),
    ("mask-value", _set("trajectories.1.loss_mask.1", 2), "trajectories[1].loss_mask", "expected loss-mask values 0 or 1, got 2 at position 1"),
    ("mask-type", _set("trajectories.1.loss_mask", 1), "trajectories[1].loss_mask", "expected a list, got number 1"),
    ("logprob-nan", _set("trajectories.1.old_logprobs.2", math.nan), "trajectories[1].old_logprobs", "expected finite float32 values, got nan at position 2"),
    ("logprob-inf", _set("trajectories.0.old_logprobs.0", -math.inf), "trajectories[0].old_logprobs", "got -inf at position 0"),
    ("logprob-f32-overflow", _set("trajectories.0.old_logprobs.1", 1e39), "trajectories[0].old_logprobs", "got 1e+39"),
    ("logprob-length", _set("trajectories.0.old_logprobs", [0.0]), "trajectories[0].old_logprobs", "expected 3 values"),
    ("logprob-string", _set("trajectories.0.old_logprobs.1", "x"), "trajectories[0].old_logprobs", "expected numbers, got string"),
    ("logprob-missing-on-some", _set("trajectories.2.old_logprobs", ...), "trajectories[2].old_logprobs", "on every trajectory or on none"),
    ("ref-on-some", _set("trajectories.1.ref_logprobs", [0.0] * 4), "trajectories[1].ref_logprobs", "on every trajectory or on none"),
    ("advantage-list-length", _set("trajectories.1.advantage", [1.0]), "trajectories[1].advantage", "expected 4 values"),
    ("advantage-nan", _set("trajectories.0.advantage", math.nan), "trajectories[0].advantage", "expected a finite float32, got nan"),
    ("advantage-element-inf", _set("trajectories.1.advantage.0", math.inf), "trajectories[1].advantage", "got inf at position 0"),
    ("advantage-string", _set("trajectories.0.advantage", "1"), "trajectories[0].advantage", "expected a number"),
    ("reward-inf", _set("trajectories.0.reward", math.inf), "trajectories[0].reward", "expected a finite float32"),
    ("weight-negative", _set("trajectories.0.weight", -0.5), "trajectories[0].weight", "expected a weight >= 0, got -0.5"),
    ("weight-nan", _set("trajectories.0.weight", math.nan), "trajectories[0].weight", "finite"),
    ("group-type", _set("trajectories.0.group_id", 1), "trajectories[0].group_id", "expected a string"),
    ("unknown-field", _set("trajectories.0.advantages", [1.0, 1.0, 1.0]), "trajectories[0].advantages", "unknown field 'advantages'"),
    ("unknown-top-field", _set("batch", "x"), "batch", "unknown field"),
    ("no-trajectories", lambda d: (d.pop("trajectories"), d["trees"][0].pop("trajectories")), "trajectories", "at least one trajectory"),
    ("tree-id-empty", _set("trees.0.id", ""), "trees[0].id", "non-empty"),
    ("tree-id-duplicate", lambda d: d["trees"].append(copy.deepcopy(d["trees"][0]) | {"trajectories": []}), "trees[1].id", "unique tree id"),
    ("tree-id-clashes-flat", _set("trees.0.id", "task"), "trees[0].id", "distinct from the flat trajectories' tree_ids"),
    ("nodes-empty", _set("trees.0.nodes", []), "trees[0].nodes", "at least one node"),
    ("node-not-object", _set("trees.0.nodes.2", 7), "trees[0].nodes[2]", "expected an object"),
    ("node-id-duplicate", _set("trees.0.nodes.2.id", 1), "trees[0].nodes[2].id", "unique in its tree, got 1 again"),
    ("node-id-type", _set("trees.0.nodes.2.id", "2"), "trees[0].nodes[2].id", "expected an integer"),
    ("node-tokens-empty", _set("trees.0.nodes.1.tokens", []), "trees[0].nodes[1].tokens", "at least one token"),
    ("node-token-range", _set("trees.0.nodes.3.tokens.0", 99), "trees[0].nodes[3].tokens", "expected token ids in [0, 16), got 99"),
    ("unknown-parent", _set("trees.0.nodes.3.parent", 42), "trees[0].nodes[3].parent", "expected the id of a node of trees[0], got 42"),
    ("self-parent", _set("trees.0.nodes.1.parent", 1), "trees[0].nodes[1].parent", "cycle: 1 -> 1"),
    ("cycle", lambda d: (_set("trees.0.nodes.2.parent", 3)(d)), "trees[0].nodes[2].parent", "cycle: 2 -> 3 -> 2"),
    ("parent-type", _set("trees.0.nodes.1.parent", "0"), "trees[0].nodes[1].parent", "expected an integer"),
    ("traj-node-unknown", _set("trees.0.trajectories.1.node", 8), "trees[0].trajectories[1].node", "expected the id of a node of trees[0], got 8"),
    ("traj-node-missing", _set("trees.0.trajectories.1.node", ...), "trees[0].trajectories[1].node", "expected an integer, got null"),
    ("path-length", _set("trees.0.trajectories.0.loss_mask", [0, 1]), "trees[0].trajectories[0].loss_mask",
     "expected 3 values (one per token of the root-to-node path), got 2"),
    ("path-length-logprobs", _set("trees.0.trajectories.1.old_logprobs", [0.0] * 4), "trees[0].trajectories[1].old_logprobs", "expected 5 values"),
    ("tree-traj-tokens-field", _set("trees.0.trajectories.0.tokens", [1]), "trees[0].trajectories[0].tokens", "unknown field"),
    # first offending field in document order, whichever check finds it
    ("first-vectorised-before-parse", lambda d: (_set("trajectories.0.tokens.0", 99)(d), _set("trajectories.2.id", "a")(d)),
     "trajectories[0].tokens", "got 99"),
    ("first-parse-before-vectorised", lambda d: (_set("trajectories.1.id", 3)(d), _set("trajectories.2.tokens.0", 99)(d)),
     "trajectories[1].id", "expected a non-empty string"),
    ("first-field-within-trajectory", lambda d: (_set("trajectories.1.tokens.1", 99)(d), _set("trajectories.1.loss_mask", "x")(d)),
     "trajectories[1].tokens", "got 99"),
    ("first-flat-before-tree", lambda d: (_set("trajectories.2.old_logprobs.0", math.nan)(d), _set("trees.0.nodes.1.parent", 9)(d)),
     "trajectories[2].old_logprobs", "nan"),
    ("first-node-before-tree-traj", lambda d: (_set("trees.0.trajectories.0.node", 77)(d), _set("trees.0.nodes.3.parent", 3)(d)),
     "trees[0].nodes[3].parent", "cycle"),
]


@pytest.mark.parametrize("mutate,field,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_validation_names_the_first_offending_field(mutate, field, fragment):
    doc = _base()
    mutate(doc)
    with pytest.raises(ValidationError) as info:
        forest_from_json(doc)
    assert info.value.field == field, info.value.message
    assert fragment in info.value.message, info.value.message
    assert "expected" in info.value.message
    with pytest.raises(ValidationError) as text_info:  # the same through JSON text (NaN/Infinity literals)
        forest_from_json(json.dumps(doc))
    assert text_info.value.field == field


def test_invalid_json_text():
    with pytest.raises(ValidationError, match="invalid JSON"):
        forest_from_json(b'{"batch_id": ')
    with pytest.raises(ValidationError, match="expected a JSON object, got list"):
        forest_from_json("[]")


def _proto_base() -> rollouts_pb2.RolloutBatch:
    return json_to_proto(_base())


def _proto_case(name: str, batch: rollouts_pb2.RolloutBatch) -> None:
    t, tree = batch.trajectories, batch.trees[0]
    if name == "tokens-bytes":
        t[1].tokens = t[1].tokens[:-1]
    elif name == "token-range":
        t[1].tokens = arrays.pack([1, 2, 40, 5], "int32")
    elif name == "mask-length":
        t[1].loss_mask = bytes([0, 1])
    elif name == "mask-value":
        t[1].loss_mask = bytes([0, 1, 3, 1])
    elif name == "logprob-nan":
        t[0].old_logprobs = arrays.pack([0.0, math.nan, 0.0], "float32")
    elif name == "advantages-length":
        t[1].advantages = arrays.pack([1.0], "float32")
    elif name == "advantage-inf":
        t[0].advantage = math.inf
    elif name == "weight-negative":
        t[0].weight = -1.0
    elif name == "empty-id":
        t[2].id = ""
    elif name == "vocab":
        batch.vocab_size = 0
    elif name == "unknown-parent":
        tree.nodes[3].parent = 11
    elif name == "cycle":
        tree.nodes[0].parent = 3
    elif name == "tree-path-length":
        tree.trajectories[0].loss_mask = bytes([1])
    elif name == "logprob-presence":
        t[2].old_logprobs = b""


PROTO_CASES = [
    ("tokens-bytes", "trajectories[1].tokens", "expected a multiple of 4 bytes"),
    ("token-range", "trajectories[1].tokens", "got 40 at position 2"),
    ("mask-length", "trajectories[1].loss_mask", "expected 4 bytes (4 uint8, one per token), got 2"),
    ("mask-value", "trajectories[1].loss_mask", "got 3 at position 2"),
    ("logprob-nan", "trajectories[0].old_logprobs", "got nan at position 1"),
    ("advantages-length", "trajectories[1].advantages", "expected 16 bytes"),
    ("advantage-inf", "trajectories[0].advantage", "finite"),
    ("weight-negative", "trajectories[0].weight", ">= 0"),
    ("empty-id", "trajectories[2].id", "non-empty"),
    ("vocab", "vocab_size", ">= 1"),
    ("unknown-parent", "trees[0].nodes[3].parent", "got 11"),
    ("cycle", "trees[0].nodes[0].parent", "cycle: 0 -> 3 -> 2 -> 0"),
    ("tree-path-length", "trees[0].trajectories[0].loss_mask", "expected 3 values"),
    ("logprob-presence", "trajectories[2].old_logprobs", "on every trajectory or on none"),
]


@pytest.mark.parametrize("name,field,fragment", PROTO_CASES, ids=[c[0] for c in PROTO_CASES])
def test_proto_validation_names_the_field(name, field, fragment):
    batch = _proto_base()
    _proto_case(name, batch)
    for body in (batch, batch.SerializeToString()):
        with pytest.raises(ValidationError) as info:
            forest_from_proto(body)
        assert info.value.field == field, info.value.message
        assert fragment in info.value.message, info.value.message
    with pytest.raises(ValidationError):
        proto_to_json(batch)


def test_undecodable_proto_bytes():
    with pytest.raises(ValidationError, match="RolloutBatch"):
        forest_from_proto(b"\xff\xff\xff")


def test_json_to_proto_rejects_invalid_documents():
    doc = _base()
    doc["trajectories"][0]["tokens"][0] = 99
    with pytest.raises(ValidationError) as info:
        json_to_proto(doc)
    assert info.value.field == "trajectories[0].tokens"


def _with_second_tree(doc: dict) -> dict:
    doc["trees"].append({"id": "t2", "nodes": [{"id": 0, "tokens": [1]}]})
    return doc


@pytest.mark.parametrize("limits,name,extend", [
    (Limits(max_trajectories=4), "max_trajectories", None),
    (Limits(max_tokens=10), "max_tokens", None),
    (Limits(max_tokens=13), "max_tokens", None),  # flat 8 tokens + tree paths 3 + 5 = 16
    (Limits(max_trajectory_length=3), "max_trajectory_length", None),
    (Limits(max_trajectory_length=4), "max_trajectory_length", None),  # path of y has 5 tokens
    (Limits(max_nodes=3), "max_nodes", None),
    (Limits(max_node_tokens=5), "max_node_tokens", None),
    (Limits(max_trees=1), "max_trees", _with_second_tree),
    (Limits(max_body_bytes=100), "max_body_bytes", None),
], ids=lambda v: v if isinstance(v, str) else "")
def test_limits(limits, name, extend):
    doc = _base()
    if extend:
        doc = extend(doc)
    body = json.dumps(doc) if name == "max_body_bytes" else doc
    with pytest.raises(LimitError, match=f"^{name}: expected at most") as info:
        forest_from_json(body, limits)
    assert "got" in info.value.message
    forest_from_json(doc)  # fine under the default limits
    with pytest.raises(LimitError, match=f"^{name}"):
        forest_from_proto(json_to_proto(doc).SerializeToString(), limits)


def test_id_length_limit_names_the_field_and_the_limit():
    with pytest.raises(ValidationError, match="Limits.max_id_length") as info:
        forest_from_json(_base(), Limits(max_id_length=3))
    assert info.value.field == "batch_id"


def test_limits_config_validation():
    with pytest.raises(ValueError, match="max_tokens: expected an int >= 1, got 0"):
        Limits(max_tokens=0)


_JUNK = [None, 0, -1, 2, 99, 1.5, math.nan, math.inf, "", "x", "a", [], [1], [[1]], {}, {"id": 1}, True, 1 << 70,
         [None], [1.5, 2], ["x"], -1e40]


def _paths(obj, prefix=()):
    yield prefix
    children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in children:
        yield from _paths(v, prefix + (k,))


@pytest.mark.parametrize("seed", range(3))
def test_random_corruption_gives_a_forest_or_a_project_error(seed):
    """A service must never leak another exception: random edits either validate or are rejected."""
    rng = random.Random(seed)
    base = _base()
    paths = list(_paths(base))[1:]
    for _ in range(150):
        doc = copy.deepcopy(base)
        for _ in range(rng.randint(1, 3)):
            *parents, last = rng.choice(paths)
            obj = doc
            try:
                for k in parents:
                    obj = obj[k]
                if rng.random() < 0.15 and isinstance(obj, dict):
                    del obj[last]
                else:
                    obj[last] = copy.deepcopy(rng.choice(_JUNK))
            except (KeyError, IndexError, TypeError):
                pass  # an earlier edit removed or replaced this path
        try:
            forest_from_json(doc).check()
        except (ValidationError, LimitError):
            continue
        batch = json_to_proto(doc)
        forest_from_proto(batch.SerializeToString()).check()
        body = bytearray(batch.SerializeToString())
        body[rng.randrange(len(body))] = rng.randrange(256)
        try:
            forest_from_proto(bytes(body)).check()
        except (ValidationError, LimitError):
            pass
