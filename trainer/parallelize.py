"""Data parallelism of the trainer in one step, `parallelize(model, mesh, cfg)` (DESIGN §5.7).

    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    model = parallelize(model, mesh, cfg.parallelism)       # FSDP2, or a replica per rank
    sync = GradSync(model, mesh, cfg.parallelism)
    sync.begin_step()                                       # FSDP2: no reduction while microbatches run
    res = run_slice(executor, slice_, sync)                 # enables the reduction before the last backward
    sync.finish_step(params)                                # replicate: the one bucketed SUM all-reduce

"fsdp" (default): FSDP2 `fully_shard` on every decoder block, then on the root, whose unit holds
what no block owns: the token embeddings, the final norm and the lm head (tied embeddings are one
Parameter, so one unit by construction). Gradient reduction is off while the rank's microbatches
run and switched on right before its last backward of the step, so each unit reduce-scatters once
per step (every microbatch and every sharing window accumulates locally first). The reduction is
a plain SUM (`set_gradient_divide_factor(1.0)` with SUM-only collectives): the plan's loss
normalisers are already global (DESIGN §5.6), so the step gradient is the sum of the ranks'
gradients, as in `trainer.distributed`. Parameters a rank did not touch contribute zeros
(`set_reduce_scatter_unused_params`), so every rank reduces the same tensors and none can hang.

Why the units stay gathered during a step (`reshard_after_forward=False`, no resharding after a
backward until the last one): FSDP2's collectives must line up across ranks, but ranks run
different numbers of microbatches (the planner balances cost, not counts) and, with sharding
windows, forwards and backwards in different orders. Gathering at every forward would pair one
rank's all-gather of a block with another rank's all-gather of a different block (a hang, or
worse). Gathered once per step, every rank issues exactly the same collectives: one all-gather
per unit at its first forward, one reduce-scatter per unit in its last backward, which then
reshards. Memory during a step is therefore the full parameters plus full-size gradient
accumulators (the price of reducing once per step); between steps a rank holds only its shards
of the weights, gradients and AdamW state.

Mixed precision: on CUDA (`param_dtype="auto"`) a `MixedPrecisionPolicy` gathers bfloat16
parameters for compute and reduce-scatters float32 gradients; master weights, gradients and
AdamW state stay float32 shards. On CPU/gloo everything is float32. Forward inputs are not cast
(`cast_forward_inputs=False`): a block's inputs are the bf16 hidden states plus the row layout,
whose float fields (old log-probs, occurrence counts) must keep their precision.

"replicate": the earlier path: every rank holds the whole model (rank 0's weights broadcast at
start) and `trainer.distributed.sync_gradients` SUM-all-reduces once after the last backward.

A rank whose slice has no microbatches still takes part in every collective of the step: it runs
one participation microbatch (`participation_slice`: one row, no log-prob entries, so its loss and
gradients are exactly zero) through the same executor.

Assumption about the model (trainer/models/qwen3_next.py): the decoder blocks are
`model.model.layers`; the lm head may run inside or, as today, right after the root forward
(`model.logits`): the root unit keeps its parameters gathered from its forward to its backward.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from proto.arrays import pack
from proto.harts.v1 import plan_pb2
from trainer.config import ParallelismConfig
from trainer.distributed import DistContext, broadcast_parameters, sync_gradients

log = logging.getLogger(__name__)

__all__ = ["parallelize", "param_dtype_of", "GradSync", "run_slice", "participation_slice", "grad_norm_and_clip",
           "scale_grads", "is_fsdp", "make_mesh"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def param_dtype_of(cfg: ParallelismConfig, device: torch.device) -> torch.dtype:
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


def parallelize(model: torch.nn.Module, mesh, cfg: ParallelismConfig, ctx: DistContext | None = None) -> torch.nn.Module:
    """Apply the data parallelism of `cfg` to `model` (in place) and return it.

    Args:
        model: a `Qwen3NextForRL` on its device, float32, the same weights on every rank.
        mesh: 1-D DeviceMesh over the data-parallel ranks (FSDP2), or None for "replicate".
        cfg: the parallelism section of the trainer config.
        ctx: this rank's DistContext ("replicate": rank 0's weights are broadcast).
    Side effects: "fsdp" replaces the parameters by DTensor shards (the model's class becomes
    FSDP's subclass); "replicate" overwrites them with rank 0's.
    """
    if cfg.data_parallel == "replicate":
        if ctx is not None:
            broadcast_parameters(model, ctx)
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mp = MixedPrecisionPolicy(param_dtype=param_dtype_of(cfg, device), reduce_dtype=_DTYPES[cfg.reduce_dtype],
                              cast_forward_inputs=False)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    # The root unit: embeddings, final norm, lm head. FSDP2 keeps a root's parameters gathered
    # between its forward and backward, so a lm head applied after the root forward also works.
    fully_shard(model, mesh=mesh, mp_policy=mp)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
            m.set_reduce_scatter_unused_params(True)
    return model


class GradSync:
    """When gradients are reduced in a step: FSDP2 before the last backward, replicate after it."""

    def __init__(self, model: torch.nn.Module, ctx: DistContext):
        self.model = model
        self.ctx = ctx
        self.fsdp = is_fsdp(model)
        self.enabled_at_last_backward = False

    def begin_step(self) -> None:
        """Before the step's first forward: accumulate locally, no communication."""
        self.enabled_at_last_backward = False
        if self.fsdp:
            self.model.set_requires_gradient_sync(False)
            self.model.set_reshard_after_backward(False)

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
    """The slice with one stand-in microbatch for a rank that has none: one row (token 0 at depth
    0, occurrence 0, a duplicated segment), one linear sequence from a zero state and no log-prob
    entries, so its loss is an exact zero that still runs every FSDP unit forward and backward."""
    out = plan_pb2.PlanSlice()
    out.CopyFrom(plan)
    del out.rank.microbatches[:]
    del out.rank.steps[:]
    one = lambda v: pack([v], "int32")  # noqa: E731
    mb = out.rank.microbatches.add(
        id=-1, num_rows=1, tokens=one(0), depth=one(0), occurrence=one(0), seg_start=one(0), seg_length=one(1),
        seg_parent=one(-1), seg_tree=one(0), seg_forest=one(0), seg_forest_offset=one(0),
        seg_duplicated=pack([1], "uint8"), conv_ancestors=pack([-1] * max(conv_kernel - 1, 0), "int32"),
        attn_offsets=pack([0, 0], "int32"), num_states=0,
    )
    seq = mb.linear_calls.add().sequences.add(row_start=0, row_end=1, start_depth=0)
    seq.init_state.kind = plan_pb2.StateSource.ZERO
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


def make_mesh(cfg: ParallelismConfig, ctx: DistContext):
    """1-D "dp" DeviceMesh over all ranks for FSDP2 (None for "replicate")."""
    if cfg.data_parallel == "replicate":
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
