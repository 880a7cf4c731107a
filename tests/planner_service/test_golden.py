"""Golden files: a plan report and a short loss curve on the tiny model catch silent changes.

Regenerate deliberately with `HARTS_UPDATE_GOLDEN=1 pytest tests/planner_service/test_golden.py` and say why in the
commit message.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import pytest

from harts_client.synthetic import generate
from planner_service.errors import PlanningError
from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from tests.builder_helpers import forest_from_trajectories, random_trajectories

GOLDEN = pathlib.Path(__file__).parents[1] / "golden"
UPDATE = os.environ.get("HARTS_UPDATE_GOLDEN") == "1"


def _check(name: str, got: dict, *, rel: float = 0.0) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"rewrote {path}")
    want = json.loads(path.read_text())
    assert set(got) == set(want), f"{name}: keys changed"
    for key, value in want.items():
        if isinstance(value, float) and rel:
            assert got[key] == pytest.approx(value, rel=rel, abs=1e-9), f"{name}: {key}"
        else:
            assert got[key] == value, f"{name}: {key} changed from {value!r} to {got[key]!r}"


def _batch() -> dict:
    doc = generate("tree", 2, seed=7, scale=0.01, vocab_size=256, old_logprobs=True)
    doc["batch_id"] = "golden"
    return doc


def test_golden_plan():
    forest = forest_from_json(_batch())
    plan = plan_step(forest, PlanConfig(world_size=2, microbatch_tokens=1024, chunk_size=16))
    plan.header.stats.plan_seconds = 0.0
    stats = plan.header.stats
    got = {name: getattr(stats, name) for name in (
        "unique_tokens", "expanded_tokens", "computed_tokens", "replay_tokens", "duplicated_tokens",
        "microbatches", "linear_attention_calls", "peak_live_tokens", "peak_live_bytes", "windows",
        "makespan", "makespan_lower_bound")}
    got["makespan_ratio"] = round(stats.makespan_ratio, 9)
    got["rank_costs"] = [round(c, 6) for c in stats.rank_costs]
    got["sha256"] = hashlib.sha256(plan.SerializeToString(deterministic=True)).hexdigest()
    _check("plan_tree_w2.json", got)


def test_golden_loss_curve():
    # optional: the trainer extra, only for the loss curve
    import torch

    from trainer.executor import Executor, ExecutorConfig, train_step
    from trainer.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    plan = plan_step(forest_from_json(_batch()), PlanConfig(microbatch_tokens=1024, chunk_size=16, windows=False))
    ex = Executor(model, ExecutorConfig(chunk_size=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [train_step(ex, plan, opt).loss for _ in range(4)]
    _check("loss_curve_tiny.json", {f"step_{i}": float(v) for i, v in enumerate(losses)}, rel=1e-4)


def test_golden_lockstep_plans_without_cross_rank_windows():
    """cross_rank_windows=False gives the lock-step plans of before windows across ranks, byte for
    byte (sha256 of each plan, recorded at b17554c)."""
    cases = [dict(world_size=2, microbatch_tokens=32), dict(world_size=3, microbatch_tokens=48, memory_tokens=96),
             dict(world_size=4, microbatch_tokens=64), dict(world_size=6, microbatch_tokens=32),
             dict(world_size=8, microbatch_tokens=48)]
    got = {}
    for seed in range(6):
        rng = np.random.default_rng(seed)
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(4, 24)), max_len=96, vocab=6,
                                             trees=int(rng.integers(1, 5)), chunk=8)
        forest = forest_from_trajectories(trajs, tree_of=tree_of, seed=seed)
        for case in cases:
            key = f"seed{seed}-" + "-".join(f"{k}{v}" for k, v in case.items())
            try:
                plan = plan_step(forest, PlanConfig(chunk_size=8, lockstep=True, cross_rank_windows=False, **case))
            except PlanningError:
                got[key] = "PlanningError"
                continue
            plan.header.stats.plan_seconds = 0.0
            got[key] = hashlib.sha256(plan.SerializeToString(deterministic=True)).hexdigest()
    _check("lockstep_plans_sha256.json", got)
