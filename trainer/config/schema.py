"""The trainer's configuration schema: keyword-only, slotted dataclasses, one `*Section` per section.

Every field carries a docstring (shown by `--help`, `trainer.config.cli`) and every section
validates itself in `__post_init__`, raising ValueError that names the field, the value and the
remedy; `trainer.config.loader` prefixes the section (`optimizer.lr: expected > 0, got 0.0`).
Nothing here imports torch: `harts --help` stays fast. `ExecutorSection` holds the executor's
user-facing fields once; `trainer.executor.ExecutorConfig` extends it with what a caller sets in
code (docs/design/training-loop.md, "Configuration").
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from trainer.objectives import ObjectiveConfig

__all__ = [
    "PlannerSection", "JobSection", "ModelSection", "ParallelismSection", "ExecutorSection", "OptimizerSection",
    "LRScheduleSection", "CheckpointSection", "MetricsSection", "StalenessSection", "TrainerConfig", "ConfigError",
    "SECTIONS",
]


class ConfigError(ValueError):
    """A configuration the trainer cannot run (one line, names the dotted field)."""


@dataclass(slots=True, kw_only=True)
class PlannerSection:
    """The planner service the ranks poll."""

    url: str = "http://127.0.0.1:8000"
    """Base URL of the planner's HTTP API (env HARTS_PLANNER_URL when not given); several
    replicas' URLs separated by commas fail over to one another."""
    token: str | None = None
    """Bearer token (env HARTS_TOKEN when not given; None: no Authorization header)."""
    plan_timeout: float = 600.0
    """Seconds to wait for one step's plan slice (long-poll)."""
    ready_timeout: float = 120.0
    """Seconds to wait for the planner to answer /readyz at start-up."""
    retry_seconds: float = 600.0
    """Seconds of planner outage (a restart, a failover) the ranks wait out before they stop."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url: expected a base URL such as http://127.0.0.1:8000, got ''")
        if self.plan_timeout <= 0 or self.ready_timeout <= 0:
            raise ValueError(f"plan_timeout/ready_timeout: expected > 0, got {self.plan_timeout}, {self.ready_timeout}")
        if not 0 <= self.retry_seconds < float("inf"):
            raise ValueError(f"retry_seconds: expected a finite number of seconds >= 0, got {self.retry_seconds}")


@dataclass(slots=True, kw_only=True)
class JobSection:
    """Which planner steps the run trains."""

    steps: int = 1
    """Total number of steps of the run (a resumed run continues up to this count)."""
    step_prefix: str = "step-"
    """Step i (0-based) is `<step_prefix><i>` unless step_ids is given."""
    step_ids: list[str] = field(default_factory=list)
    """Explicit planner step ids, one per step (at least `steps`; comma-separated on the command line)."""
    seed: int = 0
    """Seed of the random weights of a named model (every rank builds the same ones)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")
        if self.step_ids and len(self.step_ids) < self.steps:
            raise ValueError(f"step_ids: expected at least steps={self.steps} ids, got {len(self.step_ids)}")
        if any(not s for s in self.step_ids):
            raise ValueError(f"step_ids: expected non-empty ids, got {self.step_ids}")

    def step_id(self, i: int) -> str:
        return self.step_ids[i] if self.step_ids else f"{self.step_prefix}{i}"


@dataclass(slots=True, kw_only=True)
class ModelSection:
    """The policy model."""

    name: str = "tiny"
    """A named config (tiny, tiny-dense, tiny-deep, small: random weights from job.seed) or a Qwen3-Next HF directory."""


DATA_PARALLEL = ("fsdp", "replicate")
CHECKPOINTING = ("none", "full", "selective")
PARAM_DTYPES = ("auto", "bfloat16", "float32")


@dataclass(slots=True, kw_only=True)
class ParallelismSection:
    """How ranks share the model (`trainer.parallelize`)."""

    data_parallel: str = "fsdp"
    """"fsdp": FSDP2 fully_shard per decoder block + a root unit (embeddings, final norm, lm head);
    "replicate": a full replica per rank and one bucketed SUM all-reduce per step."""
    param_dtype: str = "auto"
    """Compute dtype of the FSDP2 MixedPrecisionPolicy: "auto" (bfloat16 on CUDA, float32 on CPU/gloo),
    "bfloat16" or "float32". Master weights, gradients and optimizer state stay float32."""
    reduce_dtype: str = "float32"
    """Gradient reduce-scatter dtype of FSDP2 (float32 keeps SUM exact to fp32 rounding)."""
    reshard_after_forward: bool | None = None
    """FSDP2 parameters sharded through the step: every decoder block is gathered for each forward
    and each backward and freed after it, and every backward reduce-scatters its gradients into
    the sharded fp32 accumulators, so no rank holds full parameters or full gradients. Needs
    lock-step plans (topology.lockstep: `harts plan --lockstep`); a free plan is refused. false:
    units stay gathered from a step's first forward to its last backward (full parameters plus
    full gradients per rank), any plan runs. none: true when the model's full parameters plus
    gradients exceed reshard_memory_fraction of device_memory_gb."""
    reshard_memory_fraction: float = 0.5
    """The fraction of device memory above which reshard_after_forward = none means true."""
    device_memory_gb: float = 0.0
    """Memory of one device in GiB for the reshard_after_forward default and the start-up memory
    report (0: the CUDA device's own; on the CPU 0 means unknown: none means false, and the
    report uses the host's memory)."""
    p2p_timeout_s: float = 600.0
    """Longest wait, in seconds, for the point-to-point transfers of windows across ranks at the
    end of a phase (lock-step plans with cross edges): a peer that died or hangs makes the rank
    fail with an error naming the phase, the edge and the peer. The wait includes the peer's
    step of that phase, so keep it above the slowest phase."""

    activation_checkpointing: str = "none"
    """Per decoder block: "none"; "full" (keep the block's input, re-run the block in the backward:
    a row keeps hidden x 2 bytes per layer between its forward and backward); "selective" (re-run
    only the FFN, post-attention norm and MoE or MLP, whose saved activations grow with top-k;
    keep the token mixer's). Gradients are bitwise those of "none" on the CPU."""

    expert_parallel: int = 1
    """Ranks each MoE layer's routed experts are split over (E): a (W / E) x E mesh, tokens sent to
    their experts' ranks and back by all-to-all (`trainer.expert_parallel`); E divides the world
    size and num_experts. E > 1 needs data_parallel = "fsdp" and lock-step plans with parameters
    sharded through the step (reshard_after_forward, topology.lockstep)."""

    def __post_init__(self) -> None:
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel: expected >= 1 ranks per expert group, got {self.expert_parallel}")
        if self.expert_parallel > 1 and self.data_parallel != "fsdp":
            raise ValueError(f"expert_parallel: expected 1 with data_parallel={self.data_parallel!r}, got "
                             f"{self.expert_parallel}; use data_parallel='fsdp'")
        if self.expert_parallel > 1 and self.reshard_after_forward is False:
            raise ValueError(f"expert_parallel: expected reshard_after_forward true or none with expert_parallel="
                             f"{self.expert_parallel} (lock-step plans), got false")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing: expected one of {CHECKPOINTING}, "
                             f"got {self.activation_checkpointing!r}")
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel: expected one of {DATA_PARALLEL}, got {self.data_parallel!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype: expected one of {PARAM_DTYPES}, got {self.param_dtype!r}")
        if self.reduce_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"reduce_dtype: expected 'float32' or 'bfloat16', got {self.reduce_dtype!r}")
        if self.reshard_after_forward and self.data_parallel != "fsdp":
            raise ValueError(f"reshard_after_forward: expected false or none with data_parallel={self.data_parallel!r} "
                             "(full replicas), got true; use data_parallel='fsdp'")
        if not 0 < self.reshard_memory_fraction <= 1:
            raise ValueError(f"reshard_memory_fraction: expected in (0, 1], got {self.reshard_memory_fraction}")
        if self.device_memory_gb < 0:
            raise ValueError(f"device_memory_gb: expected >= 0 (0: the device's own), got {self.device_memory_gb}")
        if not self.p2p_timeout_s > 0:
            raise ValueError(f"p2p_timeout_s: expected > 0 seconds, got {self.p2p_timeout_s}")


#: the gated delta rule's backends (`kernels.gated_delta_rule.BACKENDS`) and the tree-attention
#: backends (`kernels.tree_attention.BACKENDS`) plus "auto"; spelled out so that the schema needs no
#: torch (tests/trainer/test_train.py checks them against the kernels).
KERNEL_BACKENDS = ("auto", "ref", "triton")
ATTENTION_BACKENDS = ("auto", "blocked", "triton", "ref")
HEADS = ("auto", "full", "chunked")


@dataclass(slots=True, kw_only=True)
class ExecutorSection:
    """How plans run: the fields a run's config sets (`trainer.executor.ExecutorConfig` adds the rest)."""

    chunk_size: int = 64
    """Linear-attention kernel chunk size C; plans made for another C are rejected."""
    backend: str = "auto"
    """Gated delta rule kernel backend: "auto" ("ref" for a model on the CPU, "triton" on CUDA),
    "ref" (PyTorch: bitwise batch-invariant on the CPU) or "triton" (fused kernel, GPU)."""
    aux_loss_coef: float = 0.0
    """Weight of the occurrence-weighted MoE load-balancing loss of each microbatch."""
    attention_backend: str = "auto"
    """Tree-attention backend: "auto" ("blocked" for a model on the CPU: exact, bitwise batch-invariant;
    "triton" on a GPU), "blocked", "triton" or "ref"."""
    deterministic: bool = True
    """Bitwise the same results for the same plan on CUDA: `torch.use_deterministic_algorithms(True)`
    while a step runs (deterministic index_add / index_put / gather backward; an op without a
    deterministic variant raises). The CPU path is deterministic without it (it is not set there)."""
    batch_invariant: bool = False
    """On CUDA, every reduction in an order fixed by its length alone: fixed-tile GEMMs without split-K,
    row-wise norms, softmax and logsumexp (`kernels.batch_invariant`), tree attention over key tiles
    at fixed depths, the full log-prob head; a row's results then do not depend on how many rows
    its microbatch has, and tree and expanded log-probs agree bitwise in bf16. Slower than the
    default; the CPU path is batch-invariant already."""
    compile: bool = False
    """On CUDA, fuse the model's elementwise chains (norms, SwiGLU, gates, RoPE, the MoE router) with torch.compile:
    one generated kernel per chain instead of a launch per op (`trainer.models.ops.compiled_ops`;
    the first step compiles them). Off by default until measured on a GPU; no effect with
    `batch_invariant` or on the CPU, whose exact forms stay as they are."""
    head: str = "auto"
    """Log-prob head: "full" (logits of every log-prob row, then logsumexp: the CPU's exact path),
    "chunked" (vocabulary chunks with an online logsumexp, no [rows, vocab] tensor), "auto"
    (chunked on CUDA, full on the CPU)."""
    head_chunk: int = 8192
    """Vocabulary columns per step of the chunked head."""

    def __post_init__(self) -> None:
        c = self.chunk_size
        if c < 1 or c & (c - 1):
            raise ValueError(f"chunk_size: expected a power of two, got {c}")
        if self.backend not in KERNEL_BACKENDS:
            raise ValueError(f"backend: expected one of {KERNEL_BACKENDS}, got {self.backend!r}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef: expected >= 0, got {self.aux_loss_coef}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: expected one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.head not in HEADS:
            raise ValueError(f"head: expected one of {HEADS}, got {self.head!r}")
        if self.head_chunk < 1:
            raise ValueError(f"head_chunk: expected >= 1 vocabulary columns, got {self.head_chunk}")


@dataclass(slots=True, kw_only=True)
class OptimizerSection:
    """AdamW (torch's fused kernel) and gradient clipping."""

    name: str = "adamw"
    """Only "adamw" (decoupled weight decay)."""
    lr: float = 1e-4
    """Peak learning rate (after warmup)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas (two numbers; comma-separated on the command line)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this (0: no clipping; the norm is logged either way)."""

    def __post_init__(self) -> None:
        if self.name != "adamw":
            raise ValueError(f"name: expected 'adamw', got {self.name!r}")
        if self.lr <= 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps/weight_decay: expected eps > 0 and weight_decay >= 0, got {self.eps}, {self.weight_decay}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: expected >= 0 (0: no clipping), got {self.max_grad_norm}")


LR_DECAYS = ("constant", "cosine", "linear")


@dataclass(slots=True, kw_only=True)
class LRScheduleSection:
    """Learning rate per step: linear warmup, then constant, cosine or linear decay."""

    warmup_steps: int = 0
    """Steps of linear warmup from lr / (warmup_steps + 1) up to lr."""
    decay: str = "constant"
    """After warmup: "constant", "cosine" (to min_lr_ratio * lr) or "linear" (likewise)."""
    decay_steps: int = 0
    """Length of the decay after warmup (0: until job.steps)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError(f"warmup_steps/decay_steps: expected >= 0, got {self.warmup_steps}, {self.decay_steps}")
        if self.decay not in LR_DECAYS:
            raise ValueError(f"decay: expected one of {LR_DECAYS}, got {self.decay!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected in [0, 1], got {self.min_lr_ratio}")


@dataclass(slots=True, kw_only=True)
class CheckpointSection:
    """Sharded DCP checkpoints, retention and Hugging Face exports for the generators."""

    dir: str | None = None
    """Where checkpoints go (None: none)."""
    every: int = 0
    """Checkpoint every K completed steps (0: only after the last step)."""
    resume: bool = False
    """Continue from the newest checkpoint in dir (a fresh start when there is none)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    export_every: int = 0
    """Export a Hugging Face directory every K completed steps (0: never), `export_dir/step-XXXXXXXX`."""
    export_dir: str | None = None
    """Where exports go (None: `<dir>/hf` when dir is set)."""
    keep_last_exports: int = 0
    """Keep only the newest N exports (0: keep all)."""
    export_dtype: str = "bfloat16"
    """dtype of the exported weights: "bfloat16", "float16" or "float32"."""

    def __post_init__(self) -> None:
        for name in ("every", "keep_last", "export_every", "keep_last_exports"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.resume and not self.dir:
            raise ValueError("resume: expected a checkpoint dir to resume from, got none; pass --checkpoint.dir")
        if self.export_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"export_dtype: expected 'bfloat16', 'float16' or 'float32', got {self.export_dtype!r}")
        if self.export_every and not (self.export_dir or self.dir):
            raise ValueError("export_every: expected checkpoint.export_dir or checkpoint.dir to export to, got neither")

    @property
    def exports(self) -> str | None:
        return self.export_dir or (str(Path(self.dir) / "hf") if self.dir else None)


@dataclass(slots=True, kw_only=True)
class MetricsSection:
    """Per-step metrics, written by rank 0 only."""

    jsonl: str | None = None
    """Append one JSON line per step here (its folder is created)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (`tensorboard --logdir DIR`)."""
    entropy: bool = True
    """Compute the policy entropy of every loss token for the metrics (one softmax per logits row)."""
    param_grad_bytes: bool = True
    """Measure peak_param_grad_bytes at FSDP2's unit boundaries (`trainer.param_memory`: about two
    samples per unit and microbatch, each reading every parameter's storages; false: reported as 0)."""


STALENESS_MODES = ("reject", "downweight")


@dataclass(slots=True, kw_only=True)
class StalenessSection:
    """Bound on how old the policy that sampled a batch may be (AReaL's max_staleness)."""

    max_staleness: int = -1
    """Largest accepted `trainer version - batch policy_version` (-1: unbounded). The trainer's
    version is the number of completed steps, which is also what an export carries."""
    mode: str = "reject"
    """For a batch beyond the bound: "reject" (skip the step: no update, a metrics line with
    skipped=1) or "downweight" (scale its gradient by decay ** (staleness - max_staleness))."""
    decay: float = 0.5
    """Per-version factor of "downweight"."""

    def __post_init__(self) -> None:
        if self.max_staleness < -1:
            raise ValueError(f"max_staleness: expected >= 0 or -1 (unbounded), got {self.max_staleness}")
        if self.mode not in STALENESS_MODES:
            raise ValueError(f"mode: expected one of {STALENESS_MODES}, got {self.mode!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay: expected in (0, 1], got {self.decay}")


@dataclass(slots=True, kw_only=True)
class TrainerConfig:
    """One training run of `trainer.train` (every rank parses the same one)."""

    planner: PlannerSection = field(default_factory=PlannerSection)
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    executor: ExecutorSection = field(default_factory=ExecutorSection)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_schedule: LRScheduleSection = field(default_factory=LRScheduleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    staleness: StalenessSection = field(default_factory=StalenessSection)

    def step_id(self, i: int) -> str:
        return self.job.step_id(i)


#: section name -> its dataclass, in TrainerConfig's field order.
SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(TrainerConfig)[f.name] for f in fields(TrainerConfig)}
