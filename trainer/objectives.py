"""RL objectives in trajectory space with the plan's global normalisers.

    terms = policy_loss(logprob_P, old_logprob_P=old, ref_logprob_P=None, advantage_P=adv, loss_mask_P=mask,
                        traj_P=traj, entropy_P=None, norm=norm, cfg=ObjectiveConfig(clip_high=0.28))

Every term is a sum over log-prob entries divided by step-global denominators, so a step's loss is
the sum of its microbatches' losses however the trajectories are split. The formulas:
docs/design/execution.md ("The loss"); `LossTerms.stats`: docs/design/training-loop.md ("Metrics").
Legend: P log-prob entries, T trajectories.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(slots=True, kw_only=True)
class ObjectiveConfig:
    """The policy loss."""

    clip_low: float = 0.2
    """Lower clip range epsilon (ratio >= 1 - clip_low)."""
    clip_high: float = 0.2
    """Upper clip range epsilon (ratio <= 1 + clip_high); > clip_low gives DAPO's clip-higher."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate to the reference policy (needs ref log-probs)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    aggregation: str = "token-mean"
    """One of AGGREGATIONS."""

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: expected one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError(f"clip_low/clip_high: expected >= 0, got {self.clip_low}, {self.clip_high}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: expected >= 0, got {self.kl_coef}")


@dataclass(slots=True, kw_only=True)
class Normalizers:
    """Step-global denominators (plan_pb2.Normalizers, decoded)."""

    total_loss_tokens: float
    num_trajectories: int
    traj_loss_tokens: torch.Tensor
    """float32 [T]."""
    traj_weight: torch.Tensor
    """float32 [T]."""

    def to(self, device: torch.device | str) -> "Normalizers":
        return Normalizers(total_loss_tokens=self.total_loss_tokens, num_trajectories=self.num_trajectories,
                           traj_loss_tokens=self.traj_loss_tokens.to(device), traj_weight=self.traj_weight.to(device))


@dataclass(slots=True, kw_only=True)
class LossTerms:
    """The loss of one microbatch and its parts (each already globally normalised)."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clip_fraction_num: torch.Tensor
    """Number of loss entries whose ratio was clipped (unnormalised)."""
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    """Detached 0-dim sums / counts / extremes over the loss entries (docs/design/training-loop.md, "Metrics")."""


def entry_denominator(traj_P: torch.Tensor, norm: Normalizers, aggregation: str) -> torch.Tensor:
    """[P] per-entry weight: traj_weight / the aggregation's global denominator."""
    w_P = norm.traj_weight.index_select(0, traj_P).double()
    if aggregation == "token-mean":
        return w_P / max(norm.total_loss_tokens, 1.0)
    n = max(norm.num_trajectories, 1)
    if aggregation == "seq-mean-token-sum":
        return w_P / n
    per_traj = norm.traj_loss_tokens.index_select(0, traj_P).double().clamp_min(1.0)
    return w_P / (per_traj * n)


def policy_loss(
    logprob_P: torch.Tensor,
    *,
    old_logprob_P: torch.Tensor | None,
    ref_logprob_P: torch.Tensor | None,
    advantage_P: torch.Tensor,
    loss_mask_P: torch.Tensor,
    traj_P: torch.Tensor,
    entropy_P: torch.Tensor | None,
    norm: Normalizers,
    cfg: ObjectiveConfig,
) -> LossTerms:
    """Clipped-surrogate loss of a set of log-prob entries (docs/design/execution.md, "The loss").

    Raises:
        ValueError: kl_coef > 0 without reference log-probs, entropy_coef > 0 without entropies.
    """
    old = logprob_P.detach() if old_logprob_P is None else old_logprob_P
    ratio = torch.exp(logprob_P - old)
    adv = advantage_P.to(logprob_P.dtype)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg_P = -torch.minimum(ratio * adv, clipped * adv)
    scale_P = (entry_denominator(traj_P, norm, cfg.aggregation) * loss_mask_P.double()).to(logprob_P.dtype)
    policy = (pg_P * scale_P).sum()
    kl = logprob_P.new_zeros(())
    if cfg.kl_coef > 0:
        if ref_logprob_P is None:
            raise ValueError("kl_coef: expected reference log-probs in the batch (ref_logprobs), got none")
        d = ref_logprob_P - logprob_P
        kl = ((torch.exp(d) - d - 1.0) * scale_P).sum()
    ent = logprob_P.new_zeros(())
    if cfg.entropy_coef > 0:
        if entropy_P is None:
            raise ValueError("entropy_coef: expected entropies to be computed, got none")
        ent = (entropy_P * scale_P).sum()
    loss = policy + cfg.kl_coef * kl - cfg.entropy_coef * ent
    clip_num = (((ratio - clipped).abs() > 0) & (loss_mask_P > 0)).sum()
    stats = loss_stats(logprob_P.detach(), old.detach(), ref_logprob_P, entropy_P, loss_mask_P)
    stats["clipped"] = clip_num.to(stats["loss_tokens"].dtype)
    return LossTerms(loss=loss, policy=policy.detach(), kl=kl.detach(), entropy=ent.detach(), clip_fraction_num=clip_num,
                     stats=stats)


def loss_stats(logprob_P: torch.Tensor, old_P: torch.Tensor, ref_P: torch.Tensor | None, entropy_P: torch.Tensor | None,
               loss_mask_P: torch.Tensor) -> dict[str, torch.Tensor]:
    """The metric numerators of `LossTerms.stats` over the entries with mask = 1 (float64, detached).

    An empty selection gives zero sums and counts, ratio_max = -inf and ratio_min = +inf (the
    identities of max and min), so microbatches and ranks reduce without special cases.
    """
    with torch.no_grad():
        m_P = loss_mask_P > 0
        log_ratio = (logprob_P.double() - old_P.double())[m_P]
        ratio = torch.exp(log_ratio)
        out = {
            "loss_tokens": m_P.sum().double(),
            "ratio_sum": ratio.sum(),
            "ratio_sq_sum": (ratio * ratio).sum(),
            "ratio_max": ratio.max() if ratio.numel() else ratio.new_tensor(float("-inf")),
            "ratio_min": ratio.min() if ratio.numel() else ratio.new_tensor(float("inf")),
            "kl_old_sum": ((ratio - 1.0) - log_ratio).sum(),
        }
        if ref_P is not None:
            d = ref_P.double()[m_P] - logprob_P.double()[m_P]
            out["kl_ref_sum"] = (torch.exp(d) - d - 1.0).sum()
        if entropy_P is not None:
            out["entropy_sum"] = entropy_P.detach().double()[m_P].sum()
    return out


def policy_loss_ref(entries: list[dict], norm: Normalizers, cfg: ObjectiveConfig) -> float:
    """Plain-Python reference over per-entry dicts (keys: logprob, old, ref, adv, mask, traj, entropy)."""
    import math

    total = 0.0
    for e in entries:
        if not e["mask"]:
            continue
        t = e["traj"]
        w = float(norm.traj_weight[t])
        if cfg.aggregation == "token-mean":
            den = max(norm.total_loss_tokens, 1.0)
        elif cfg.aggregation == "seq-mean-token-sum":
            den = max(norm.num_trajectories, 1)
        else:
            den = max(float(norm.traj_loss_tokens[t]), 1.0) * max(norm.num_trajectories, 1)
        old = e["old"] if e["old"] is not None else e["logprob"]
        r = math.exp(e["logprob"] - old)
        rc = min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high)
        term = -min(r * e["adv"], rc * e["adv"])
        if cfg.kl_coef > 0:
            d = e["ref"] - e["logprob"]
            term += cfg.kl_coef * (math.exp(d) - d - 1)
        if cfg.entropy_coef > 0:
            term -= cfg.entropy_coef * e["entropy"]
        total += w * term / den
    return total
