"""Per-rank memory of training a model with FSDP2 on W ranks, and the bytes a step's collectives move.

    report = memory_report(config, world_size=64, dtype="bfloat16", device_memory_gb=141)
    print("\\n".join(report.lines())); report.fits; report.to_dict()
    memory_tokens, source = default_memory_tokens(config, world_size=64, microbatch_tokens=2048)
    coll = collective_bytes(config, world_size=64, dtype="bfloat16", phases=PhaseCounts.of(plan.header))

`config` is a Qwen3-Next `config.json` dict (`plan.named_models`, or a trainer's `to_hf_dict()`).
What a rank holds at its peak, expert parallelism and the collectives' bytes, in GiB (2^30 bytes):
docs/design/planner.md ("The memory budget M") and docs/design/lockstep.md ("What they cost").
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from plan.memory_model import CHECKPOINTING, DTYPE_BYTES, FULL, LINEAR, ModelDims, RowSizes
from plan.phases import lockstep_phases, phase_counts

GIB = 1 << 30

#: a H200's memory in GiB: the planner's and `harts plan`'s default device
DEFAULT_DEVICE_MEMORY_GB = 141.0
#: share of the device left unplanned (docs/design/planner.md, "The memory budget M")
DEFAULT_MARGIN_FRACTION = 0.10
#: blocks gathered at once: the one computing and the one FSDP2 prefetches
PREFETCH_BLOCKS = 2
#: bytes per element of the sharded parameters, gradients and the reduce-scatter (fp32)
SHARD_BYTES = 4


@dataclass(slots=True, frozen=True)
class Unit:
    """One FSDP2 unit: its name and the shapes of its parameters."""

    name: str
    """"root" or "layers.<i>"."""
    shapes: tuple[tuple[int, ...], ...]
    """Every parameter's shape but the routed experts' (the trainer's and Hugging Face's layout)."""
    expert_shapes: tuple[tuple[int, ...], ...] = ()
    """The routed experts' stacked parameters ([num_experts, ...]): what expert parallelism splits."""

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes + self.expert_shapes)

    @property
    def expert_numel(self) -> int:
        return sum(math.prod(s) for s in self.expert_shapes)

    def gathered_numel(self, expert_parallel: int = 1) -> int:
        """Elements a rank gathers of this unit: every non-expert parameter and its E-th of the experts."""
        return self.numel - self.expert_numel + self.expert_numel // expert_parallel

    def shard_numel(self, world_size: int, expert_parallel: int = 1) -> int:
        """Elements of this unit one rank stores: ceil(d0 / W) rows of every non-expert parameter;
        of the experts, its expert-parallel rank's num_experts / E sharded over the W / E ranks that
        hold them, ceil(d0 / E / (W / E)) rows (FSDP2 pads dim 0 to a multiple of its group)."""
        group = world_size // expert_parallel
        return (sum(-(-s[0] // world_size) * math.prod(s[1:]) for s in self.shapes)
                + sum(-(-(s[0] // expert_parallel) // group) * math.prod(s[1:]) for s in self.expert_shapes))


def fsdp_units(config: dict) -> list[Unit]:
    """The FSDP2 units of a Qwen3-Next model: "root" first, then one per decoder block.

    Raises:
        ValueError: a malformed config (ModelDims.from_hf_config names the key).
    """
    d = ModelDims.from_hf_config(config)
    D, V = d.hidden_size, d.vocab_size
    bias = bool(config.get("attention_bias", False))
    tied = bool(config.get("tie_word_embeddings", False))
    Hk, Hv, Kd, Vd = d.linear_num_key_heads, d.linear_num_value_heads, d.linear_key_head_dim, d.linear_value_head_dim
    H, Hkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    root = [(V, D), (D,)] + ([] if tied else [(V, D)])
    units = [Unit("root", tuple(root))]
    for i, kind in enumerate(d.layer_types):
        shapes: list[tuple[int, ...]] = [(D,), (D,)]  # input and post-attention norms
        if kind == LINEAR:
            conv = 2 * Hk * Kd + Hv * Vd
            shapes += [(2 * Hk * Kd + 2 * Hv * Vd, D), (2 * Hv, D), (conv, 1, d.linear_conv_kernel_dim), (Hv,), (Hv,),
                       (Vd,), (D, Hv * Vd)]
        else:
            assert kind == FULL
            shapes += [(2 * H * hd, D), (Hkv * hd, D), (Hkv * hd, D), (D, H * hd), (hd,), (hd,)]
            if bias:
                shapes += [(2 * H * hd,), (Hkv * hd,), (Hkv * hd,), (D,)]
        experts: tuple[tuple[int, ...], ...] = ()
        if d.moe_layers[i]:
            E, Ie, Is = d.num_experts, d.moe_intermediate_size, d.shared_expert_intermediate_size
            shapes += [(E, D)]
            experts = ((E, 2 * Ie, D), (E, D, Ie))
            if Is:
                shapes += [(Is, D), (Is, D), (D, Is), (1, D)]
        else:
            shapes += [(d.intermediate_size, D), (d.intermediate_size, D), (D, d.intermediate_size)]
        units.append(Unit(f"layers.{i}", tuple(shapes), experts))
    return units


def _count(n: int) -> str:
    """A parameter count for reports: 79.67B, 0.33M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _check(world_size: int, dtype: str, device_memory_gb: float) -> None:
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if not device_memory_gb > 0:
        raise ValueError(f"device_memory_gb: expected > 0, got {device_memory_gb}")


def check_expert_parallel(expert_parallel: int, world_size: int, num_experts: int) -> None:
    """Raise ValueError unless E = `expert_parallel` splits the routed experts over whole ranks:
    E >= 1, and for E > 1 a model with routed experts, E dividing world_size and num_experts."""
    E = expert_parallel
    if isinstance(E, bool) or not isinstance(E, int) or E < 1:
        raise ValueError(f"expert_parallel: expected an integer >= 1, got {E!r}")
    if E > 1 and num_experts == 0:
        raise ValueError(f"expert_parallel: expected 1 for a model without routed experts, got {E}")
    if world_size % E or num_experts % E:
        raise ValueError(f"expert_parallel: expected a divisor of world_size ({world_size}) and of num_experts "
                         f"({num_experts}), got {E}")


def gathered_bytes(units: list[Unit], dtype: str, *, lockstep: bool, expert_parallel: int = 1) -> int:
    """Peak bytes of gathered parameters and unsharded gradients (docs/design/planner.md, "The
    memory budget M"); with expert parallelism a block gathers its non-expert parameters and
    num_experts / E experts."""
    e = DTYPE_BYTES[dtype]
    root, blocks = units[0].numel, [u.gathered_numel(expert_parallel) for u in units[1:]]
    if not lockstep:
        return 2 * e * (root + sum(blocks)) + SHARD_BYTES * max([root, *blocks])
    return 2 * e * root + (PREFETCH_BLOCKS * e + e + SHARD_BYTES) * max(blocks, default=0)


#: all-to-all transfers of a row's routed copies per MoE layer: a forward, a backward
FORWARD_TRANSFERS, BACKWARD_TRANSFERS = 2, 3


def all_to_all_row_bytes(dims: ModelDims, dtype: str, expert_parallel: int) -> int:
    """Bytes one rank sends per computed row in one all-to-all transfer through every MoE layer with
    expert parallelism E: the row's k routed copies of width D, (E-1)/E of them to another rank
    under balanced routing: MoE layers x k x D x e x (E-1)/E (integer division last). It receives
    as many. A forward makes FORWARD_TRANSFERS, a backward BACKWARD_TRANSFERS (`transfers_per_step`)."""
    moe = sum(dims.moe_layers)
    k, D, e = dims.num_experts_per_tok, dims.hidden_size, DTYPE_BYTES[dtype]
    return moe * k * D * e * (expert_parallel - 1) // expert_parallel


def transfers_per_step(activation_checkpointing: str) -> int:
    """All-to-all transfers of a microbatch's rows in a step: its forward and its backward, and the
    backward's re-forward of checkpointed blocks ("full" and "selective" both recompute the FFN). A
    microbatch whose window is recomputed (`Microbatch.recompute`) makes FORWARD_TRANSFERS more."""
    if activation_checkpointing not in CHECKPOINTING:
        raise ValueError(f"activation_checkpointing: expected one of {', '.join(CHECKPOINTING)}, got {activation_checkpointing!r}")
    return FORWARD_TRANSFERS + BACKWARD_TRANSFERS + FORWARD_TRANSFERS * int(activation_checkpointing != "none")


@dataclass(slots=True, kw_only=True, frozen=True)
class MemoryReport:
    """What one rank holds at its peak (docs/design/planner.md, "The memory budget M"); bytes
    unless named otherwise."""

    model: str
    """The model's name (a named config, a path, or "model config")."""
    world_size: int
    """Ranks W the parameters are sharded over."""
    dtype: str
    """Compute dtype: gathered parameters, unsharded gradients and activations."""
    lockstep: bool
    """True: units gathered per forward and backward (a lock-step plan); False: for the whole step."""
    activation_checkpointing: str
    """"none", "full" or "selective" (plan.memory_model.checkpointed_bytes_per_row)."""
    expert_parallel: int
    """Ranks E each MoE layer's routed experts are split over (1: none)."""
    head: str
    """The lm head the row sizes assume: "chunked" (the GPU path) or "full" fp32 logits."""
    parameters: int
    """All parameters of the model."""
    units: int
    """FSDP2 units: decoder blocks + the root."""
    root_parameters: int
    """Parameters of the root unit (embeddings, final norm, lm head)."""
    largest_block_parameters: int
    """Parameters a rank gathers of the largest decoder block (with expert parallelism: its
    non-expert parameters and num_experts / E experts)."""
    param_shard_bytes: int
    """fp32 parameter shards (the master weights)."""
    grad_shard_bytes: int
    """fp32 gradient shards."""
    optimizer_shard_bytes: int
    """AdamW exp_avg and exp_avg_sq shards, fp32."""
    gathered_bytes: int
    """Gathered units' parameters and unsharded gradients at the peak."""
    kept_row_bytes: int
    """Activations one computed row keeps from its forward to its backward (RowSizes.activation_row_bytes)."""
    recompute_row_bytes: int
    """What the running microbatch holds per row on top while its backward recomputes a checkpointed block."""
    activation_bytes: int
    """The live window stack: the budget M, or what the rest leaves (see `activation_source`)."""
    activation_source: str
    """Where `activation_bytes` comes from."""
    microbatch_tokens: int
    """Rows B of one microbatch (0: not checked): M must hold at least one microbatch."""
    margin_bytes: int
    """Device memory left unplanned."""
    device_memory_bytes: int
    """The device's memory."""
    all_to_all_row_bytes: int
    """Expert parallelism: bytes a rank sends per computed row per pass through the MoE layers
    (`all_to_all_row_bytes`; it receives as many); 0 without."""
    all_to_all_transfers: int
    """All-to-all transfers of a row per step (`transfers_per_step`, windows not recomputed)."""

    @property
    def bytes_per_row(self) -> int:
        """Activations per computed row of a running microbatch: kept + recompute (RowSizes.row_bytes)."""
        return self.kept_row_bytes + self.recompute_row_bytes

    @property
    def shard_bytes(self) -> int:
        """Parameter, gradient and AdamW shards: what stays between steps."""
        return self.param_shard_bytes + self.grad_shard_bytes + self.optimizer_shard_bytes

    @property
    def static_bytes(self) -> int:
        """Shards plus gathered units: everything but the activations."""
        return self.shard_bytes + self.gathered_bytes

    @property
    def peak_bytes(self) -> int:
        """Static bytes plus the activations."""
        return self.static_bytes + self.activation_bytes

    @property
    def activation_tokens(self) -> int:
        """Rows of a running microbatch the activation bytes hold."""
        return self.activation_bytes // self.bytes_per_row

    @property
    def microbatch_bytes(self) -> int:
        """What one microbatch of B rows needs on this device: static + B x bytes_per_row + margin."""
        return self.static_bytes + self.microbatch_tokens * self.bytes_per_row + self.margin_bytes

    @property
    def fits(self) -> bool:
        """Peak plus margin within the device, and room for one microbatch's activations."""
        return (self.peak_bytes + self.margin_bytes <= self.device_memory_bytes
                and self.activation_tokens >= self.microbatch_tokens)

    def to_dict(self) -> dict:
        """Every field and the derived figures, as a JSON-ready dict: `activation_rows_per_rank`,
        `bytes_per_row`, `peak_bytes_per_rank` (static + activations, margin excluded), `fits`,
        `shortfall_bytes` (what one microbatch of B rows needs beyond the device, 0 when it
        fits) and `all_to_all_bytes_per_microbatch` (B rows, every pass)."""
        return {**asdict(self), "shard_bytes": self.shard_bytes, "static_bytes": self.static_bytes,
                "peak_bytes": self.peak_bytes, "activation_tokens": self.activation_tokens,
                "activation_rows_per_rank": self.activation_tokens, "bytes_per_row": self.bytes_per_row,
                "peak_bytes_per_rank": self.peak_bytes, "fits": self.fits,
                "shortfall_bytes": max(0, self.microbatch_bytes - self.device_memory_bytes),
                "all_to_all_bytes_per_microbatch": self.all_to_all_row_bytes * self.all_to_all_transfers * self.microbatch_tokens}

    def lines(self) -> list[str]:
        """The report as an aligned text table (GiB)."""
        g = lambda n: f"{n / GIB:9.2f} GiB"  # noqa: E731
        sched = ("lock-step: units gathered per forward and backward" if self.lockstep
                 else "free schedule: every unit gathered for the whole step")
        e = DTYPE_BYTES[self.dtype]
        ep = f", expert parallel E = {self.expert_parallel}" if self.expert_parallel > 1 else ""
        head = (f"{self.model}: {_count(self.parameters)} parameters in {self.units} FSDP2 units, W = {self.world_size}{ep}, "
                f"{self.dtype} compute, {sched}; activation checkpointing {self.activation_checkpointing}, "
                f"{self.head} lm head")
        rows = [
            ("parameter shards (fp32, the master weights)", self.param_shard_bytes),
            ("gradient shards (fp32)", self.grad_shard_bytes),
            ("AdamW state shards (2 x fp32)", self.optimizer_shard_bytes),
            (f"gathered units (root {_count(self.root_parameters)}, largest block "
             f"{_count(self.largest_block_parameters)}, {e}-byte)", self.gathered_bytes),
            (f"activations: {self.activation_tokens:,} rows x {self.bytes_per_row / 1e6:.2f} MB ({self.activation_source})",
             self.activation_bytes),
            (f"margin ({self.margin_bytes / self.device_memory_bytes:.0%} of the device)", self.margin_bytes),
        ]
        width = max(len(name) for name, _ in rows) + 2
        out = [head] + [f"  {name:<{width}}{g(n)}" for name, n in rows]
        if self.recompute_row_bytes:
            out.insert(6, f"    a row: {self.kept_row_bytes / 1e6:.2f} MB kept from forward to backward + "
                          f"{self.recompute_row_bytes / 1e6:.2f} MB while the backward recomputes its largest "
                          f"checkpointed block")
        total = self.peak_bytes + self.margin_bytes
        verdict = "fits" if self.fits else "does NOT fit"
        if self.microbatch_tokens and self.activation_tokens < self.microbatch_tokens:
            verdict += (f" (activations hold {self.activation_tokens:,} rows, a microbatch of B = {self.microbatch_tokens:,} "
                        f"needs {(self.microbatch_bytes - self.device_memory_bytes) / GIB:.2f} GiB more)")
        elif total > self.device_memory_bytes:
            verdict += f" ({(total - self.device_memory_bytes) / GIB:.2f} GiB over)"
        out.append(f"  {'peak per rank, margin included':<{width}}{g(total)}  of {self.device_memory_bytes / GIB:.0f} GiB: {verdict}")
        if self.all_to_all_row_bytes:
            out.append(f"  all-to-all per rank: {self.all_to_all_row_bytes / 1e6:.2f} MB sent per row per transfer x "
                       f"{self.all_to_all_transfers} transfers per step"
                       + (f" = {self.all_to_all_row_bytes * self.all_to_all_transfers * self.microbatch_tokens / GIB:.2f} GiB "
                          f"per microbatch of B = {self.microbatch_tokens:,}" if self.microbatch_tokens else "")
                       + " (received as much)")
        return out


def memory_report(config: dict, world_size: int, *, dtype: str = "bfloat16",
                  device_memory_gb: float = DEFAULT_DEVICE_MEMORY_GB, lockstep: bool = True, memory_tokens: int = 0,
                  microbatch_tokens: int = 0, chunk_size: int = 64, margin_fraction: float = DEFAULT_MARGIN_FRACTION,
                  model_name: str = "", activation_checkpointing: str = "none", expert_parallel: int = 1,
                  head: str = "chunked") -> MemoryReport:
    """Per-rank peak memory of training `config` on `world_size` ranks (docs/design/planner.md).

    Args:
        config: a Qwen3-Next config.json dict.
        world_size: ranks W.
        dtype: compute dtype ("bfloat16" on CUDA, "float32" on the CPU).
        device_memory_gb: the device's memory in GiB.
        lockstep: units gathered per forward and backward (True) or for the whole step.
        memory_tokens: the planner's live budget M in rows of a running microbatch; 0: whatever
            the device leaves after the shards, the gathered units and the margin.
        microbatch_tokens: rows B of one microbatch; the report fits only when M holds one.
        chunk_size: linear-attention chunk size C (the per-row activation bytes depend on it).
        margin_fraction: share of the device left unplanned.
        model_name: the name the report gives the model (default: "model config").
        activation_checkpointing: "none", "full" or "selective" (plan.memory_model.CHECKPOINTING).
        expert_parallel: ranks E each MoE layer's routed experts are split over.
        head: the lm head, "chunked" (default: a GPU cluster's trainer) or "full" (the CPU path).

    Raises:
        ValueError: a malformed config or an out-of-range argument, naming it.
    """
    _check(world_size, dtype, device_memory_gb)
    if not 0 <= margin_fraction < 1:
        raise ValueError(f"margin_fraction: expected in [0, 1), got {margin_fraction}")
    if memory_tokens < 0 or microbatch_tokens < 0:
        raise ValueError(f"memory_tokens, microbatch_tokens: expected >= 0, got {memory_tokens}, {microbatch_tokens}")
    dims = ModelDims.from_hf_config(config)
    check_expert_parallel(expert_parallel, world_size, dims.num_experts)
    units = fsdp_units(config)
    shard = sum(u.shard_numel(world_size, expert_parallel) for u in units)
    sizes = RowSizes.of(dims, dtype, chunk_size, checkpointing=activation_checkpointing, head=head)
    row = sizes.row_bytes
    device = int(device_memory_gb * GIB)
    margin = int(margin_fraction * device)
    gathered = gathered_bytes(units, dtype, lockstep=lockstep, expert_parallel=expert_parallel)
    static = 4 * SHARD_BYTES * shard + gathered
    if memory_tokens:
        activations, source = memory_tokens * row, "the budget M"
    else:
        activations, source = max(0, (device - margin - static) // row * row), "what the device leaves"
    return MemoryReport(
        model=model_name or "model config", world_size=world_size, dtype=dtype, lockstep=lockstep,
        activation_checkpointing=activation_checkpointing, expert_parallel=expert_parallel, head=head,
        parameters=sum(u.numel for u in units), units=len(units), root_parameters=units[0].numel,
        largest_block_parameters=max((u.gathered_numel(expert_parallel) for u in units[1:]), default=0),
        param_shard_bytes=SHARD_BYTES * shard, grad_shard_bytes=SHARD_BYTES * shard,
        optimizer_shard_bytes=2 * SHARD_BYTES * shard, gathered_bytes=gathered, kept_row_bytes=sizes.activation_row_bytes,
        recompute_row_bytes=sizes.recompute_row_bytes, activation_bytes=activations, activation_source=source,
        microbatch_tokens=microbatch_tokens, margin_bytes=margin, device_memory_bytes=device,
        all_to_all_row_bytes=all_to_all_row_bytes(dims, dtype, expert_parallel),
        all_to_all_transfers=transfers_per_step(activation_checkpointing),
    )


def default_memory_tokens(config: dict, world_size: int, microbatch_tokens: int, **kw) -> tuple[int, str]:
    """The planner's default live budget M in rows: what the device leaves after the shards, the
    gathered units and the margin (`memory_report` with memory_tokens = 0; keywords pass through,
    activation_checkpointing, expert_parallel and head included), and a sentence saying so.

    Raises:
        ValueError: the rest holds less than one microbatch of `microbatch_tokens` rows; the
            message gives the figures and the remedies.
    """
    rep = memory_report(config, world_size, microbatch_tokens=microbatch_tokens, **kw)
    tokens = rep.activation_tokens
    setting = "" if rep.activation_checkpointing == "none" else f", activation checkpointing {rep.activation_checkpointing}"
    setting += f", expert parallel E = {rep.expert_parallel}" if rep.expert_parallel > 1 else ""
    source = (f"{rep.model} at W = {world_size} on {rep.device_memory_bytes / GIB:g} GiB ({rep.dtype}{setting}): device - shards "
              f"{rep.shard_bytes / GIB:.1f} - gathered units {rep.gathered_bytes / GIB:.1f} - margin "
              f"{rep.margin_bytes / GIB:.1f} GiB = {rep.activation_bytes / GIB:.1f} GiB = {tokens:,} rows of "
              f"{rep.bytes_per_row / 1e6:.2f} MB")
    if tokens < microbatch_tokens:
        remedy = "" if rep.activation_checkpointing == "full" else ", turn on activation_checkpointing"
        raise ValueError(
            f"memory_tokens: expected the memory model to leave room for one microbatch of {microbatch_tokens} rows, got "
            f"{tokens} ({source}); lower microbatch_tokens, raise world_size or device_memory_gb{remedy}, or set memory_tokens")
    return tokens, source


@dataclass(slots=True, frozen=True)
class PhaseCounts:
    """Phases of a lock-step plan by kind (PlanHeader.lockstep_phases)."""

    forward: int
    backward: int
    recompute: int

    @classmethod
    def of(cls, header) -> "PhaseCounts | None":
        """The counts of a `plan_pb2.PlanHeader`; None for a free plan (no phases).

        Raises:
            PlanValidationError: phase kinds that are not PhaseKind values (`plan.phases`).
        """
        if not header.lockstep_phases:
            return None
        forward, backward, recompute = phase_counts(lockstep_phases(header))
        return cls(forward=forward, backward=backward, recompute=recompute)


@dataclass(slots=True, kw_only=True, frozen=True)
class CollectiveBytes:
    """Bytes one rank moves through FSDP2's collectives in a step (docs/design/lockstep.md, "What they cost")."""

    all_gather_bytes: int
    """Received by all-gathers of parameters (compute dtype)."""
    reduce_scatter_bytes: int
    """Sent by reduce-scatters of fp32 gradients."""
    formula: str
    """The formula with this plan's numbers."""
    phases: PhaseCounts | None = field(default=None)
    """The lock-step phase counts (None: a free schedule)."""
    all_to_all_bytes: int = 0
    """Expert parallelism: sent by the MoE layers' token all-to-alls by the busiest rank (received as
    much; `all_to_all_row_bytes` x the transfers of its computed rows); 0 without."""
    all_to_all_formula: str = ""
    """That formula with this plan's numbers (empty without expert parallelism)."""

    def to_dict(self) -> dict:
        return asdict(self)


def collective_bytes(config: dict, world_size: int, *, dtype: str = "bfloat16", phases: PhaseCounts | None = None,
                     expert_parallel: int = 1, activation_checkpointing: str = "none",
                     rank_rows: list[tuple[int, int]] = ()) -> CollectiveBytes:
    """All-gather and reduce-scatter bytes per rank and step of a lock-step plan with `phases`, or of
    a free schedule (every unit once) when `phases` is None (docs/design/lockstep.md, "What they
    cost"); with expert parallelism E the routed experts move over their W / E ranks and the tokens
    by all-to-all.

    Args:
        rank_rows: per rank, (computed rows, rows of recomputed microbatches) of the step: the
            all-to-all bytes (the busiest rank's); empty: none counted.
    """
    _check(world_size, dtype, 1.0)
    dims = ModelDims.from_hf_config(config)
    check_expert_parallel(expert_parallel, world_size, dims.num_experts)
    units = fsdp_units(config)
    E, group = expert_parallel, world_size // expert_parallel
    root = units[0].numel
    experts = sum(u.expert_numel for u in units[1:])
    blocks = sum(u.numel for u in units[1:])
    e = DTYPE_BYTES[dtype]
    # parameters a rank receives (all-gather) or sends (reduce-scatter) per pass over the blocks: ring
    # collectives over W ranks for the non-expert ones, over the W / E holders of its experts for those
    moved = Fraction(world_size - 1, world_size) * (blocks - experts) + Fraction(group - 1, group) * (experts // E)
    ring_root = Fraction(world_size - 1, world_size) * root
    where = (f"P_blocks = {blocks:,}, P_root = {root:,}, W = {world_size}" if E == 1 else
             f"P_blocks = {blocks - experts:,} + experts {experts:,} / E over W / E = {group} ranks, P_root = {root:,}, "
             f"W = {world_size}, E = {E}")
    if phases is None:
        ag, rs = e * (moved + ring_root), SHARD_BYTES * (moved + ring_root)
        formula = f"free schedule: (W-1)/W x ({e} + 4) bytes x every unit once; {where}"
    else:
        F, B, R = phases.forward, phases.backward, phases.recompute
        ag = e * ((F + B + 2 * R) * moved + (F + R) * ring_root)
        rs = SHARD_BYTES * (B + R) * (moved + ring_root)
        formula = (f"all-gather (W-1)/W x {e} x ((F + B + 2R) P_blocks + (F + R) P_root), reduce-scatter (W-1)/W x 4 x "
                   f"(B + R) (P_blocks + P_root); F = {F}, B = {B}, R = {R}, {where}")
    a2a, a2a_formula = 0, ""
    per_row = all_to_all_row_bytes(dims, dtype, E)
    if per_row and rank_rows:
        c = transfers_per_step(activation_checkpointing)
        a2a = max(per_row * (c * rows + FORWARD_TRANSFERS * recomputed) for rows, recomputed in rank_rows)
        a2a_formula = (f"{sum(dims.moe_layers)} MoE layers x k {dims.num_experts_per_tok} x D {dims.hidden_size} x {e} "
                       f"x (E-1)/E = {per_row:,} bytes per row and transfer, x ({c} x computed rows + "
                       f"{FORWARD_TRANSFERS} x recomputed rows) of the busiest rank (activation checkpointing "
                       f"{activation_checkpointing})")
    return CollectiveBytes(all_gather_bytes=int(ag), reduce_scatter_bytes=int(rs), formula=formula, phases=phases,
                           all_to_all_bytes=a2a, all_to_all_formula=a2a_formula)
