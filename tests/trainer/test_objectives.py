"""RL objectives (trainer/objectives.py) against the plain-Python reference, and additivity."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.objectives import AGGREGATIONS, Normalizers, ObjectiveConfig, policy_loss, policy_loss_ref


def _entries(seed: int, P: int = 60, T: int = 5):
    rng = np.random.default_rng(seed)
    traj = np.sort(rng.integers(0, T, P))
    return {
        "logprob": torch.tensor(rng.normal(size=P) - 3.0, dtype=torch.float64, requires_grad=True),
        "old": torch.tensor(rng.normal(size=P) * 0.3, dtype=torch.float64) - 3.0,
        "ref": torch.tensor(rng.normal(size=P) * 0.3, dtype=torch.float64) - 3.0,
        "adv": torch.tensor(rng.normal(size=P)),
        "mask": torch.tensor(rng.integers(0, 2, P), dtype=torch.float64),
        "traj": torch.tensor(traj),
        "entropy": torch.tensor(rng.uniform(0, 3, P)),
    }, Normalizers(
        total_loss_tokens=40.0, num_trajectories=T,
        traj_loss_tokens=torch.tensor(rng.integers(1, 15, T), dtype=torch.float32),
        traj_weight=torch.tensor(rng.uniform(0.5, 2.0, T), dtype=torch.float32),
    )


def _loss(e, norm, cfg, sl=slice(None)):
    return policy_loss(
        e["logprob"][sl], old_logprob_P=e["old"][sl], ref_logprob_P=None if e["ref"] is None else e["ref"][sl], advantage_P=e["adv"][sl],
        loss_mask_P=e["mask"][sl], traj_P=e["traj"][sl], entropy_P=e["entropy"][sl], norm=norm, cfg=cfg,
    )


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kl,ent,clip_high", [(0.0, 0.0, 0.2), (0.1, 0.01, 0.28)], ids=["plain", "kl-entropy-cliphigh"])
def test_matches_reference_and_is_additive(aggregation, kl, ent, clip_high):
    e, norm = _entries(7)
    cfg = ObjectiveConfig(aggregation=aggregation, kl_coef=kl, entropy_coef=ent, clip_high=clip_high)
    got = _loss(e, norm, cfg)
    rows = [{"logprob": float(e["logprob"][i].detach()), "old": float(e["old"][i]), "ref": float(e["ref"][i]),
             "adv": float(e["adv"][i]), "mask": int(e["mask"][i]), "traj": int(e["traj"][i]),
             "entropy": float(e["entropy"][i])} for i in range(len(e["traj"]))]
    assert abs(float(got.loss.detach()) - policy_loss_ref(rows, norm, cfg)) <= 1e-6
    # split the entries anywhere (e.g. across microbatches): the pieces sum to the whole
    a, b = _loss(e, norm, cfg, slice(0, 23)), _loss(e, norm, cfg, slice(23, None))
    assert abs(float((a.loss + b.loss).detach()) - float(got.loss.detach())) <= 1e-12


def test_clipping_stops_the_gradient():
    lp = torch.tensor([0.0, 0.0], requires_grad=True)
    norm = Normalizers(total_loss_tokens=2.0, num_trajectories=1, traj_loss_tokens=torch.tensor([2.0]), traj_weight=torch.tensor([1.0]))
    out = policy_loss(lp, old_logprob_P=torch.tensor([-1.0, 1.0]), ref_logprob_P=None, advantage_P=torch.tensor([1.0, -1.0]),
                      loss_mask_P=torch.ones(2), traj_P=torch.tensor([0, 0]), entropy_P=None, norm=norm, cfg=ObjectiveConfig())
    out.loss.backward()
    # entry 0: ratio e > 1.2 with A > 0 -> clipped, no gradient; entry 1: ratio 1/e < 0.8 with A < 0 -> clipped
    assert torch.equal(lp.grad, torch.zeros(2)) and int(out.clip_fraction_num) == 2


def test_on_policy_without_old_logprobs_is_the_policy_gradient():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    norm = Normalizers(total_loss_tokens=2.0, num_trajectories=1, traj_loss_tokens=torch.tensor([2.0]), traj_weight=torch.tensor([1.0]))
    out = policy_loss(lp, old_logprob_P=None, ref_logprob_P=None, advantage_P=torch.tensor([2.0, -1.0]),
                      loss_mask_P=torch.ones(2), traj_P=torch.tensor([0, 0]), entropy_P=None, norm=norm, cfg=ObjectiveConfig())
    out.loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([-1.0, 0.5]))


def test_bad_settings():
    with pytest.raises(ValueError, match="aggregation: expected one of"):
        ObjectiveConfig(aggregation="mean")
    e, norm = _entries(1)
    e["ref"] = None
    with pytest.raises(ValueError, match="kl_coef: expected reference log-probs"):
        _loss(e, norm, ObjectiveConfig(kl_coef=0.1))
