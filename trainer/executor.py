"""Run a step's plan on the model: forward + backward per microbatch, gradient accumulation (DESIGN §5).

    from trainer.executor import Executor, ExecutorConfig
    ex = Executor(model, ExecutorConfig(chunk_size=64))
    result = ex.run_step(plan_or_slice, optimizer=opt)      # StepResult: loss, expert loads, tokens...

One code path for tree plans and trajectory-expanded plans (PlanConfig(sharing=False)): the
expanded baseline is just a plan whose trees are single trajectories. A `plan_pb2.Plan` runs
every rank's microbatches in this process (rank after rank, gradients summed: with the plan's
global normalisers that equals a data-parallel step whose gradients are SUM-reduced); a
`plan_pb2.PlanSlice` runs one rank. Plans are validated first (`proto.plan_validator`) and
rejected when they were made for another chunk size, conv kernel or vocabulary, or when a
microbatch imports from another (sharing windows: plan with windows=False).

Dtypes: values upcast for accuracy (logits, log-probs, router probabilities, the load-balancing
loss) use `compute_dtype` (at least fp32), so a float64 model (`model.double()`, the oracle of
`harts verify --f64-reference`) runs in float64 end to end.

Legend: R rows, P log-prob entries, E experts, k top-k, U distinct logit rows.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from trainer.layout import RowLayout, layout_from_microbatch
from trainer.models.qwen3_next import Capture, Qwen3NextForRL, RunOptions, compute_dtype
from trainer.objectives import Normalizers, ObjectiveConfig, policy_loss

log = logging.getLogger(__name__)


def kernel_backend(name: str):
    """chunk_gated_delta_rule bound to a backend ("ref": PyTorch, "triton": fused kernel)."""
    from kernels.gated_delta_rule import BACKENDS, chunk_gated_delta_rule

    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    return functools.partial(chunk_gated_delta_rule, backend=name)


@dataclass(slots=True, kw_only=True)
class ExecutorConfig:
    """How the executor runs plans."""

    chunk_size: int = 64
    """Linear-attention kernel chunk size C; plans made for another C are rejected."""
    backend: str = "ref"
    """Kernel backend of the chunked gated delta rule ("ref" on CPU)."""
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The RL loss."""
    aux_loss_coef: float = 0.0
    """Weight of the occurrence-weighted load-balancing loss of each microbatch (MoE only)."""
    want_logprobs: bool = False
    """Return per-trajectory log-probs in StepResult.logprobs."""
    want_entropies: bool = False
    """Return per-trajectory entropies in StepResult.entropies."""
    capture_linear: bool = False
    """Return every linear-attention layer's output per trajectory position (verification)."""
    validate: bool = True
    """Run proto.plan_validator on the plan first."""

    def __post_init__(self) -> None:
        c = self.chunk_size
        if c < 1 or c & (c - 1):
            raise ValueError(f"chunk_size: expected a power of two, got {c}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef: expected >= 0, got {self.aux_loss_coef}")


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one step produced. Losses are step totals (sums of microbatch losses)."""

    loss: float
    policy_loss: float
    kl: float
    entropy_bonus: float
    aux_loss: float
    expert_load: np.ndarray
    """int64 [MoE layers, E] trajectory-weighted routing counts (equal to the expanded batch's)."""
    computed_tokens: int
    """Rows run, replay rows included."""
    expanded_tokens: int
    loss_tokens: float
    microbatches: int
    seconds: float
    logprobs: dict[str, np.ndarray] | None = None
    """trajectory id -> float64 [L-1] log-probs of positions 1..L-1 (NaN without an entry)."""
    entropies: dict[str, np.ndarray] | None = None
    linear_outputs: dict[str, dict[int, np.ndarray]] | None = None
    """trajectory id -> layer -> [L-1, Hv, Vd] outputs at positions 0..L-2 (NaN without an entry;
    float32, float64 for a float64 model)."""

    def summary(self) -> dict:
        return {
            "loss": self.loss, "policy_loss": self.policy_loss, "kl": self.kl, "aux_loss": self.aux_loss,
            "computed_tokens": self.computed_tokens, "expanded_tokens": self.expanded_tokens,
            "microbatches": self.microbatches, "seconds": round(self.seconds, 4),
        }


def _normalizers(header: plan_pb2.PlanHeader) -> Normalizers:
    n = header.normalizers
    return Normalizers(
        total_loss_tokens=float(n.total_loss_tokens), num_trajectories=int(n.num_trajectories),
        traj_loss_tokens=torch.from_numpy(unpack(n.traj_loss_tokens, "float32", name="normalizers.traj_loss_tokens").copy()),
        traj_weight=torch.from_numpy(unpack(n.traj_weight, "float32", name="normalizers.traj_weight").copy()),
    )


def rank_plans(plan) -> tuple[plan_pb2.PlanHeader, list[plan_pb2.RankPlan]]:
    """(header, rank plans) of a Plan (every rank) or a PlanSlice (its one rank)."""
    if isinstance(plan, plan_pb2.PlanSlice):
        return plan.header, [plan.rank]
    if isinstance(plan, plan_pb2.Plan):
        return plan.header, list(plan.ranks)
    raise TypeError(f"plan: expected plan_pb2.Plan or plan_pb2.PlanSlice, got {type(plan).__name__}")


def _validate(plan) -> None:
    try:
        from proto import plan_validator
    except ImportError:  # pragma: no cover - the validator ships with proto/
        log.warning("proto.plan_validator is not available; running the plan unvalidated")
        return
    if isinstance(plan, plan_pb2.PlanSlice):
        plan_validator.validate_slice(plan)
    else:
        plan_validator.validate_plan(plan)


class Executor:
    """Runs plans on one model replica."""

    def __init__(self, model: Qwen3NextForRL, cfg: ExecutorConfig | None = None):
        self.model = model
        self.cfg = cfg or ExecutorConfig()
        self.run_options = RunOptions(linear_fn=kernel_backend(self.cfg.backend), chunk_size=self.cfg.chunk_size)
        mc = model.config
        self.moe_layers = mc.moe_layers
        self.num_experts = mc.num_experts
        self.device = next(model.parameters()).device

    def check_plan(self, plan) -> None:
        """Reject a plan this model cannot run exactly; raises ValueError naming the field."""
        header, ranks = rank_plans(plan)
        p, mc = header.params, self.model.config
        if p.chunk_size != self.cfg.chunk_size:
            raise ValueError(f"plan params.chunk_size: expected {self.cfg.chunk_size} (the kernel's), got {p.chunk_size}; re-plan with chunk_size={self.cfg.chunk_size}")
        if p.conv_kernel != mc.linear_conv_kernel_dim:
            raise ValueError(f"plan params.conv_kernel: expected {mc.linear_conv_kernel_dim} (the model's), got {p.conv_kernel}")
        if p.vocab_size != mc.vocab_size:
            raise ValueError(f"plan params.vocab_size: expected {mc.vocab_size} (the model's), got {p.vocab_size}")
        for rank in ranks:
            for mb in rank.microbatches:
                if len(mb.import_row) or len(mb.state_imports):
                    raise ValueError(
                        f"microbatch {mb.id}: expected no imports, got a sharing-window dependency; this trainer runs "
                        "independent microbatches only: plan the step with windows=False"
                    )

    def run_step(self, plan, *, optimizer: torch.optim.Optimizer | None = None, backward: bool = True, zero_grad: bool = True) -> StepResult:
        """Run every microbatch of a Plan (all ranks) or a PlanSlice (one rank).

        Args:
            plan: plan_pb2.Plan or plan_pb2.PlanSlice.
            optimizer: stepped (and its gradients zeroed) after the last backward, if given.
            backward: False runs forward only (no graph).
            zero_grad: clear parameter gradients before the first backward.
        Side effects: parameter .grad accumulates the step's gradient (kept when optimizer is None).
        """
        t0 = time.perf_counter()
        self.check_plan(plan)
        if self.cfg.validate:
            _validate(plan)
        header, ranks = rank_plans(plan)
        norm = _normalizers(header).to(self.device)
        if backward and zero_grad:
            self.model.zero_grad(set_to_none=True)
        acc = _Accumulator(self, header)
        for rank in ranks:
            steps = [(s.kind, s.microbatch) for s in rank.steps] or [
                (k, i) for i in range(len(rank.microbatches)) for k in (plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD)
            ]
            pending: dict[int, torch.Tensor] = {}
            for kind, i in steps:
                mb = rank.microbatches[i]
                if kind == plan_pb2.ExecStep.FORWARD:
                    pending[i] = self._forward(mb, norm, acc, grad=backward)
                else:
                    loss = pending.pop(i)
                    if backward and loss.requires_grad:
                        loss.backward()
            assert not pending, f"microbatches {sorted(pending)} were forwarded but never backwarded"
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return acc.result(time.perf_counter() - t0)

    def _forward(self, mb: plan_pb2.Microbatch, norm: Normalizers, acc: "_Accumulator", *, grad: bool) -> torch.Tensor:
        mc = self.model.config
        layout = layout_from_microbatch(mb, conv_kernel=mc.linear_conv_kernel_dim, chunk_size=self.cfg.chunk_size, vocab_size=mc.vocab_size)
        layout.to(self.device)
        capture = Capture(linear_outputs=self.cfg.capture_linear)
        with torch.set_grad_enabled(grad):
            h_RD = self.model(layout, self.run_options, capture)
            out = self.microbatch_loss(h_RD, layout, norm, capture)
        acc.add(mb, layout, out, capture)
        return out["loss"]

    def microbatch_loss(self, h_RD: torch.Tensor, layout: RowLayout, norm: Normalizers, capture: Capture) -> dict:
        """Log-probs through the log-prob map (logits once per distinct row) and the loss terms."""
        lp = layout.logprobs
        ocfg = self.cfg.objective
        need_entropy = self.cfg.want_entropies or ocfg.entropy_coef > 0
        rows_U, inv_P = torch.unique(lp.row, return_inverse=True)
        logits_UV = self.model.logits(h_RD.index_select(0, rows_U))
        logits_UV = logits_UV.to(compute_dtype(logits_UV))
        lse_U = torch.logsumexp(logits_UV, dim=-1)
        logprob_P = logits_UV[inv_P, lp.label] - lse_U[inv_P]
        entropy_P = None
        if need_entropy:
            p_UV = torch.softmax(logits_UV, dim=-1)
            entropy_P = (lse_U - (p_UV * logits_UV).sum(-1))[inv_P]
        terms = policy_loss(
            logprob_P, old_logprob_P=lp.old_logprob, ref_logprob_P=lp.ref_logprob, advantage_P=lp.advantage,
            loss_mask_P=lp.loss_mask, traj_P=lp.traj, entropy_P=entropy_P, norm=norm, cfg=ocfg,
        )
        loss = terms.loss
        aux = torch.zeros(())
        if self.moe_layers and capture.router_probs:
            aux = load_balancing_loss(capture, layout.occurrence, self.num_experts, self.model.config.num_experts_per_tok)
            if self.cfg.aux_loss_coef > 0:
                loss = loss + self.cfg.aux_loss_coef * aux
        return {"loss": loss, "terms": terms, "aux": aux.detach(), "logprob": logprob_P.detach(),
                "entropy": None if entropy_P is None else entropy_P.detach()}


def load_balancing_loss(capture: Capture, occurrence_R: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-style auxiliary loss over all MoE layers with each row weighted by its occurrence.

    Equals transformers' `load_balancing_loss_func` evaluated on the expanded rows of the same
    token multiset (a row with occurrence n counts as n rows; duplicated rows count 0).
    """
    dtype = next(iter(capture.router_probs.values())).dtype if capture.router_probs else torch.float32
    w_R = occurrence_R.to(dtype)
    counts_E = w_R.new_zeros(num_experts)
    probs_E = w_R.new_zeros(num_experts)
    total = w_R.new_zeros(())
    for layer, probs_RE in capture.router_probs.items():
        topk = capture.router_topk[layer]
        counts_E = counts_E.index_add(0, topk.reshape(-1), w_R.repeat_interleave(top_k))
        probs_E = probs_E + (probs_RE * w_R[:, None]).sum(0)
        total = total + w_R.sum()
    total = total.clamp_min(1.0)
    return num_experts * ((counts_E / total) * (probs_E / total)).sum()


class _Accumulator:
    """Collects per-microbatch outputs into step totals and trajectory-space arrays."""

    def __init__(self, ex: Executor, header: plan_pb2.PlanHeader):
        self.ex = ex
        self.header = header
        self.ids = list(header.trajectory_ids)
        self.lengths = unpack(header.trajectory_lengths, "int32", name="header.trajectory_lengths")
        self.loss = self.policy = self.kl = self.ent = self.aux = 0.0
        self.loss_tokens = 0.0
        self.computed = 0
        self.n_mb = 0
        self.load = np.zeros((len(ex.moe_layers), max(ex.num_experts, 1)), np.float64)
        cfg = ex.cfg
        # Trajectory-space arrays, flat: positions 1..L-1 of trajectory t at offsets[t] + pos - 1.
        self.offsets = np.concatenate([[0], np.cumsum(np.maximum(self.lengths.astype(np.int64) - 1, 0))])
        n = int(self.offsets[-1])
        self.logprobs = np.full(n, np.nan) if cfg.want_logprobs else None
        self.entropies = np.full(n, np.nan) if cfg.want_entropies else None
        self.linear: dict[int, np.ndarray] | None = {} if cfg.capture_linear else None

    def add(self, mb, layout: RowLayout, out: dict, capture: Capture) -> None:
        t = out["terms"]
        self.loss += float(out["loss"].detach())
        self.policy += float(t.policy)
        self.kl += float(t.kl)
        self.ent += float(t.entropy)
        self.aux += float(out["aux"])
        lp = layout.logprobs
        self.loss_tokens += float(lp.loss_mask.sum())  # one host sync per microbatch, for reports
        self.computed += layout.num_rows + int(sum(len(c.gather_idx) - len(c.keep_idx) for c in layout.linear_calls))
        self.n_mb += 1
        occ = layout.occurrence.double().cpu()
        for j, layer in enumerate(self.ex.moe_layers):
            topk = capture.router_topk[layer].cpu()
            self.load[j] += torch.zeros(self.load.shape[1], dtype=torch.float64).index_add(
                0, topk.reshape(-1), occ.repeat_interleave(topk.shape[1])).numpy()
        flat = self.offsets[lp.traj.cpu().numpy()] + lp.pos.cpu().numpy() - 1
        if self.logprobs is not None:
            self.logprobs[flat] = out["logprob"].double().cpu().numpy()
        if self.entropies is not None:
            self.entropies[flat] = out["entropy"].double().cpu().numpy()
        if self.linear is not None:
            for layer, o_RHV in capture.linear.items():
                o_PHV = o_RHV.index_select(0, lp.row).to(compute_dtype(o_RHV)).cpu().numpy()
                if layer not in self.linear:
                    self.linear[layer] = np.full((int(self.offsets[-1]), *o_RHV.shape[1:]), np.nan, o_PHV.dtype)
                self.linear[layer][flat] = o_PHV

    def _split(self, flat: np.ndarray | None) -> dict[str, np.ndarray] | None:
        if flat is None:
            return None
        return {tid: flat[self.offsets[t] : self.offsets[t + 1]] for t, tid in enumerate(self.ids)}

    def result(self, seconds: float) -> StepResult:
        linear = None
        if self.linear is not None:
            linear = {tid: {layer: arr[self.offsets[t] : self.offsets[t + 1]] for layer, arr in self.linear.items()}
                      for t, tid in enumerate(self.ids)}
        return StepResult(
            loss=self.loss, policy_loss=self.policy, kl=self.kl, entropy_bonus=self.ent, aux_loss=self.aux,
            expert_load=np.rint(self.load).astype(np.int64), computed_tokens=self.computed,
            expanded_tokens=int(self.header.stats.expanded_tokens) or int(self.lengths.sum()),
            loss_tokens=self.loss_tokens, microbatches=self.n_mb, seconds=seconds,
            logprobs=self._split(self.logprobs), entropies=self._split(self.entropies), linear_outputs=linear,
        )
