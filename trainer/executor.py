"""Run a step's plan on the model: the rank's execution order with sharing windows (DESIGN §5.2-§5.5).

    from trainer.executor import Executor, ExecutorConfig
    ex = Executor(model, ExecutorConfig(chunk_size=64))
    result = ex.run_step(plan_or_slice)      # StepResult; the step's gradients are left in .grad
    optimizer.step(); optimizer.zero_grad()  # the caller steps (and syncs gradients) once per step
    result = train_step(ex, plan, optimizer) # the same, single process

One code path for tree plans and trajectory-expanded plans (PlanConfig(sharing=False)): the
expanded baseline is just a plan whose trees are single trajectories. A `plan_pb2.Plan` runs
every rank's microbatches in this process (rank after rank, gradients summed: with the plan's
global normalisers that equals a data-parallel step whose gradients are SUM-reduced); a
`plan_pb2.PlanSlice` runs one rank. Each rank is checked in linear time and decoded once
(`plan.slice_check`; `validate="full"` runs the complete oracle `plan.validator` as well);
plans made for another chunk size, conv kernel or vocabulary are rejected.

Sharing windows (DESIGN §5.5). The rank's `ExecStep`s are a depth-first walk over its window
forest. FORWARD m runs m's forward (`Qwen3NextForRL.forward`, pure: it returns logits, MoE
routing and the window exports) on imports that are fresh leaf tensors (`requires_grad=True`)
copied from its exporters' exports, and keeps m open: its loss, its exports and, unless m is
recomputed, its graph. BACKWARD m (after every importer of m has run) runs one
`torch.autograd.backward` over m's loss plus its exports with the gradients its importers
accumulated on them, then hands the gradients of m's own import leaves to m's exporters. A
microbatch marked `recompute` that others import from runs its first forward without a graph,
keeping only its exports; at BACKWARD it re-runs the forward with a graph on the same imports
(the re-run's exports are the same bits: `check_recompute` asserts it) and backpropagates that.
Losses, log-probs, expert loads and probes are recorded from the first forward only.

An open window's importers are found by id, never as the top of the stack: a lock-step order may
open a window above an unrelated open window (still properly nested).

Lock-step plans (DESIGN §5.7; phases and stand-ins checked by `plan.slice_check` with the rules
of `plan.phases`): each rank has one step per phase; stand-in steps (microbatch -1) run a one-row
zero-loss microbatch (`trainer.lockstep`) so that every rank issues the same FSDP2 collectives in
every phase, and every microbatch marked `recompute` re-runs its forward inside its BACKWARD (a
PHASE_RECOMPUTE phase), exporter or not. With `reach_all_units` every backward also carries an
exact zero over the final hidden states, so that it reaches every sharded unit.

Windows across ranks (`RankPlan.cross_edges`, `trainer.cross_rank`): a lock-step plan may run a
window's importer on another rank than its exporter. The exporter's export table then also holds
the rows its remote importers read; at the end of each phase the rank sends or receives the
edges of that phase (exports at `send_phase`, their gradients at `grad_phase`) through the
executor's transport; the importer builds its leaves from what it received exactly as from a
local window, and the exporter's one BACKWARD includes the gradients that came back. A whole
Plan with cross edges runs its ranks phase by phase in this process (`LocalTransport`).

Dtypes: values upcast for accuracy (logits, log-probs, router probabilities, the load-balancing
loss) use `compute_dtype` (at least fp32), so a float64 model (`model.double()`, the oracle of
`harts verify --f64-reference`) runs in float64 end to end.

Legend: R rows, P log-prob entries, E experts.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.cross_edges import check_plan_edges, remote_imports, sent_needs
from plan.microbatch import MicrobatchArrays, decode_microbatch
from plan.decode import BACKWARD, FORWARD, DecodedSlice, decode_rank, rank_plans
from plan.header import check_header
from plan.slice_check import check_decoded
from plan.window_exports import export_needs
from trainer.boundary import Imports, export_layout, kind_of
from trainer.config.schema import ExecutorSection
from trainer.cross_rank import LocalTransport, RankEdges, Received
from kernels.devices import to_device
from trainer.layout import RowLayout, layout_from_arrays
from trainer.lockstep import standin_microbatch
from trainer.loss import LossConfig, MicrobatchLoss, expert_load, microbatch_loss
from trainer.models.ops import select_ops
from trainer.models.qwen3_next import CHECKPOINTING, ModelOutput, Qwen3NextForRL, RunOptions
from trainer.objectives import Normalizers, ObjectiveConfig
from trainer.probes import TrajectoryProbes

log = logging.getLogger(__name__)

VALIDATE_MODES = ("check", "full", "none")
#: a step running longer than this logs its progress every this many seconds
PROGRESS_SECONDS = 10.0


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
    windows: int = 0
    """Microbatches that imported from a window ancestor."""
    recomputed_microbatches: int = 0
    """Window parents whose forward ran twice (activation recomputation)."""
    standins: int = 0
    """Lock-step stand-in steps run (phases where a rank had no real step of the phase's kind)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Sums over microbatches of the objective's `LossTerms.stats` (keys ending in _max / _min:
    max / min), for the trainer's metrics."""
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
            "microbatches": self.microbatches, "windows": self.windows,
            "recomputed_microbatches": self.recomputed_microbatches, "standins": self.standins,
            "seconds": round(self.seconds, 4),
        }


def _normalizers(header: plan_pb2.PlanHeader) -> Normalizers:
    n = header.normalizers
    return Normalizers(
        total_loss_tokens=float(n.total_loss_tokens), num_trajectories=int(n.num_trajectories),
        traj_loss_tokens=torch.from_numpy(unpack(n.traj_loss_tokens, "float32", name="normalizers.traj_loss_tokens").copy()),
        traj_weight=torch.from_numpy(unpack(n.traj_weight, "float32", name="normalizers.traj_weight").copy()),
    )


@dataclass(slots=True, kw_only=True)
class _Open:
    """A microbatch between its FORWARD and BACKWARD steps."""

    layout: RowLayout
    imports: dict[str, torch.Tensor]
    """Its import leaves by name (gradients accumulate on them; empty for a stand-in)."""
    exports: dict[str, torch.Tensor]
    """Its exports by name: with graph, or detached when it will be recomputed."""
    loss: torch.Tensor | None
    """The loss with graph (None when recomputed: the re-run provides it)."""
    recompute: bool
    sources: dict[int, "_Open | Received"] = field(default_factory=dict)
    """Exporter id -> where its imports came from (an open window here, or one across ranks)."""
    export_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> gradient its importers accumulated on the export."""


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
            ops=select_ops(self.device, batch_invariant=self.cfg.batch_invariant), head=head,
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
        norm = _normalizers(header).to(self.device)
        if backward and zero_grad:
            self.model.zero_grad(set_to_none=True)
        walks = [_RankWalk(self, d) for d in decoded]
        run = _StepRun(self, header, norm, backward=backward, walks=walks, before_last_backward=before_last_backward)
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


class _RankWalk:
    """One rank's part of a step: its decoded slice, its open windows and stand-ins, its cross edges."""

    def __init__(self, ex: Executor, d: DecodedSlice):
        self.rank = d.rank
        self.arrays = d.by_id()
        self.ids = [a.id for a in d.microbatches]
        self.steps = [(kind, i, k) for (kind, i), k in zip(d.steps, d.standins)]
        self.phases = d.phases
        order = [self.ids[i] for kind, i, _ in self.steps if kind == FORWARD and i >= 0]
        self.needs = export_needs(self.arrays, order, sent=sent_needs(d.edges, d.rank),
                                  remote=remote_imports(d.edges, d.rank))
        self.edges = RankEdges(d.rank, d.edges, self.needs, ex.export_layout, ex.device) if d.edges else None
        self.open: dict[int, _Open] = {}
        self.standins: dict[int, _Open] = {}

    def finish(self) -> None:
        if self.open:
            raise ValueError(f"rank {self.rank}: microbatches {sorted(self.open)} were forwarded but never backwarded")


class _StepRun:
    """One step's walk over the ranks' execution orders, with their stacks of open windows."""

    def __init__(self, ex: Executor, header: plan_pb2.PlanHeader, norm: Normalizers, *, backward: bool,
                 walks: list[_RankWalk], before_last_backward: Callable[[], None] | None):
        self.ex, self.header, self.norm, self.backward = ex, header, norm, backward
        cfg = ex.cfg
        self.probes = TrajectoryProbes(header, logprobs=cfg.want_logprobs, entropies=cfg.want_entropies,
                                       linear=cfg.capture_linear)
        zero = torch.zeros((), dtype=torch.float64, device=ex.device)
        self.totals = dict(loss=zero, policy=zero, kl=zero, ent=zero, aux=zero, loss_tokens=zero)
        self.stats: dict[str, torch.Tensor] = {}
        self.computed = self.n_mb = self.windows = self.recomputed = self.standins = 0
        self.load = torch.zeros(len(ex.moe_layers), max(ex.num_experts, 1), dtype=torch.float64, device=ex.device)
        self.walks = walks
        self.total_steps, self.steps_done = sum(len(w.steps) for w in walks), 0
        backwards = sum(kind == BACKWARD for w in walks for kind, _, _ in w.steps)
        self.backwards_left = backwards if backward else 0
        self.before_last_backward = before_last_backward
        self.t0 = self.last_report = time.perf_counter()

    def walk(self, w: _RankWalk) -> None:
        """Every step of one rank, in order (a rank without windows across ranks)."""
        for p in range(len(w.steps)):
            self.step(w, p)
        w.finish()

    def phases(self, transport) -> None:
        """Every rank's step of each phase, then the phase's transfers of windows across ranks (a
        lock-step plan: step p of every rank runs in phase p)."""
        kinds = self.walks[0].phases.tolist()
        for p, kind in enumerate(kinds):
            for w in self.walks:
                self.step(w, p)
            moves = [(w, w.edges.transfers(p, w.open, backward=self.backward)) for w in self.walks if w.edges is not None]
            transport.run(p, [t for _, ts in moves for t in ts], kind)
            for w, ts in moves:
                w.edges.complete(ts, w.open)
        for w in self.walks:
            w.finish()

    def step(self, w: _RankWalk, p: int) -> None:
        """Step p of rank w."""
        kind, i, standin = w.steps[p]
        if i < 0:
            self._standin(kind, standin, w.standins)
        elif kind == FORWARD:
            m = w.ids[i]
            w.open[m] = self._forward(w, w.arrays[m])
        else:
            m = w.ids[i]
            if m not in w.open:
                raise ValueError(f"rank {w.rank}: backward of microbatch {m} without an open forward")
            self._backward(m, w.open.pop(m))
        self._progress()

    def _standin(self, kind: int, standin: int, standins: dict[int, _Open]) -> None:
        """A lock-step stand-in: the collectives of a real step of its phase, with an exact zero loss."""
        self.standins += 1
        if kind == BACKWARD and not self.backward:
            return
        if kind == FORWARD:
            layout = self.ex.standin_layout(self.header.params)
            keep = bool(standin) and self.backward
            _, mb_loss = self.ex.forward(layout, None, self.norm, grad=keep)
            if keep:
                standins[standin] = _Open(layout=layout, imports={}, exports={}, loss=mb_loss.loss, recompute=False)
        elif standin:  # PHASE_BACKWARD: through the graph its FORWARD kept
            self._backward(-1, standins.pop(standin))
        else:  # PHASE_RECOMPUTE: forward and backward here
            layout = self.ex.standin_layout(self.header.params)
            self._backward(-1, _Open(layout=layout, imports={}, exports={}, loss=None, recompute=True))

    def _progress(self) -> None:
        """One log line every PROGRESS_SECONDS of a long step."""
        self.steps_done += 1
        now = time.perf_counter()
        if now - self.last_report >= PROGRESS_SECONDS and self.steps_done < self.total_steps:
            self.last_report = now
            log.info("step %s: %d/%d microbatch steps (forward/backward), %d rows so far, %.0f s",
                     self.header.step_id, self.steps_done, self.total_steps, self.computed, now - self.t0)

    def _forward(self, w: _RankWalk, a: MicrobatchArrays) -> _Open:
        ex = self.ex
        needs = w.needs
        remote = w.edges.into(a.id) if w.edges is not None else {}
        if remote:  # the export tables of exporters on other ranks, as this importer receives them
            needs = {**needs, **remote}
        layout = layout_from_arrays(a, needs, chunk_size=ex.cfg.chunk_size, batch_invariant=ex.batch_invariant).to(ex.device)
        sources = self._sources(w, a, layout)
        imports = self._imports(layout, sources)
        # A recomputed forward runs without a graph: only a window parent needs it, but in a lock-step
        # plan every rank re-runs the forwards its phases say (PHASE_RECOMPUTE), exporter or not.
        recompute = bool(a.recompute and self.backward and (a.id in w.needs or self.header.params.lockstep))
        out, mb_loss = ex.forward(layout, imports, self.norm, grad=self.backward and not recompute)
        self._record(a, layout, out, mb_loss)
        if layout.window.imports_anything:
            self.windows += 1
        if recompute:
            self.recomputed += 1
        exports = {k: v.detach() for k, v in out.exports.items()} if not self.backward or recompute else out.exports
        return _Open(layout=layout, imports=imports, exports=exports, loss=None if recompute else mb_loss.loss,
                     recompute=recompute, sources=sources)

    @staticmethod
    def _sources(w: _RankWalk, a: MicrobatchArrays, layout: RowLayout) -> dict[int, "_Open | Received"]:
        """Exporter id -> the open window (or the window across ranks) each of a's imports comes from."""
        received = w.edges.sources(a.id) if w.edges is not None else {}
        out: dict[int, _Open | Received] = {}
        for src in layout.window.import_from.values():
            for e in np.unique(src.exporter).tolist():
                if e in out:
                    continue
                got = received.get(e) if e not in w.open else w.open[e]
                if got is None:
                    raise ValueError(f"microbatch {a.id} imports from microbatch {e}, which is not an open window "
                                     f"on rank {w.rank} and no cross edge brought it")
                out[e] = got
        return out

    def _imports(self, layout: RowLayout, sources: dict[int, "_Open | Received"]) -> dict[str, torch.Tensor]:
        """Fresh leaves of the rows and states this microbatch imports, copied from its exporters."""
        w = layout.window
        imports: dict[str, torch.Tensor] = {}
        for kind, src in w.import_from.items():
            exporters = np.unique(src.exporter).tolist()
            names = [n for n in sources[exporters[0]].exports if kind_of(n) == kind]
            for name in names:
                if len(exporters) == 1:
                    t = sources[exporters[0]].exports[name].detach().index_select(0, to_device(torch.from_numpy(src.position), self.ex.device))
                else:
                    parts, order = [], []
                    for e in exporters:
                        sel = np.flatnonzero(src.exporter == e)
                        pos = to_device(torch.from_numpy(src.position[sel]), self.ex.device)
                        parts.append(sources[e].exports[name].detach().index_select(0, pos))
                        order.append(sel)
                    inv = np.empty(src.exporter.shape[0], np.int64)
                    inv[np.concatenate(order)] = np.arange(src.exporter.shape[0])
                    t = torch.cat(parts).index_select(0, to_device(torch.from_numpy(inv), self.ex.device))
                imports[name] = t.requires_grad_(self.backward)
        return imports

    def _backward(self, m: int, st: _Open) -> None:
        if not self.backward:
            return
        ex = self.ex
        loss, exports = st.loss, st.exports
        if st.recompute:
            out, mb_loss = ex.forward(st.layout, st.imports, self.norm, grad=True)
            if ex.cfg.check_recompute and m >= 0:
                for name, t in st.exports.items():
                    if not torch.equal(out.exports[name].detach(), t):
                        raise AssertionError(f"microbatch {m}: recomputed export {name} differs from the first forward's")
            loss, exports = mb_loss.loss, out.exports
        tensors, grads = [], []
        if loss is not None and loss.requires_grad:
            tensors.append(loss)
            grads.append(None)
        for name, g in st.export_grads.items():
            t = exports[name]
            if t.requires_grad:
                tensors.append(t)
                grads.append(g)
        self.backwards_left -= 1
        if self.backwards_left == 0 and self.before_last_backward is not None:
            self.before_last_backward()
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._hand_back(st)

    def _hand_back(self, st: _Open) -> None:
        """Accumulate the gradients of st's import leaves on its exporters' exports (an open window
        here, or a window across ranks that sends them back at its grad_phase)."""
        w = st.layout.window
        for name, leaf in st.imports.items():
            if leaf.grad is None:
                continue
            src = w.import_from[kind_of(name)]
            for e in np.unique(src.exporter).tolist():
                sel = np.flatnonzero(src.exporter == e)
                g = leaf.grad if sel.shape[0] == src.exporter.shape[0] else leaf.grad.index_select(0, to_device(torch.from_numpy(sel), leaf.device))
                pos = to_device(torch.from_numpy(src.position[sel]), leaf.device)
                target = st.sources[e]
                acc = target.export_grads.get(name)
                if acc is None:
                    acc = target.export_grads[name] = torch.zeros_like(target.exports[name])
                acc.index_add_(0, pos, g)

    def _record(self, a: MicrobatchArrays, layout: RowLayout, out: ModelOutput, mb_loss: MicrobatchLoss) -> None:
        """Step totals, expert loads and probes of one microbatch (from its first forward only),
        accumulated on the device: nothing is read back until `result`."""
        t = mb_loss.terms
        parts = {"loss": mb_loss.loss, "policy": t.policy, "kl": t.kl, "ent": t.entropy, "aux": mb_loss.aux,
                 "loss_tokens": layout.logprobs.loss_mask.sum()}
        for k, v in parts.items():
            self.totals[k] = self.totals[k] + v.detach().double()
        for k, v in (getattr(t, "stats", None) or {}).items():
            v = v.detach().double()
            old = self.stats.get(k)
            if old is None:
                self.stats[k] = v
            elif k.endswith("_max"):
                self.stats[k] = torch.maximum(old, v)
            elif k.endswith("_min"):
                self.stats[k] = torch.minimum(old, v)
            else:
                self.stats[k] = old + v
        self.computed += layout.num_rows + a.num_replay_rows
        self.n_mb += 1
        if self.ex.moe_layers:
            self.load = self.load + expert_load(out.router_topk, layout.occurrence, self.ex.moe_layers, self.ex.num_experts)
        self.probes.add(layout, mb_loss.logprob, mb_loss.entropy, out.linear)

    def result(self, seconds: float) -> StepResult:
        """The step's figures, read from the device once."""
        names = list(self.totals) + list(self.stats)
        values = torch.stack([*self.totals.values(), *self.stats.values()]).tolist()
        got = dict(zip(names, values))
        tot = {k: got[k] for k in self.totals}
        stats = {k: got[k] for k in self.stats}
        lengths = unpack(self.header.trajectory_lengths, "int32", name="header.trajectory_lengths")
        logprobs, entropies, linear = self.probes.per_trajectory()
        return StepResult(
            loss=tot["loss"], policy_loss=tot["policy"], kl=tot["kl"], entropy_bonus=tot["ent"], aux_loss=tot["aux"],
            expert_load=np.rint(self.load.cpu().numpy()).astype(np.int64), computed_tokens=self.computed,
            expanded_tokens=int(self.header.stats.expanded_tokens) or int(lengths.sum()),
            loss_tokens=tot["loss_tokens"], microbatches=self.n_mb, seconds=seconds, windows=self.windows,
            recomputed_microbatches=self.recomputed, stats=stats,
            logprobs=logprobs, entropies=entropies, linear_outputs=linear, standins=self.standins,
        )


__all__ = ["Executor", "ExecutorConfig", "StepResult", "kernel_backend", "train_step"]
