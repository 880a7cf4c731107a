"""Hostile rollout bodies get a 422 naming the field at submit, and nothing is
stored: deep nesting, integers beyond float64, lone surrogates in ids, booleans as numbers, and a
world size spelled as a string; bytes that are not UTF-8 in ids (JSON and protobuf),
batch ids that no URL can carry, and ids past the length bound; strings that look like
the JSON scan's placeholders. In-process: PlannerCore and the
FastAPI app over it."""
from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from planner_service.core import PlannerCore, ServiceConfig
from planner_service.errors import ValidationError
from planner_service.ingest import json_to_proto
from planner_service.transport.http import create_app


def _doc() -> dict:
    return {"batch_id": "step", "vocab_size": 16,
            "trajectories": [{"id": "a", "tree_id": "t", "tokens": [1, 2, 3], "loss_mask": [0, 1, 1],
                              "reward": 1.0, "advantage": 0.5, "weight": 1.0, "group_id": "g"}],
            "trees": [{"id": "e", "nodes": [{"id": 0, "tokens": [4, 5]}], "trajectories": [{"id": "x", "node": 0}]}]}


def _text(doc: dict, replace: dict[str, str] | None = None) -> bytes:
    text = json.dumps(doc)
    for old, new in (replace or {}).items():
        assert old in text
        text = text.replace(old, new, 1)
    return text.encode()


DEEP = 100_000
HUGE = "1" + "0" * 400
CASES = [
    ("nested-top", lambda: b'{"batch_id": "step", "vocab_size": 16, "trajectories": ' + b"[" * DEEP + b"]" * DEEP + b"}",
     "trajectories", "levels of nesting"),
    ("nested-tokens", lambda: _text(_doc(), {"[1, 2, 3]": "[" * DEEP + "]" * DEEP}), "trajectories[0].tokens", "levels of nesting"),
    ("nested-document", lambda: b"[" * DEEP + b"]" * DEEP, "", "levels of nesting"),
    ("huge-reward", lambda: _text(_doc(), {'"reward": 1.0': f'"reward": {HUGE}'}), "trajectories[0].reward", "finite float32"),
    ("huge-advantage", lambda: _text(_doc(), {'"advantage": 0.5': f'"advantage": {HUGE}'}), "trajectories[0].advantage", "finite float32"),
    ("huge-weight", lambda: _text(_doc(), {'"weight": 1.0': f'"weight": -{HUGE}'}), "trajectories[0].weight", "finite float32"),
    ("huge-float-literal", lambda: _text(_doc(), {'"reward": 1.0': '"reward": 1e400'}), "trajectories[0].reward", "finite float32"),
    ("surrogate-batch-id", lambda: _text(_doc(), {'"step"': '"st\\ud800ep"'}), "batch_id", "lone surrogate"),
    ("surrogate-trajectory-id", lambda: _text(_doc(), {'"id": "a"': '"id": "\\udc00"'}), "trajectories[0].id", "lone surrogate"),
    ("surrogate-tree-id", lambda: _text(_doc(), {'"tree_id": "t"': '"tree_id": "t\\ud83d"'}), "trajectories[0].tree_id", "lone surrogate"),
    ("surrogate-explicit-tree-id", lambda: _text(_doc(), {'"id": "e"': '"id": "\\ud800"'}), "trees[0].id", "lone surrogate"),
    ("surrogate-tree-trajectory-id", lambda: _text(_doc(), {'"id": "x"': '"id": "x\\udfff"'}), "trees[0].trajectories[0].id", "lone surrogate"),
    ("surrogate-group-id", lambda: _text(_doc(), {'"group_id": "g"': '"group_id": "\\ud800"'}), "trajectories[0].group_id", "lone surrogate"),
    ("surrogate-unknown-key", lambda: _text(_doc(), {'"group_id"': '"\\ud800"'}), "trajectories[0].\\ud800", "unknown field"),
    ("bool-token", lambda: _text(_doc(), {"[1, 2, 3]": "[true, 1, 2]"}), "trajectories[0].tokens", "got boolean true at position 0"),
    ("bool-mask", lambda: _text(_doc(), {"[0, 1, 1]": "[true, false, true]"}), "trajectories[0].loss_mask", "got boolean true at position 0"),
    ("bool-node-token", lambda: _text(_doc(), {"[4, 5]": "[4, false]"}), "trees[0].nodes[0].tokens", "got boolean false at position 1"),
    ("not-utf8-batch-id", lambda: _text(_doc()).replace(b'"step"', b'"st\xffep"'), "batch_id", "not UTF-8"),
    ("not-utf8-trajectory-id", lambda: _text(_doc()).replace(b'"id": "a"', b'"id": "\xc3("'), "trajectories[0].id", "not UTF-8"),
    ("utf8-surrogate-tree-trajectory-id", lambda: _text(_doc()).replace(b'"id": "x"', b'"id": "x\xed\xa0\x80"'),
     "trees[0].trajectories[0].id", "UTF-8"),
    ("dot-batch-id", lambda: _text(_doc(), {'"step"': '"."'}), "batch_id", "other than '.' and '..'"),
    ("dotdot-batch-id", lambda: _text(_doc(), {'"step"': '".."'}), "batch_id", "other than '.' and '..'"),
    ("nul-batch-id", lambda: _text(_doc(), {'"step"': '"st\\u0000ep"'}), "batch_id", "control characters"),
    ("blank-batch-id", lambda: _text(_doc(), {'"step"': '" \\t "'}), "batch_id", "visible character"),
    ("long-batch-id", lambda: _text(_doc(), {'"step"': '"' + "s" * 600 + '"'}), "batch_id", "at most 512 characters"),
    # strings shaped like the JSON scan's placeholder of a parsed list (IndexError, 500)
    ("placeholder-tokens", lambda: _text(_doc(), {"[1, 2, 3]": '"\\u00000"'}), "trajectories[0].tokens",
     "expected a list, got string"),
    ("placeholder-loss-mask", lambda: _text(_doc(), {"[0, 1, 1]": '"\\u00007"'}), "trajectories[0].loss_mask",
     "expected a list, got string"),
    ("placeholder-node-tokens", lambda: _text(_doc(), {"[4, 5]": '"\\u00000"'}), "trees[0].nodes[0].tokens",
     "expected a list, got string"),
]


PROTO_CASES = [  # the string field, and the value the placeholder stands for
    ("batch-id", ("batch_id",), "batch_id"),
    ("trajectory-id", ("trajectories", 0, "id"), "trajectories[0].id"),
    ("tree-trajectory-id", ("trees", 0, "trajectories", 0, "id"), "trees[0].trajectories[0].id"),
]


@pytest.mark.parametrize("where,field", [c[1:] for c in PROTO_CASES], ids=[c[0] for c in PROTO_CASES])
def test_protobuf_strings_that_are_not_utf8_name_their_field(service, where, field):
    core, client = service
    doc = _doc()
    obj = doc
    for part in where[:-1]:
        obj = obj[part]
    obj[where[-1]] = "QQQQ"  # a placeholder of the same length as the damaged bytes
    pb = json_to_proto(doc).SerializeToString()
    assert pb.count(b"QQQQ") == 1
    body = pb.replace(b"QQQQ", b"Q\xffQQ")
    with pytest.raises(ValidationError) as info:
        core.submit(body, "proto")
    assert info.value.field == field and "UTF-8" in info.value.message, info.value.message
    r = client.post("/v1/steps", content=body, headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text
    assert core.list_steps() == []


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    core = PlannerCore(ServiceConfig(db_path=str(tmp_path_factory.mktemp("hostile") / "h.db"), max_request_bytes=1 << 20))
    with TestClient(create_app(core), raise_server_exceptions=False) as client:
        yield core, client
    core.close()


@pytest.mark.parametrize("make,field,fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_body_is_a_422_naming_the_field_and_stores_nothing(service, make, field, fragment):
    core, client = service
    body = make()
    with pytest.raises(ValidationError) as info:
        core.submit(body, "json")
    assert info.value.field == field and fragment in info.value.message, info.value.message
    r = client.post("/v1/steps", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert (err["field"] or "") == field and fragment in err["message"], err
    assert core.list_steps() == []


@pytest.mark.parametrize("value", ['"2"', "true", "2.0"])
def test_topology_world_size_must_be_an_integer(service, value):
    core, client = service
    r = client.post("/v1/steps/step/plan", content=f'{{"world_size": {value}}}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["field"] == "body.world_size"
    # an integer passes the body check and reaches the core (which knows no such step)
    r = client.post("/v1/steps/step/plan", content='{"world_size": 2}', headers={"Content-Type": "application/json"})
    assert r.status_code == 404, r.text
