"""`harts serve` flags -> the ServiceConfig the server runs with (the server itself stubbed): the
default topology takes every topology flag, from the one declaration."""
from __future__ import annotations

import pytest

import planner_service.server
from harts_cli.main import main


@pytest.fixture()
def served(monkeypatch):
    got = {}

    def run(cfg, **kwargs):
        got.update(cfg=cfg, **kwargs)
        return 0

    monkeypatch.setattr(planner_service.server, "run", run)
    return got


def test_topology_flags_make_the_default_topology(served):
    assert main(["serve", "--db", ":memory:", "--world-size", "4", "--microbatch-tokens", "256", "--chunk-size", "16",
                 "--lockstep", "--activation-checkpointing", "full", "--head", "chunked", "--dtype", "bfloat16"]) == 0
    cfg = served["cfg"]
    topo = cfg.default_topology
    assert (topo.world_size, topo.microbatch_tokens, topo.chunk_size, topo.lockstep) == (4, 256, 16, True)
    assert (topo.activation_checkpointing, topo.head, topo.dtype) == ("full", "chunked", "bfloat16")
    assert (cfg.default_microbatch_tokens, cfg.default_chunk_size) == (256, 16)  # what a request's 0 means
    assert served["limits"].max_connections == 1000


def test_no_world_size_no_default_topology(served):
    assert main(["serve", "--db", ":memory:", "--chunk-size", "32"]) == 0
    assert served["cfg"].default_topology is None and served["cfg"].default_chunk_size == 32


def test_a_default_topology_that_cannot_be_planned_is_refused_naming_the_field(served, capsys):
    assert main(["serve", "--db", ":memory:", "--world-size", "4", "--expert-parallel", "2"]) == 2
    assert "topology.expert_parallel: expected 1 without lockstep" in capsys.readouterr().err
    assert "cfg" not in served
