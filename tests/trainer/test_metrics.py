"""trainer.metrics and the objective's metric stats: the numbers a step line reports, rank 0 only,
no duplicate lines after a resume; the staleness rule (trainer.staleness)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from trainer.config import MetricsSection, StalenessSection
from trainer.metrics import MetricsWriter, stat_metrics
from trainer.objectives import Normalizers, ObjectiveConfig, policy_loss
from trainer.staleness import staleness_scale


def _terms(sl=slice(None)):
    rng = np.random.default_rng(3)
    P = 40
    lp = torch.tensor(rng.normal(size=P) * 0.2 - 2.0)
    old = torch.tensor(rng.normal(size=P) * 0.2 - 2.0)
    ref = torch.tensor(rng.normal(size=P) * 0.2 - 2.0)
    ent = torch.tensor(rng.uniform(0, 2, P))
    mask = torch.tensor(rng.integers(0, 2, P), dtype=torch.float64)
    norm = Normalizers(total_loss_tokens=float(mask.sum()), num_trajectories=1, traj_loss_tokens=torch.tensor([1.0]),
                       traj_weight=torch.tensor([1.0]))
    terms = policy_loss(lp[sl], old_logprob_P=old[sl], ref_logprob_P=ref[sl], advantage_P=torch.ones(P)[sl],
                        loss_mask_P=mask[sl], traj_P=torch.zeros(P, dtype=torch.long)[sl], entropy_P=ent[sl], norm=norm,
                        cfg=ObjectiveConfig(clip_low=0.1, clip_high=0.1))
    return terms, (lp, old, ref, ent, mask > 0)


def _reduce(parts):
    sums = {k: sum(float(p.stats[k]) for p in parts) for k in parts[0].stats if not k.endswith(("_max", "_min"))}
    maxes = {"ratio_max": max(float(p.stats["ratio_max"]) for p in parts)}
    mins = {"ratio_min": min(float(p.stats["ratio_min"]) for p in parts)}
    return stat_metrics(sums, maxes, mins)


def test_stats_of_split_microbatches_give_the_batch_metrics():
    whole, (lp, old, ref, ent, m) = _terms()
    split = _reduce([_terms(slice(0, 13))[0], _terms(slice(13, 13))[0], _terms(slice(13, None))[0]])
    ratio = torch.exp(lp - old)[m]
    d = (ref - lp)[m]
    expect = {
        "clip_fraction": float(((ratio < 0.9) | (ratio > 1.1)).double().mean()),
        "approx_kl_old": float(((ratio - 1) - torch.log(ratio)).mean()),
        "kl_ref": float((torch.exp(d) - d - 1).mean()),
        "entropy": float(ent[m].mean()),
        "ratio_mean": float(ratio.mean()), "ratio_std": float(ratio.std(unbiased=False)),
        "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min()),
    }
    assert split.keys() == expect.keys() == _reduce([whole]).keys()
    for k, v in expect.items():
        assert split[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert 0 < split["clip_fraction"] < 1


def test_an_empty_microbatch_has_identity_stats():
    empty, _ = _terms(slice(5, 5))
    assert float(empty.stats["loss_tokens"]) == 0 and float(empty.stats["ratio_max"]) == -math.inf
    assert stat_metrics({k: 0.0 for k in empty.stats}, {}, {}) == {}


def test_writer_creates_the_folder_rank0_only_and_drops_lines_after_the_resumed_step(tmp_path):
    path = tmp_path / "new" / "dir" / "metrics.jsonl"
    w = MetricsWriter(MetricsSection(jsonl=str(path)), is_main=False)
    w.write({"step": 1})
    w.close()
    assert not path.exists()
    w = MetricsWriter(MetricsSection(jsonl=str(path)), is_main=True)
    for s in (1, 2, 3):
        w.write({"step": s, "loss": 0.5})
    w.close()
    w = MetricsWriter(MetricsSection(jsonl=str(path)), is_main=True, resume_step=2)  # checkpoint after step 2
    w.write({"step": 3, "loss": 0.25})
    w.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(m["step"], m["loss"]) for m in lines] == [(1, 0.5), (2, 0.5), (3, 0.25)]


def test_a_resumed_run_that_trains_nothing_leaves_the_metrics_file_alone(tmp_path):
    # a run that exits before its first step (a world-size check) truncated 4 lines to 0
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    w = MetricsWriter(MetricsSection(jsonl=str(path)), is_main=True, resume_step=0)
    w.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "trainer,batch,cfg,expect",
    [
        (5, None, StalenessSection(max_staleness=0), (None, 1.0)),
        (5, 5, StalenessSection(max_staleness=0), (0, 1.0)),
        (5, 3, StalenessSection(max_staleness=2), (2, 1.0)),
        (5, 2, StalenessSection(max_staleness=2), (3, 0.0)),
        (5, 1, StalenessSection(max_staleness=2, mode="downweight", decay=0.5), (4, 0.25)),
        (9, 0, StalenessSection(), (9, 1.0)),
    ],
    ids=["unversioned", "fresh", "at-bound", "reject", "downweight", "unbounded"],
)
def test_staleness_rule(trainer, batch, cfg, expect):
    assert staleness_scale(trainer, batch, cfg) == expect


class _Header:
    """A stand-in PlanHeader of a contract that carries policy_version and trajectory_rewards."""

    class DESCRIPTOR:
        fields_by_name = {"policy_version": None, "trajectory_rewards": None}

    def __init__(self, version, rewards):
        self.policy_version, self._has = version, version is not None
        from proto.arrays import pack

        self.trajectory_rewards = pack(rewards, "float32")

    def HasField(self, name):
        return self._has


def test_batch_version_and_rewards_are_read_when_the_plan_carries_them():
    from proto.harts.v1 import plan_pb2
    from trainer.metrics import reward_metrics
    from trainer.staleness import batch_policy_version

    assert batch_policy_version(_Header(4, [1.0])) == 4 and batch_policy_version(_Header(None, [1.0])) is None
    r = reward_metrics(_Header(None, [0.0, 1.0, 0.5]))
    assert r == pytest.approx({"reward_mean": 0.5, "reward_std": float(np.std([0, 1, 0.5])), "reward_min": 0.0,
                               "reward_max": 1.0})
    # today's contract has neither field: nothing is reported, nothing breaks
    if "policy_version" not in plan_pb2.PlanHeader.DESCRIPTOR.fields_by_name:
        assert batch_policy_version(plan_pb2.PlanHeader()) is None and reward_metrics(plan_pb2.PlanHeader()) == {}
