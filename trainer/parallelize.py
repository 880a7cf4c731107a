"""Data parallelism of the trainer in one step, `parallelize(model, mesh, cfg)`: FSDP2, or full replicas.

    mesh = make_mesh(cfg.parallelism, ctx)                  # "dp" DeviceMesh (("dp", "ep") with experts; None for replicate)
    reshard = resolve_reshard(cfg.parallelism, full_param_grad_bytes(model), ctx.device)
    model = parallelize(model, mesh, cfg.parallelism, ctx, reshard=reshard)  # FSDP2, or replicas
    sync = GradSync(model, ctx, every_backward=reshard)
    res = run_slice(executor, slice_, sync)                 # FSDP2 reduces while the slice runs
    sync.finish_step(params)                                # replicate: the one bucketed SUM all-reduce

Units, SUM reductions, explicit prefetching, the two schedules (`reshard`), mixed precision and
participation stand-ins: docs/design/execution.md ("Data parallelism").
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from proto.harts.v1 import plan_pb2
from trainer.config import ParallelismSection
from trainer.distributed import DistContext, broadcast_parameters, sync_gradients
from trainer.lockstep import standin_microbatch

log = logging.getLogger(__name__)

__all__ = ["parallelize", "param_dtype_of", "GradSync", "run_slice", "participation_slice", "grad_norm_and_clip",
           "scale_grads", "is_fsdp", "make_mesh", "resolve_reshard", "full_param_grad_bytes"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def param_dtype_of(cfg: ParallelismSection, device: torch.device) -> torch.dtype:
    """The compute dtype of the parameters: bfloat16 on CUDA for "auto", float32 on the CPU."""
    if cfg.param_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.param_dtype == "bfloat16" and device.type != "cuda":
        raise ValueError("parallelism.param_dtype: expected 'float32' or 'auto' on the CPU (gloo), got 'bfloat16'; "
                         "bf16 compute needs CUDA")
    return _DTYPES[cfg.param_dtype]


def is_fsdp(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_param_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the full parameters plus full gradients (float32 master weights and gradients)."""
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters())


def resolve_reshard(cfg: ParallelismSection, full_bytes: int, device: torch.device) -> bool:
    """`parallelism.reshard_after_forward` as a bool: none means full parameters plus gradients
    (`full_bytes`) above `reshard_memory_fraction` of the device memory (`device_memory_gb`, or the
    CUDA device's own; on the CPU without device_memory_gb: false)."""
    if cfg.data_parallel != "fsdp":
        return False
    if cfg.reshard_after_forward is not None:
        return cfg.reshard_after_forward
    if cfg.expert_parallel > 1:  # expert-parallel groups need lock-step plans anyway
        return True
    memory = cfg.device_memory_gb * (1 << 30)
    if not memory and device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    return bool(memory) and full_bytes > cfg.reshard_memory_fraction * memory


def parallelize(model: torch.nn.Module, mesh, cfg: ParallelismSection, ctx: DistContext | None = None, *,
                reshard: bool = False) -> torch.nn.Module:
    """Apply the data parallelism of `cfg` to `model` (in place) and return it.

    Args:
        model: a `Qwen3NextForRL`, float32, the same weights on every rank ("replicate"), or on the
            meta device ("fsdp": `trainer.models.materialize` fills the shards afterwards).
        mesh: 1-D DeviceMesh over the data-parallel ranks (FSDP2), the 2-D ("dp", "ep") mesh of
            expert parallelism (`make_mesh`), or None for "replicate".
        cfg: the parallelism section of the trainer config.
        ctx: this rank's DistContext ("replicate": rank 0's weights are broadcast).
        reshard: FSDP2 parameters sharded through the step (`resolve_reshard`; docs/design/execution.md,
            "Data parallelism").
    Side effects: "fsdp" replaces the parameters by DTensor shards (the model's class becomes
    FSDP's subclass); "replicate" overwrites them with rank 0's.
    """
    if cfg.data_parallel == "replicate":
        if ctx is not None:
            broadcast_parameters(model, ctx)
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    device = ctx.device if ctx is not None else next(model.parameters()).device
    mp = MixedPrecisionPolicy(param_dtype=param_dtype_of(cfg, device), reduce_dtype=_DTYPES[cfg.reduce_dtype],
                              cast_forward_inputs=False)
    blocks = list(model.model.layers)
    if mesh.ndim == 2:  # expert parallelism: experts over "ep", FSDP2 of them over "dp", the rest over all
        from trainer.expert_parallel import shard_experts

        if not reshard:
            raise ValueError("parallelism.expert_parallel > 1: expected reshard_after_forward (lock-step plans: every "
                             "rank of an expert-parallel group must run the same step kinds at the same time), got false")
        shard_experts(model, mesh["ep"])
        for block in blocks:
            if getattr(block, "is_moe", False):
                fully_shard(block.mlp.experts, mesh=mesh["dp"], mp_policy=mp, reshard_after_forward=reshard)
        mesh = mesh._flatten("dp_ep")
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    # The root unit: embeddings, final norm, lm head. Left to FSDP2's root default: gathered from its
    # forward until its backward ends (the head is the first thing a backward needs).
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1: i + 2])
        block.set_modules_to_backward_prefetch(blocks[i - 1: i] if i else [])
    if blocks:
        model.set_modules_to_forward_prefetch(blocks[:1])
        model.set_modules_to_backward_prefetch(blocks[-1:])
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
            m.set_reduce_scatter_unused_params(True)
    return model


class GradSync:
    """When gradients are reduced in a step: FSDP2 after every backward (reshard) or in the last
    one (units gathered for the step), replicate after the last backward."""

    def __init__(self, model: torch.nn.Module, ctx: DistContext, *, every_backward: bool = False):
        """`every_backward`: FSDP2 reduce-scatters in every backward (parallelize(reshard=True))."""
        self.model = model
        self.ctx = ctx
        self.fsdp = is_fsdp(model)
        self.per_backward = self.fsdp and every_backward
        self.enabled_at_last_backward = False

    def begin_step(self) -> None:
        """Before the step's first forward: reshard reduces in every backward; otherwise accumulate
        locally, no communication until the last backward."""
        self.enabled_at_last_backward = False
        if self.fsdp:
            self.model.set_requires_gradient_sync(self.per_backward)
            self.model.set_reshard_after_backward(self.per_backward)

    def before_last_backward(self) -> None:
        """Right before this rank's last backward of the step: reduce as that backward runs."""
        self.enabled_at_last_backward = True
        if self.fsdp:
            self.model.set_requires_gradient_sync(True)
            self.model.set_reshard_after_backward(True)  # the optimizer steps the shards; re-gather next step

    def finish_step(self, params: list[torch.Tensor]) -> None:
        """After the last backward: "replicate" all-reduces here; FSDP2 has reduced already."""
        if self.fsdp:
            assert self.enabled_at_last_backward, "FSDP2 gradient sync was never enabled in this step"
        else:
            sync_gradients(params, self.ctx)


def run_slice(executor, plan: plan_pb2.PlanSlice, sync: GradSync):
    """`executor.run_step(plan)` with `sync.before_last_backward` called right before the last backward."""
    sync.begin_step()
    return executor.run_step(plan, before_last_backward=sync.before_last_backward)


def participation_slice(plan: plan_pb2.PlanSlice, *, conv_kernel: int) -> plan_pb2.PlanSlice:
    """The slice with one stand-in microbatch for a rank of a free plan that has none
    (`trainer.lockstep.standin_microbatch`: one row, no log-prob entries, so its loss is an exact
    zero that still runs every FSDP unit forward and backward)."""
    out = plan_pb2.PlanSlice()
    out.CopyFrom(plan)
    del out.rank.microbatches[:]
    del out.rank.steps[:]
    out.rank.microbatches.append(standin_microbatch(conv_kernel=conv_kernel))
    out.rank.steps.add(kind=plan_pb2.ExecStep.FORWARD, microbatch=0)
    out.rank.steps.add(kind=plan_pb2.ExecStep.BACKWARD, microbatch=0)
    return out


def _local(g: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return g.to_local() if isinstance(g, DTensor) else g


@torch.no_grad()
def grad_norm_and_clip(params: list[torch.Tensor], max_norm: float, ctx: DistContext, *, sharded: bool) -> float:
    """Global L2 norm of the step gradient (float64 accumulation); clips in place when max_norm > 0.

    `sharded`: the gradients are FSDP2 shards (each element on exactly one rank), so the squares
    are summed over ranks; replicated gradients are complete on every rank.
    """
    grads = [p.grad for p in params if p.grad is not None]
    local = [_local(g) for g in grads]
    sq = torch.zeros((), dtype=torch.float64, device=ctx.device)
    for g in local:
        if g.numel():
            sq += g.double().pow(2).sum()
    if sharded and ctx.world_size > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for g in local:
            g.mul_(coef)
    return norm


@torch.no_grad()
def scale_grads(params: list[torch.Tensor], factor: float) -> None:
    """Multiply every gradient (shard) by `factor` in place."""
    if factor == 1.0:
        return
    for p in params:
        if p.grad is not None:
            _local(p.grad).mul_(factor)


def make_mesh(cfg: ParallelismSection, ctx: DistContext):
    """The DeviceMesh of FSDP2: 1-D "dp" over all ranks, or with `expert_parallel` E > 1 a 2-D
    ("dp", "ep") mesh of W / E x E ranks (`trainer.expert_parallel`); None for "replicate".

    Raises:
        ValueError: E does not divide the world size, or expert parallelism without FSDP2.
    """
    E = cfg.expert_parallel
    if cfg.data_parallel == "replicate":
        if E > 1:
            raise ValueError(f"parallelism.expert_parallel: expected 1 with data_parallel='replicate', got {E}; "
                             "use data_parallel='fsdp'")
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if E == 1:
        return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
    if ctx.world_size % E:
        raise ValueError(f"parallelism.expert_parallel: expected a divisor of the world size ({ctx.world_size}), got {E}")
    return init_device_mesh(ctx.device.type, (ctx.world_size // E, E), mesh_dim_names=("dp", "ep"))
