"""The loss of one microbatch from what its forward returned: the RL objective and the MoE balancing loss.

    out = model(layout, run, imports, logprobs=True, entropy=cfg.needs_entropy)
    mb_loss = microbatch_loss(out, layout, norm, cfg)        # MicrobatchLoss: loss (with graph), terms, ...

The objective (`trainer.objectives.policy_loss`) in trajectory space with the step-global
normalisers, plus the occurrence-weighted load-balancing loss of MoE layers. Pure: it reads the
forward's outputs and the layout only, so a recomputed forward gives the same loss
(docs/design/execution.md, "The loss").
Legend: R rows, P log-prob entries, E experts, k top-k, U distinct logit rows, V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.layout import RowLayout
from trainer.models.qwen3_next import ModelOutput
from trainer.objectives import LossTerms, Normalizers, ObjectiveConfig, policy_loss


@dataclass(slots=True, kw_only=True)
class LossConfig:
    """What the loss of a microbatch contains."""

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The RL objective."""
    aux_loss_coef: float = 0.0
    """Weight of the occurrence-weighted load-balancing loss (MoE only)."""
    want_entropy: bool = False
    """Compute per-entry entropies even when the objective does not use them."""
    num_experts: int = 0
    """Experts per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts per token."""

    @property
    def needs_entropy(self) -> bool:
        """Whether the forward must compute entropies."""
        return self.want_entropy or self.objective.entropy_coef > 0


@dataclass(slots=True, kw_only=True)
class MicrobatchLoss:
    """The loss of one microbatch and what the step reports from it."""

    loss: torch.Tensor
    """Scalar with graph: objective + aux_loss_coef * load-balancing loss."""
    terms: LossTerms
    aux: torch.Tensor
    """Detached load-balancing loss (0 for dense models)."""
    logprob: torch.Tensor
    """Detached [P] log-probs of the log-prob entries."""
    entropy: torch.Tensor | None
    """Detached [P] entropies (when computed)."""


def microbatch_loss(out: ModelOutput, layout: RowLayout, norm: Normalizers, cfg: LossConfig) -> MicrobatchLoss:
    """Log-probs through the log-prob map and the loss terms (docs/design/execution.md, "The loss")."""
    lp = layout.logprobs
    logprob_P, entropy_P = out.logprob, out.entropy
    if logprob_P is None:
        raise ValueError("microbatch_loss: expected a forward run with logprobs=True, got no log-probs")
    if cfg.needs_entropy and entropy_P is None:
        raise ValueError("microbatch_loss: the objective needs entropies; run the forward with entropy=True")
    terms = policy_loss(
        logprob_P, old_logprob_P=lp.old_logprob, ref_logprob_P=lp.ref_logprob, advantage_P=lp.advantage,
        loss_mask_P=lp.loss_mask, traj_P=lp.traj, entropy_P=entropy_P, norm=norm, cfg=cfg.objective,
    )
    loss = terms.loss
    aux = torch.zeros(())
    if cfg.num_experts and out.router_probs:
        aux = load_balancing_loss(out.router_probs, out.router_topk, layout.occurrence, cfg.num_experts, cfg.top_k)
        if cfg.aux_loss_coef > 0:
            loss = loss + cfg.aux_loss_coef * aux
    return MicrobatchLoss(loss=loss, terms=terms, aux=aux.detach(), logprob=logprob_P.detach(),
                          entropy=None if entropy_P is None else entropy_P.detach())


def load_balancing_loss(router_probs: dict[int, torch.Tensor], router_topk: dict[int, torch.Tensor],
                        occurrence_R: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss over all MoE layers with each row weighted by its occurrence.

    Equals transformers' `load_balancing_loss_func` evaluated on the expanded rows of the same
    token multiset (a row with occurrence n counts as n rows; duplicated rows count 0).
    """
    dtype = next(iter(router_probs.values())).dtype if router_probs else torch.float32
    w_R = occurrence_R.to(dtype)
    counts_E = w_R.new_zeros(num_experts)
    probs_E = w_R.new_zeros(num_experts)
    total = w_R.new_zeros(())
    for layer, probs_RE in router_probs.items():
        topk = router_topk[layer]
        counts_E = counts_E.index_add(0, topk.reshape(-1), w_R.repeat_interleave(top_k))
        probs_E = probs_E + (probs_RE * w_R[:, None]).sum(0)
        total = total + w_R.sum()
    total = total.clamp_min(1.0)
    return num_experts * ((counts_E / total) * (probs_E / total)).sum()


def expert_load(router_topk: dict[int, torch.Tensor], occurrence_R: torch.Tensor, moe_layers: list[int],
                num_experts: int) -> torch.Tensor:
    """float64 [MoE layers, E] trajectory-weighted routing counts of one microbatch, on its device.

    Sums of integers in float64: exact, so the order of the index_add does not matter."""
    occ = occurrence_R.double()
    out = occ.new_zeros(len(moe_layers), max(num_experts, 1))
    for j, layer in enumerate(moe_layers):
        topk = router_topk[layer]
        out[j].index_add_(0, topk.reshape(-1), occ.repeat_interleave(topk.shape[1]))
    return out
