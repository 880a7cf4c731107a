"""Run a step's plan on the model: decode and check it once, then walk each rank's steps.

    ex = Executor(model, ExecutorConfig(chunk_size=64))
    result = ex.run_step(plan_or_slice)       # StepResult; the step's gradients are left in .grad
    result = train_step(ex, plan, optimizer)  # the same plus one optimizer step (single process)

A `PlanSlice` runs one rank; a whole `Plan` runs every rank in this process, gradients summed.
`Executor.decode` is the one place that chooses how much is checked (`validate`); the walk with
sharing windows, recomputation, stand-ins and cross edges is `trainer.step_walk`
(docs/design/execution.md, docs/design/windows.md). Legend: R rows, P log-prob entries, E experts.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.cross_edges import check_plan_edges
from plan.decode import DecodedSlice, decode_rank, rank_plans
from plan.header import check_header
from plan.microbatch import decode_microbatch
from plan.slice_check import check_decoded
from trainer.boundary import Imports, export_layout
from trainer.config.schema import ExecutorSection
from trainer.cross_rank import LocalTransport
from trainer.layout import RowLayout, layout_from_arrays
from trainer.lockstep import standin_microbatch
from trainer.loss import LossConfig, MicrobatchLoss, microbatch_loss
from trainer.models.ops import select_ops
from trainer.models.qwen3_next import CHECKPOINTING, ModelOutput, Qwen3NextForRL, RunOptions
from trainer.objectives import Normalizers, ObjectiveConfig
from trainer.step_walk import RankWalk, StepResult, StepRun


VALIDATE_MODES = ("check", "full", "none")


def kernel_backend(name: str):
    """chunk_gated_delta_rule bound to a backend ("ref": PyTorch, "triton": fused kernel; the executor
    resolves "auto")."""
    from kernels.gated_delta_rule import BACKENDS, chunk_gated_delta_rule

    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    return functools.partial(chunk_gated_delta_rule, backend=name)


@dataclass(slots=True, kw_only=True)
class ExecutorConfig(ExecutorSection):
    """How the executor runs plans: the config file's `executor` section (chunk_size, backend,
    aux_loss_coef, attention_backend; `trainer.config.ExecutorSection`) plus what a caller sets in code."""

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """The RL loss."""
    want_logprobs: bool = False
    """Return per-trajectory log-probs in StepResult.logprobs."""
    want_entropies: bool = False
    """Return per-trajectory entropies in StepResult.entropies."""
    capture_linear: bool = False
    """Return every linear-attention layer's output per trajectory position (verification)."""
    validate: str = "check"
    """"check": the linear-time slice check (`plan.slice_check`) of every rank; "full": also the
    complete validator (`plan.validator`, up to 10x the planning time: tests and tools);
    "none": decode only (bounds checks)."""
    check_recompute: bool = False
    """Assert that a recomputed forward reproduces its first forward's exports bitwise (tests)."""
    reach_all_units: bool = False
    """Add an exact zero, 0 * sum(final hidden states), to every loss that is backpropagated, so
    that every backward reaches every decoder block and the root: a sharded (FSDP2) unit that a
    backward does not reach issues none of its collectives there (a window parent whose exports
    come from early layers only, a microbatch or stand-in without log-prob entries) and the ranks
    would pair different collectives. The trainer sets it for FSDP2 (`trainer.parallelize`)."""
    activation_dtype: torch.dtype | None = None
    """The dtype the model computes activations in (FSDP2's param_dtype under mixed precision);
    windows across ranks send their exports in it (`trainer.boundary.export_layout`). None: the
    model's parameter dtype."""
    activation_checkpointing: str = "none"
    """Per decoder block: "none", "full" or "selective" (`trainer.models.qwen3_next.RunOptions`;
    the trainer sets it from `parallelism.activation_checkpointing`)."""

    def __post_init__(self) -> None:
        ExecutorSection.__post_init__(self)  # zero-argument super() fails in slotted dataclasses
        if self.validate not in VALIDATE_MODES:
            raise ValueError(f"validate: expected one of {VALIDATE_MODES}, got {self.validate!r}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing: expected one of {CHECKPOINTING}, "
                             f"got {self.activation_checkpointing!r}")


def normalizers_from_header(header: plan_pb2.PlanHeader) -> Normalizers:
    """The loss normalisers a plan's header carries, as tensors on the CPU."""
    n = header.normalizers
    return Normalizers(
        total_loss_tokens=float(n.total_loss_tokens), num_trajectories=int(n.num_trajectories),
        traj_loss_tokens=torch.from_numpy(unpack(n.traj_loss_tokens, "float32", name="normalizers.traj_loss_tokens").copy()),
        traj_weight=torch.from_numpy(unpack(n.traj_weight, "float32", name="normalizers.traj_weight").copy()),
    )


class Executor:
    """Runs plans on one model replica."""

    def __init__(self, model: Qwen3NextForRL, cfg: ExecutorConfig | None = None, *, transport=None):
        """
        Args:
            transport: moves the tensors of windows across ranks of a PlanSlice
                (`trainer.cross_rank.P2PTransport`); None: a slice with cross edges is refused.
                A whole Plan runs every rank here and needs none.
        """
        self.model = model
        self.cfg = cfg or ExecutorConfig()
        self.transport = transport
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.batch_invariant = cuda and self.cfg.batch_invariant
        """Layouts prepare the depth-tiled tree attention (`trainer.layout.layout_from_arrays`)."""
        attention = self.cfg.attention_backend
        if attention == "auto":
            attention = "triton" if cuda else "blocked"
        backend = self.cfg.backend if self.cfg.backend != "auto" else ("triton" if cuda else "ref")
        # the batch-invariant mode reduces logits with its row-wise logsumexp (the full head)
        head = self.cfg.head if self.cfg.head != "auto" else ("chunked" if cuda and not self.batch_invariant else "full")
        self.run_options = RunOptions(
            linear_fn=kernel_backend(backend), chunk_size=self.cfg.chunk_size, attention_backend=attention,
            ops=select_ops(self.device, batch_invariant=self.cfg.batch_invariant, compiled=self.cfg.compile), head=head,
            head_chunk=self.cfg.head_chunk, checkpointing=self.cfg.activation_checkpointing,
        )
        self.deterministic = cuda and self.cfg.deterministic
        if self.deterministic:
            # cuBLAS picks a deterministic workspace only when this is set before its handles exist.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        mc = model.config
        self.moe_layers = mc.moe_layers
        self.num_experts = mc.num_experts
        self.loss_cfg = LossConfig(
            objective=self.cfg.objective, aux_loss_coef=self.cfg.aux_loss_coef, want_entropy=self.cfg.want_entropies,
            num_experts=self.num_experts if self.moe_layers else 0, top_k=mc.num_experts_per_tok,
        )
        self.expert_parallel = any(getattr(m, "expert_parallel", None) is not None for m in model.modules())
        """The model's experts are split over ranks (`trainer.expert_parallel`): only lock-step plans run."""
        self._standin_layout: RowLayout | None = None
        self.export_layout = export_layout(mc, self.cfg.activation_dtype or next(model.parameters()).dtype)
        """The exports' names, shapes and dtypes in the order windows across ranks send them."""

    def standin_layout(self, params: plan_pb2.PlanParams) -> RowLayout:
        """The layout of a lock-step stand-in (`trainer.lockstep.standin_microbatch`), made once."""
        if self._standin_layout is None:
            a = decode_microbatch(standin_microbatch(conv_kernel=self.model.config.linear_conv_kernel_dim), params)
            self._standin_layout = layout_from_arrays(a, chunk_size=self.cfg.chunk_size,
                                                      batch_invariant=self.batch_invariant).to(self.device)
        return self._standin_layout

    def check_plan(self, plan) -> None:
        """Reject a plan this model cannot run exactly; raises ValueError naming the field."""
        header, _ = rank_plans(plan)
        p, mc = header.params, self.model.config
        if p.chunk_size != self.cfg.chunk_size:
            raise ValueError(f"plan params.chunk_size: expected {self.cfg.chunk_size} (the kernel's), got {p.chunk_size}; re-plan with chunk_size={self.cfg.chunk_size}")
        if p.conv_kernel != mc.linear_conv_kernel_dim:
            raise ValueError(f"plan params.conv_kernel: expected {mc.linear_conv_kernel_dim} (the model's), got {p.conv_kernel}")
        if p.vocab_size != mc.vocab_size:
            raise ValueError(f"plan params.vocab_size: expected {mc.vocab_size} (the model's), got {p.vocab_size}")
        if self.expert_parallel and not p.lockstep:
            raise ValueError("plan params.lockstep: expected a lock-step plan (topology.lockstep) for a model with expert "
                             "parallelism (every rank of an expert-parallel group runs the same step kinds together), "
                             "got a free plan")

    def decode(self, plan) -> tuple[plan_pb2.PlanHeader, list[DecodedSlice]]:
        """The plan's header and every rank decoded once (`plan.decode.decode_rank`), checked as
        `validate` says: the one place that chooses ("none": decoding's bounds checks only; "check":
        the header rules and `plan.slice_check.check_decoded` per rank; "full": the complete
        validator first, then the same). A whole Plan's cross edges are checked in every mode."""
        self.check_plan(plan)
        header, ranks = rank_plans(plan)
        mode = self.cfg.validate
        if mode == "full":
            from plan import validator as plan_validator  # optional: up to 10x the planning time, tests and tools

            (plan_validator.validate_plan if isinstance(plan, plan_pb2.Plan) else plan_validator.validate_slice)(plan)
        if mode != "none":
            check_header(header)
        decoded = [decode_rank(header, r) for r in ranks]
        if mode != "none":
            decoded = [check_decoded(d) for d in decoded]
        if isinstance(plan, plan_pb2.Plan):
            check_plan_edges(ranks)
        return header, decoded

    def run_step(self, plan, *, backward: bool = True, zero_grad: bool = True,
                 before_last_backward: Callable[[], None] | None = None) -> StepResult:
        """Run every microbatch of a Plan (all ranks) or a PlanSlice (one rank).

        Args:
            plan: plan_pb2.Plan or plan_pb2.PlanSlice.
            backward: False runs forward only (no graph).
            zero_grad: clear parameter gradients before the first backward.
            before_last_backward: called once, right before the step's last backward (e.g. to
                re-enable FSDP gradient reduction that was off for the earlier ones).
        Side effects: parameter .grad accumulates the step's gradient; the caller steps the optimizer.
        A slice with windows across ranks exchanges their tensors with the other ranks through
        the executor's transport (collective with those ranks).
        """
        with deterministic_algorithms(self.deterministic):
            return self._run_step(plan, backward=backward, zero_grad=zero_grad,
                                  before_last_backward=before_last_backward)

    def _run_step(self, plan, *, backward: bool, zero_grad: bool,
                  before_last_backward: Callable[[], None] | None) -> StepResult:
        t0 = time.perf_counter()
        header, decoded = self.decode(plan)
        norm = normalizers_from_header(header).to(self.device)
        if backward and zero_grad:
            self.model.zero_grad(set_to_none=True)
        walks = [RankWalk(self, d) for d in decoded]
        run = StepRun(self, header, norm, backward=backward, walks=walks, before_last_backward=before_last_backward)
        if any(w.edges is not None for w in walks):
            transport = LocalTransport() if isinstance(plan, plan_pb2.Plan) else self.transport
            if transport is None:
                raise ValueError(f"rank {decoded[0].rank}: the slice has {len(decoded[0].edges)} cross edges (windows "
                                 "across ranks) but the executor has no transport; run it under torch.distributed "
                                 "with Executor(..., transport=trainer.cross_rank.P2PTransport(...))")
            run.phases(transport)
        else:
            for w in walks:
                run.walk(w)
        return run.result(time.perf_counter() - t0)

    def forward(self, layout: RowLayout, imports: dict[str, torch.Tensor] | None, norm: Normalizers, *,
                grad: bool) -> tuple[ModelOutput, MicrobatchLoss]:
        """One microbatch forward and its loss (pure: re-running it gives the same outputs)."""
        with torch.set_grad_enabled(grad):
            out = self.model(layout, self.run_options, Imports(imports) if imports else None, logprobs=True,
                             entropy=self.loss_cfg.needs_entropy, capture_linear=self.cfg.capture_linear)
            mb_loss = microbatch_loss(out, layout, norm, self.loss_cfg)
            if grad and self.cfg.reach_all_units:  # + 0.0 exactly: the loss and every gradient keep their bits
                mb_loss.loss = mb_loss.loss + out.hidden.sum() * 0.0
            return out, mb_loss


@contextlib.contextmanager
def deterministic_algorithms(on: bool):
    """`torch.use_deterministic_algorithms(True)` while the block runs (restored after); nothing when off.

    Torch then runs the deterministic variants of the ops this model uses on CUDA (the backward of
    index_select and gather, index_add, index_put with accumulate) and raises on any op that has
    none, so a forgotten nondeterministic op fails loudly instead of changing bits.
    """
    if not on:
        yield
        return
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def train_step(executor: Executor, plan, optimizer: torch.optim.Optimizer) -> StepResult:
    """One single-process training step: `run_step`, then one optimizer step (demo, benchmarks, tests;
    the torchrun trainer syncs and clips gradients in between)."""
    res = executor.run_step(plan)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return res


__all__ = ["Executor", "ExecutorConfig", "StepResult", "kernel_backend", "normalizers_from_header", "train_step"]
