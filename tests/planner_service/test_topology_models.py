"""A topology that names the trainer's model and a cost model: the
service plans with both, falls back to its own defaults, and names a bad document's field; both
documents are bounded before anything is built."""
from __future__ import annotations

import json

import pytest

from planner_service.core import PlannerCore, ServiceConfig
from planner_service.topology import normalized_topology, topology_to_config
from planner_service.transport.http_models import Topology
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
    ("cost_model", json.dumps({"format": "other"}), "topology.cost_model.format"),
    ("dtype", "int8", "topology.dtype"),
])
def test_bad_model_documents_name_the_topology_field(field, value, match):
    with pytest.raises(ValidationError) as err:
        topology_to_config(planner_pb2.Topology(**TOPOLOGY, **{field: value}))
    assert err.value.field == match


def test_lockstep_reaches_the_plan_config_over_json_and_grpc_and_the_service_default():
    assert topology_to_config(planner_pb2.Topology(**TOPOLOGY, lockstep=True)).lockstep
    assert not topology_to_config(planner_pb2.Topology(**TOPOLOGY)).lockstep
    proto = Topology.model_validate_json(json.dumps({**TOPOLOGY, "lockstep": True})).to_proto()
    assert proto.lockstep and topology_to_config(proto).lockstep
    assert normalized_topology(topology_to_config(proto)).lockstep  # kept with the step, compared for idempotency
    # windows across ranks are on by default for lock-step plans; no_cross_rank_windows is the ablation
    assert topology_to_config(proto).cross_rank_windows and not normalized_topology(topology_to_config(proto)).no_cross_rank_windows
    off = Topology.model_validate_json(json.dumps({**TOPOLOGY, "lockstep": True, "no_cross_rank_windows": True})).to_proto()
    assert not topology_to_config(off).cross_rank_windows and normalized_topology(topology_to_config(off)).no_cross_rank_windows
    cfg = ServiceConfig(db_path=":memory:", default_topology=planner_pb2.Topology(world_size=2, lockstep=True))
    assert topology_to_config(cfg.default_topology).lockstep


def test_checkpointing_expert_parallelism_and_head_reach_the_plan_config_and_stay_unset_by_default():
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


def _model(**changes) -> str:
    from plan.named_models import qwen3_next_80b_a3b

    cfg = qwen3_next_80b_a3b()
    cfg.update(changes)
    return json.dumps(cfg)


def _cost(**coefficients) -> str:
    return json.dumps({"format": "harts.cost_model.v1", "coefficients": coefficients})


_HUGE = "1" + "0" * 400
#: (topology field, document, field named, bound or reason in the message): the audit's documents
#: that exhausted the planner or answered 500, and neighbours (its 10^7 layers are left out: without
#: the bound one document holds a test for minutes at 14 GB; 3 x 10^5 is its gRPC reproducer)
BOUNDED_DOCUMENTS = [
    ("layers-3x10^5", "model", _model(num_hidden_layers=3 * 10**5), "topology.model.num_hidden_layers", "[1, 1024]"),
    ("layer-types-10^4", "model", _model(num_hidden_layers=4, layer_types=["linear_attention"] * 10**4),
     "topology.model.layer_types", "list of 4 layer types, got 10000 entries"),
    ("full-attention-interval-0", "model", _model(full_attention_interval=0), "topology.model.full_attention_interval",
     "[1, 1024]"),
    ("mlp-only-layers-5", "model", _model(mlp_only_layers=5), "topology.model.mlp_only_layers", "layer indices in [0, 48)"),
    ("mlp-only-layers-nested", "model", _model(mlp_only_layers=[[1]]), "topology.model.mlp_only_layers", "[[1]]"),
    ("partial-rotary-factor-1e308", "model", _model(partial_rotary_factor=1e308),
     "topology.model.partial_rotary_factor", "[0, 1]"),
    ("vocab-10^400", "model", _model().replace('"vocab_size": 151936', f'"vocab_size": {_HUGE}'),
     "topology.model.vocab_size", "[1, 4194304], got an integer of about 401 digits"),
    ("hidden-size-inf", "model", _model().replace('"hidden_size": 2048', '"hidden_size": Infinity'),
     "topology.model.hidden_size", "expected an integer, got inf"),
    ("experts-10^6", "model", _model(num_experts=10**6), "topology.model.num_experts", "[0, 4096]"),
    ("top-k-over-experts", "model", _model(num_experts_per_tok=600), "topology.model.num_experts_per_tok",
     "at most num_experts (512)"),
    ("model-nested-200k", "model", "[" * 200_000 + "]" * 200_000, "topology.model", "does not parse"),
    ("model-nested-20", "model", _model(quantization_config=json.loads("[" * 20 + "]" * 20)), "topology.model",
     "nested at most 16 levels"),
    ("model-2-MiB", "model", _model(padding="x" * (2 << 20)), "topology.model", "at most 1048576 characters"),
    ("cost-10^400", "cost_model", _cost(row=1).replace('"row": 1', f'"row": {_HUGE}'), "topology.cost_model.row",
     "beyond float64"),
    ("cost-1e400", "cost_model", _cost(row=1).replace('"row": 1', '"row": 1e400'), "topology.cost_model.row",
     "finite coefficient"),
    ("transfer-10^400", "cost_model", _cost(row=1)[:-1] + f', "transfer_byte": {_HUGE}}}',
     "topology.cost_model.transfer_byte", "beyond float64"),
    ("cost-nested-200k", "cost_model", "[" * 200_000 + "]" * 200_000, "topology.cost_model", "does not parse"),
    ("cost-fit-nested-100", "cost_model", _cost(row=1)[:-1] + ', "fit": ' + "[" * 100 + "]" * 100 + "}",
     "topology.cost_model", "nested at most 16 levels"),
]


@pytest.mark.parametrize("field,text,named,fragment", [c[1:] for c in BOUNDED_DOCUMENTS],
                         ids=[c[0] for c in BOUNDED_DOCUMENTS])
def test_model_and_cost_model_documents_are_bounded_naming_the_field_and_the_bound(field, text, named, fragment):
    with pytest.raises(ValidationError) as err:
        topology_to_config(planner_pb2.Topology(**TOPOLOGY, **{field: text}))
    assert err.value.field == named and fragment in err.value.message, err.value.message


def test_a_model_with_many_layers_is_refused_before_its_layers_are_built():
    """The hostile audit: `from_hf_config` built per-layer lists before any bound (10^7 layers in a
    930-byte document held the planning thread 271 s at 13.9 GB). The refusal allocates nothing
    per layer."""
    import tracemalloc

    text = _model(num_hidden_layers=3 * 10**5)
    tracemalloc.start()
    try:
        with pytest.raises(ValidationError):
            topology_to_config(planner_pb2.Topology(**TOPOLOGY, model=text))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (1 << 20), peak  # a list of 3 x 10^5 layer types alone is 2.4 MB


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "hybrid-moe-124b"])
def test_every_published_model_is_within_the_bounds(name):
    from plan.named_models import NAMED_MODELS

    topo = planner_pb2.Topology(world_size=64, microbatch_tokens=1024, chunk_size=64, lockstep=True, dtype="bfloat16",
                                model=json.dumps(NAMED_MODELS[name]()))
    cfg = topology_to_config(topo)
    assert cfg.model_config == NAMED_MODELS[name]() and cfg.memory_tokens >= 1024
