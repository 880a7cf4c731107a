"""RolloutBatch.policy_version travels from a generator (JSON or protobuf) into the plan header,
with the trajectories' rewards; the trainer reads both (staleness bound, reward metrics)."""
from __future__ import annotations

import pytest

from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from proto.arrays import unpack
from trainer.metrics import reward_metrics
from harts_client.rollouts import RolloutBatchBuilder, Trajectory, supports_policy_version
from trainer.staleness import batch_policy_version


def _batch(version):
    b = RolloutBatchBuilder("pv", vocab_size=256, policy_version=version)
    for j, r in enumerate((0.0, 1.0, 0.5)):
        t = Trajectory(f"t{j}", [1, 2, 3, 4], group_id="g").add_completion([5 + j, 6], [-0.5, -0.25])
        t.reward, t.advantage = r, r - 0.5
        b.add(t)
    return b


@pytest.mark.parametrize("form", ["flat", "tree"])
def test_policy_version_and_rewards_reach_the_plan_header(form):
    assert supports_policy_version()
    plan = plan_step(forest_from_json(_batch(7).to_json(form)), PlanConfig(world_size=1, microbatch_tokens=64, chunk_size=16))
    assert batch_policy_version(plan.header) == 7
    assert unpack(plan.header.trajectory_rewards, "float32").tolist() == [0.0, 1.0, 0.5]
    assert reward_metrics(plan.header)["reward_max"] == 1.0
    unversioned = plan_step(forest_from_json(_batch(None).to_json(form)), PlanConfig(world_size=1, microbatch_tokens=64, chunk_size=16))
    assert batch_policy_version(unversioned.header) is None


def test_policy_version_in_protobuf_and_rejected_when_negative():
    from planner_service.errors import ValidationError
    from planner_service.ingest import forest_from_proto

    assert forest_from_proto(_batch(3).to_proto("tree").SerializeToString()).policy_version == 3
    doc = _batch(1).to_json("flat")
    doc["policy_version"] = -1
    with pytest.raises(ValidationError, match="policy_version"):
        forest_from_json(doc)


@pytest.mark.integration
def test_trainer_rejects_a_batch_staler_than_max_staleness(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from planner_service.server import ServerProcess
    from harts_client.client import PlannerClient

    root = Path(__file__).resolve().parents[2]
    srv = ServerProcess(tmp_path / "planner.db").start()
    try:
        with PlannerClient(srv.http_url) as c:
            for i in range(2):
                b = _batch(0)  # both sampled with the initial weights (version 0)
                b.batch_id = f"pv-{i}"
                b.submit(c, form="tree", world_size=1, chunk_size=16, microbatch_tokens=64, no_windows=True)
        metrics = tmp_path / "m.jsonl"
        out = subprocess.run([sys.executable, "-m", "trainer.train", "--planner.url", srv.http_url, "--job.steps", "2",
                              "--job.step_prefix", "pv-", "--executor.chunk_size", "16", "--staleness.max_staleness", "0",
                              "--metrics.jsonl", str(metrics), "--optimizer.lr", "0.01"],
                             cwd=root, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
    finally:
        srv.stop()
    first, second = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert (first["staleness"], first["skipped"], first["batch_policy_version"]) == (0, 0, 0)
    assert (second["staleness"], second["skipped"], second["grad_norm"]) == (1, 1, 0.0)
    assert first["reward_max"] == 1.0 and "stale batch rejected" in out.stderr


@pytest.mark.integration
def test_trainer_rejects_a_batch_newer_than_its_policy_naming_both_versions(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from planner_service.server import ServerProcess
    from harts_client.client import PlannerClient

    root = Path(__file__).resolve().parents[2]
    srv = ServerProcess(tmp_path / "planner.db").start()
    try:
        with PlannerClient(srv.http_url) as c:
            b = _batch(5)  # claims version 5; a fresh trainer is at version 0
            b.batch_id = "neg-0"
            b.submit(c, form="tree", world_size=1, chunk_size=16, microbatch_tokens=64)
        out = subprocess.run([sys.executable, "-m", "trainer.train", "--planner.url", srv.http_url, "--job.steps", "1",
                              "--job.step_prefix", "neg-", "--executor.chunk_size", "16"],
                             cwd=root, capture_output=True, text=True, timeout=120)
    finally:
        srv.stop()
    assert out.returncode == 1, out.stderr[-3000:]
    assert "policy_version 5 is newer than this trainer's policy version 0" in out.stderr
    assert "Traceback" not in out.stderr
