"""Planner settings: `PlanConfig`, validated on construction, naming the field at fault (docs/design/planner.md, "Inputs")."""
from __future__ import annotations

from dataclasses import dataclass, field

from planner_service.planner.cost_model import CostModel
from plan.cluster_memory import DEFAULT_DEVICE_MEMORY_GB, check_expert_parallel, default_memory_tokens
from plan.memory_model import CHECKPOINTING, DTYPE_BYTES, HEADS, ModelDims, RowSizes

#: MemoryModel.model of plans made without a model config.
DEFAULT_MODEL_NAME = "default: Qwen3-Next-80B-A3B"


@dataclass(slots=True, kw_only=True)
class PlanConfig:
    """What a step is planned for. Validation errors name the field and the remedy."""

    world_size: int = 1
    """Number of data-parallel trainer ranks (>= 1)."""
    microbatch_tokens: int = 4096
    """Token budget B per microbatch: computed rows (kept + replay + duplicated) must fit."""
    memory_tokens: int = 0
    """Live-activation budget M per rank in row-equivalents of a running microbatch (M x the
    model's bytes per row, RowSizes.row_bytes, plan/memory_model.py). 0: with a model_config, what
    a device of device_memory_gb leaves after that model's FSDP2 shards, gathered units and a margin
    at this world_size (plan/cluster_memory.py; an error when that holds less than one
    microbatch); without one, 8 * microbatch_tokens (the default model's sizes, no device to
    budget for)."""
    chunk_size: int = 64
    """Linear-attention chunk size C; a power of two, equal to the kernel's."""
    conv_kernel: int = 0
    """Short-convolution kernel size K of the linear-attention layers; 0: the model config's (4
    without one)."""
    sharing: bool = True
    """False: the trajectory-expanded baseline (each trajectory its own tree)."""
    windows: bool = True
    """False: every cross-microbatch edge duplicates the prefix in the child."""
    replay: bool = True
    """False: ablation, hand over states at unaligned branch depths instead of replaying."""
    all_positions: bool = False
    """True: a log-prob entry for every position 1..L-1 (not only loss positions)."""
    model_config: dict | None = None
    """The trainer's model as a Qwen3-Next config.json dict: the memory model's per-row sizes.
    None: ModelDims.default() (Qwen3-Next-80B-A3B)."""
    model_name: str = ""
    """Name of that model for the plan's MemoryModel.model (default: derived)."""
    dtype: str = "float32"
    """Trainer dtype for the memory model ("float32", "bfloat16")."""
    activation_checkpointing: str = "none"
    """The trainer's parallelism.activation_checkpointing for the memory model: "none", "full"
    (every decoder block keeps its input and is recomputed in backward) or "selective" (the FFN
    sub-block only); plan/memory_model.py `checkpointed_bytes_per_row`."""
    head: str = "full"
    """The trainer's lm head for the memory model: "full" fp32 logits (the CPU path) or "chunked"
    (the GPU path, no [rows, V] logits)."""
    expert_parallel: int = 1
    """The trainer's parallelism.expert_parallel E: each MoE layer's routed experts split over E
    ranks (E divides world_size and the model's num_experts). E > 1 gathers fewer expert
    parameters per block (the default memory_tokens) and needs lockstep (the ranks of an
    expert-parallel group exchange tokens in every MoE layer)."""
    row_sizes: RowSizes | None = None
    """Explicit memory-model sizes, overriding model_config (tests, measured profiles)."""
    cost_model: CostModel = field(default_factory=CostModel)
    """Microbatch cost for placement and the report (default: computed rows)."""
    lockstep: bool = False
    """True: a lock-step plan (docs/design/lockstep.md, PlanParams.lockstep): one global sequence of phases in
    which every rank runs one step of the same kind (a real one or a stand-in), for trainers that
    gather parameters per forward and backward (FSDP2 with reshard_after_forward)."""
    cross_rank_windows: bool = True
    """Lock-step plans with windows and W > 1: the planner may place a window's importer on another
    rank than its exporter (docs/design/cross-rank.md, plan.proto CrossEdge), a tree split over several ranks
    then computes its shared prefix once instead of once per rank; it keeps such a plan only where
    it shortens the step or duplicates less at an equal one (`plan_step`). False (the ablation):
    windows stay on one rank. Free plans never cross ranks."""
    device_memory_gb: float = DEFAULT_DEVICE_MEMORY_GB
    """Memory of one trainer device in GiB (default 141: an H200), for the default memory_tokens."""
    makespan_slack: float = 1.02
    """Placement accepts a makespan up to this factor above its lower bound (max(total cost / W,
    the costliest trajectory)) and, among such placements, duplicates the least; 1.0 minimises
    the makespan whatever it duplicates."""
    sizes: RowSizes = field(init=False, repr=False)
    """The resolved memory-model sizes (from row_sizes, else model_config)."""
    memory_source: str = field(init=False, repr=False)
    """Where memory_tokens comes from (given, or how the default was derived)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {self.world_size}")
        c = self.chunk_size
        if c < 1 or c & (c - 1):
            raise ValueError(f"chunk_size: expected a power of two (e.g. 64), got {c}")
        if self.microbatch_tokens < c:
            raise ValueError(
                f"microbatch_tokens: expected >= chunk_size ({c}), got {self.microbatch_tokens}; raise the budget"
            )
        if not self.device_memory_gb > 0:
            raise ValueError(f"device_memory_gb: expected > 0, got {self.device_memory_gb}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"activation_checkpointing: expected one of {', '.join(CHECKPOINTING)}, "
                             f"got {self.activation_checkpointing!r}")
        if self.head not in HEADS:
            raise ValueError(f"head: expected one of {', '.join(HEADS)}, got {self.head!r}")
        dims = ModelDims.from_hf_config(self.model_config) if self.model_config is not None else ModelDims.default()
        check_expert_parallel(self.expert_parallel, self.world_size, dims.num_experts)
        if self.expert_parallel > 1 and not self.lockstep:
            raise ValueError(f"expert_parallel: expected 1 without lockstep (the ranks of an expert-parallel group "
                             f"exchange tokens in every MoE layer, so they run in lock-step), got {self.expert_parallel}; "
                             f"set lockstep")
        if self.memory_tokens:
            self.memory_source = "memory_tokens (given)"
        elif self.model_config is None or self.row_sizes is not None:
            self.memory_tokens = 8 * self.microbatch_tokens
            self.memory_source = "8 x microbatch_tokens (no model config: no device to budget for)"
        else:
            self.memory_tokens, self.memory_source = default_memory_tokens(
                self.model_config, self.world_size, self.microbatch_tokens, dtype=self.dtype,
                device_memory_gb=self.device_memory_gb, lockstep=self.lockstep, chunk_size=c,
                model_name=self.model_name, activation_checkpointing=self.activation_checkpointing,
                expert_parallel=self.expert_parallel, head=self.head)
        if self.memory_tokens < self.microbatch_tokens:
            raise ValueError(
                f"memory_tokens: expected >= microbatch_tokens ({self.microbatch_tokens}), got {self.memory_tokens}"
            )
        if not self.makespan_slack >= 1.0:
            raise ValueError(f"makespan_slack: expected >= 1.0, got {self.makespan_slack}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.cost_model, CostModel):
            raise ValueError(f"cost_model: expected a CostModel, got {type(self.cost_model).__name__}")
        if self.conv_kernel == 0:
            self.conv_kernel = dims.linear_conv_kernel_dim if self.model_config is not None else 4
        if self.conv_kernel < 1:
            raise ValueError(f"conv_kernel: expected >= 1, got {self.conv_kernel}")
        if self.model_config is not None and self.conv_kernel != dims.linear_conv_kernel_dim:
            raise ValueError(
                f"conv_kernel: expected {dims.linear_conv_kernel_dim} (the model config's linear_conv_kernel_dim), "
                f"got {self.conv_kernel}"
            )
        self.sizes = self.row_sizes if self.row_sizes is not None else RowSizes.of(
            dims, self.dtype, self.chunk_size, checkpointing=self.activation_checkpointing, head=self.head)
        if not self.model_name:
            self.model_name = ("explicit sizes" if self.row_sizes is not None
                               else "model config" if self.model_config is not None else DEFAULT_MODEL_NAME)

    @property
    def crossing(self) -> bool:
        """Whether this plan may carry windows across ranks (cross_rank_windows in a lock-step,
        windowed, shared plan of W > 1)."""
        return self.cross_rank_windows and self.lockstep and self.windows and self.sharing and self.world_size > 1

    @property
    def memory_bytes(self) -> int:
        """The live budget M in bytes."""
        return self.memory_tokens * self.sizes.row_bytes
