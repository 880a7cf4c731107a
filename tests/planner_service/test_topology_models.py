"""A topology that names the trainer's model and a cost model (issue 10 item 3, issue 12): the
service plans with both, falls back to its own defaults, and names a bad document's field."""
from __future__ import annotations

import json

import pytest

from planner_service.core import PlannerCore, ServiceConfig, topology_to_config
from planner_service.errors import ValidationError
from planner_service.planner.cost_model import CostModel
from proto.harts.v1 import planner_pb2
from plan.seal import open_sealed
from tests.service_helpers import TOPOLOGY, rollout_doc
from trainer.models.config import debugmodel


def _texts():
    return json.dumps(debugmodel().to_hf_dict()), CostModel(row=1.0, attention=0.002, linear_call=4.0, source="svc").to_json()


def test_topology_model_and_cost_model_reach_the_plan(tmp_path):
    model, cost = _texts()
    core = PlannerCore(ServiceConfig(db_path=str(tmp_path / "c.db"), max_request_bytes=1 << 20))
    core.start()
    try:
        doc = rollout_doc("s-model")
        core.submit(json.dumps(doc).encode(), "json")
        topo = planner_pb2.Topology(**TOPOLOGY, model=model, dtype="bfloat16", cost_model=cost)
        st = core.plan("s-model", topo)
        assert st.state == planner_pb2.STEP_STATE_PLANNED
        assert st.topology.dtype == "bfloat16" and json.loads(st.topology.model) == json.loads(model)
        assert CostModel.from_json(st.topology.cost_model).linear_call == 4.0
        sl = open_sealed(core.fetch("s-model", 0))
        p = sl.header.params
        assert p.memory.dtype == "bfloat16" and p.cost_model.source == "svc"
        assert core.plan("s-model", topo).state == planner_pb2.STEP_STATE_PLANNED  # idempotent
    finally:
        core.close()


def test_service_defaults_apply_to_topologies_that_name_none():
    model, cost = _texts()
    cfg = topology_to_config(planner_pb2.Topology(**TOPOLOGY), cost_model=cost, model=model)
    assert cfg.cost_model.linear_call == 4.0 and cfg.model_config == json.loads(model)
    plain = topology_to_config(planner_pb2.Topology(**TOPOLOGY))
    assert plain.cost_model == CostModel() and plain.model_config is None


@pytest.mark.parametrize("field,value,match", [
    ("model", "{not json", "topology.model"),
    ("cost_model", json.dumps({"format": "other"}), "topology.cost_model"),
    ("dtype", "int8", "topology.dtype"),
])
def test_bad_model_documents_name_the_topology_field(field, value, match):
    with pytest.raises(ValidationError) as err:
        topology_to_config(planner_pb2.Topology(**TOPOLOGY, **{field: value}))
    assert err.value.field == match


def test_lockstep_reaches_the_plan_config_over_json_and_grpc_and_the_service_default():
    from planner_service.http_models import Topology

    assert topology_to_config(planner_pb2.Topology(**TOPOLOGY, lockstep=True)).lockstep
    assert not topology_to_config(planner_pb2.Topology(**TOPOLOGY)).lockstep
    proto = Topology.model_validate_json(json.dumps({**TOPOLOGY, "lockstep": True})).to_proto()
    assert proto.lockstep and topology_to_config(proto).lockstep
    from planner_service.service_config import normalized_topology

    assert normalized_topology(topology_to_config(proto)).lockstep  # kept with the step, compared for idempotency
    # windows across ranks are on by default for lock-step plans; no_cross_rank_windows is the ablation
    assert topology_to_config(proto).cross_rank_windows and not normalized_topology(topology_to_config(proto)).no_cross_rank_windows
    off = Topology.model_validate_json(json.dumps({**TOPOLOGY, "lockstep": True, "no_cross_rank_windows": True})).to_proto()
    assert not topology_to_config(off).cross_rank_windows and normalized_topology(topology_to_config(off)).no_cross_rank_windows
    cfg = ServiceConfig(db_path=":memory:", default_topology=planner_pb2.Topology(world_size=2, lockstep=True))
    assert topology_to_config(cfg.default_topology).lockstep


def test_checkpointing_expert_parallelism_and_head_reach_the_plan_config_and_stay_unset_by_default():
    from planner_service.http_models import Topology
    from planner_service.service_config import normalized_topology

    doc = {**TOPOLOGY, "lockstep": True, "activation_checkpointing": "full", "expert_parallel": 2, "head": "chunked"}
    for proto in (planner_pb2.Topology(**doc), Topology.model_validate_json(json.dumps(doc)).to_proto()):
        cfg = topology_to_config(proto)
        assert (cfg.activation_checkpointing, cfg.expert_parallel, cfg.head) == ("full", 2, "chunked")
        assert cfg.sizes.recompute_row_bytes > 0
        assert normalized_topology(cfg) == planner_pb2.Topology(**{**doc, "memory_tokens": cfg.memory_tokens,
                                                                   "dtype": "float32"})
    plain = topology_to_config(planner_pb2.Topology(**TOPOLOGY))
    assert (plain.activation_checkpointing, plain.expert_parallel, plain.head) == ("none", 1, "full")
    norm = normalized_topology(plain)  # as stored before these fields: equal requests stay equal
    assert (norm.activation_checkpointing, norm.expert_parallel, norm.head) == ("", 0, "")
    for field, value, match in (("activation_checkpointing", "some", "expected one of none, full, selective"),
                                ("expert_parallel", 2, "expected 1 without lockstep"),
                                ("head", "fused", "expected one of full, chunked")):
        with pytest.raises(ValidationError, match=match) as err:
            topology_to_config(planner_pb2.Topology(**TOPOLOGY, **{field: value}))
        assert err.value.field == f"topology.{field}"
