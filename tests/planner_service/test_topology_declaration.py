"""The topology declared once (`planner_service.topology.FIELDS`): the wire, the planner, HTTP and
the CLI all carry every declared field, derived from the declaration, so that a new field is a
declaration, a proto field and a PlanConfig field, and nothing else."""
from __future__ import annotations

import argparse
import json

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD

from harts_cli import cmd_plan, cmd_serve
from harts_cli.topology_flags import add_topology_arguments, plan_kwargs_from_args, topology_from_args
from planner_service.errors import ValidationError
from planner_service.planner.config import PlanConfig
from planner_service.topology import FIELDS, normalized_topology, topology_to_config
from planner_service.transport.http_models import SubmitQuery, Topology
from proto.harts.v1 import planner_pb2


def _values() -> dict:
    """Every declared field's example: a value other than the unset one."""
    return {f.name: f.example for f in FIELDS}


def test_the_declaration_is_the_proto_topology_field_for_field():
    proto = planner_pb2.Topology.DESCRIPTOR.fields
    assert [f.name for f in FIELDS] == [f.name for f in proto], "declare every harts.v1.Topology field, in order"
    for f, p in zip(FIELDS, proto):
        wire = {int: (FD.CPPTYPE_INT32, FD.CPPTYPE_INT64), bool: (FD.CPPTYPE_BOOL,), str: (FD.CPPTYPE_STRING,)}
        assert p.cpp_type in wire[f.type], f"{f.name}: declared {f.type.__name__}, the proto says otherwise"
    for f in FIELDS:
        assert f.example is not None and f.example != f.type(), f"{f.name}: declare an example other than unset"


def test_every_field_reaches_the_http_models_and_both_commands():
    non_documents = [f.name for f in FIELDS if not f.document]
    assert list(Topology.model_fields) == [f.name for f in FIELDS]
    assert list(SubmitQuery.model_fields) == non_documents
    for command in (cmd_plan, cmd_serve):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        dests = {a.dest for a in parser._actions}
        assert set(non_documents) <= dests, (command.__name__, set(non_documents) - dests)


def test_every_field_goes_from_each_surface_to_the_plan_config_and_back():
    values = _values()
    wire = planner_pb2.Topology(**values)
    cfg = topology_to_config(wire)
    assert normalized_topology(cfg) == wire  # gRPC, and what a planned step keeps
    assert Topology.model_validate_json(json.dumps(values)).to_proto() == wire  # HTTP body
    scalars = {f.name: values[f.name] for f in FIELDS if not f.document}
    as_text = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in scalars.items()}
    query = SubmitQuery.model_validate(as_text)
    assert query.to_proto() == planner_pb2.Topology(**scalars)  # HTTP query: strings, as a URL has them
    argv = []
    for f in FIELDS:
        if not f.document:
            argv += [f.flag] if f.type is bool else [f.flag, str(values[f.name])]
    parser = argparse.ArgumentParser()
    add_topology_arguments(parser)
    args = parser.parse_args(argv)
    assert topology_from_args(args) == planner_pb2.Topology(**scalars)  # `harts serve`'s default topology
    documents = {f.plan_field: getattr(cfg, f.plan_field) for f in FIELDS if f.document}
    from_flags = PlanConfig(**plan_kwargs_from_args(args), conv_kernel=cfg.conv_kernel, **documents)
    assert normalized_topology(from_flags) == wire  # `harts plan`'s PlanConfig


def test_wire_bounds_come_from_the_declaration_and_name_the_field():
    for f in FIELDS:
        if f.type is int:
            with pytest.raises(ValidationError) as err:
                topology_to_config(planner_pb2.Topology(**{"world_size": 1, f.name: f.minimum - 1}))
            assert err.value.field == f"topology.{f.name}" and f"expected >= {f.minimum}" in err.value.message
