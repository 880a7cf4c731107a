"""Process group and the replicated data-parallel path: parameter broadcast, one SUM gradient sync per step.

    ctx = init_distributed()                      # torchrun env or a single process (world size 1)
    broadcast_parameters(model, ctx)              # every replica starts from rank 0's weights
    ...executor.run_step(slice_)...               # local microbatches, no communication
    sync_gradients(params, ctx)                   # flattened buckets, SUM all-reduce
    shutdown(ctx)

FSDP2 (the default) is `trainer.parallelize`. Why SUM and not DDP's mean, and why an untouched
parameter keeps `grad = None`: docs/design/execution.md ("Data parallelism").
Legend: N flattened gradient elements of one bucket, P parameters.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

__all__ = ["DistContext", "init_distributed", "shutdown", "broadcast_parameters", "sync_gradients",
           "sync_gradients_ref", "all_reduce_values", "barrier", "buckets"]

DEFAULT_BUCKET_BYTES = 25 << 20


@dataclass(slots=True, kw_only=True)
class DistContext:
    """Where this process sits in the data-parallel group."""

    rank: int = 0
    """Global rank."""
    world_size: int = 1
    """Number of ranks (1 without torchrun)."""
    local_rank: int = 0
    """Rank on this host (selects the GPU)."""
    device: torch.device = torch.device("cpu")
    """Device of the model replica."""
    initialized: bool = False
    """True when a process group was created (torchrun or an explicit init)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: expected 0 <= rank < world_size={self.world_size}, got {self.rank}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(*, timeout_s: float = 1800.0, single_process_group: bool = False) -> DistContext:
    """Join the torchrun process group (gloo on CPU, NCCL on CUDA); world size 1 without torchrun.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/MASTER_PORT as set by torchrun.
    `single_process_group`: without torchrun, create a one-rank group in memory anyway (FSDP2 and
    sharded checkpoints need one), else run without a process group.
    Side effects: creates the default process group, selects the CUDA device of LOCAL_RANK.
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        if not single_process_group:
            return DistContext(rank=0, world_size=1, local_rank=0, device=device, initialized=False)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None)
        return DistContext(rank=0, world_size=1, local_rank=0, device=device, initialized=True)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                device_id=device if cuda else None)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, device=device,
                       initialized=True)


def shutdown(ctx: DistContext) -> None:
    if ctx.initialized and dist.is_initialized():
        dist.destroy_process_group()


def buckets(tensors: list[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of `tensors` grouped in order into buckets of at most `bucket_bytes` (one tensor
    larger than that is a bucket of its own); tensors of different dtypes never share one."""
    out: list[list[int]] = []
    size, dtype = 0, None
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > bucket_bytes or t.dtype != dtype:
            out.append([])
            size, dtype = 0, t.dtype
        out[-1].append(i)
        size += nbytes
    return out


@torch.no_grad()
def broadcast_parameters(model: torch.nn.Module, ctx: DistContext, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Overwrite every replica's parameters and buffers with rank 0's (flattened buckets)."""
    if ctx.world_size == 1:
        return
    tensors = [t for t in (*model.parameters(), *model.buffers())]
    for idx in buckets(tensors, bucket_bytes):
        flat_N = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        dist.broadcast(flat_N, src=0)
        _scatter_back(flat_N, [tensors[i] for i in idx])


@torch.no_grad()
def sync_gradients(params: list[torch.Tensor], ctx: DistContext, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """SUM-all-reduce the gradients of `params` in flattened buckets, once per step.

    Every rank must pass the same parameters in the same order. A missing gradient counts as
    zero; a parameter whose gradient is missing on every rank keeps `grad = None`.
    Side effects: replaces each `.grad` with the reduced one.
    """
    if ctx.world_size == 1:
        return
    had_P = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=ctx.device)
    work = [dist.all_reduce(had_P, op=dist.ReduceOp.SUM, async_op=True)]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flats = []
    for idx in buckets(grads, bucket_bytes):
        flat_N = torch.cat([grads[i].reshape(-1) for i in idx])
        work.append(dist.all_reduce(flat_N, op=dist.ReduceOp.SUM, async_op=True))
        flats.append((flat_N, idx))
    for w in work:
        w.wait()
    for flat_N, idx in flats:
        _scatter_back(flat_N, [grads[i] for i in idx])
    for p, g, had in zip(params, grads, had_P.tolist()):
        p.grad = g if had > 0 else None


@torch.no_grad()
def sync_gradients_ref(params: list[torch.Tensor], ctx: DistContext) -> None:
    """Plain reference of `sync_gradients`: one blocking all-reduce per parameter."""
    if ctx.world_size == 1:
        return
    for p in params:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        had = torch.tensor([float(p.grad is not None)], device=ctx.device)
        dist.all_reduce(had)
        dist.all_reduce(g)
        p.grad = g if had.item() > 0 else None


def all_reduce_values(values: list[float], ctx: DistContext, op: str = "sum") -> list[float]:
    """Reduce a few float64 scalars across ranks ("sum", "max" or "min"); identity on one rank."""
    if ctx.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return t.tolist()


def barrier(ctx: DistContext) -> None:
    if ctx.world_size > 1:
        dist.barrier()


def _scatter_back(flat_N: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat_N[offset: offset + n].view_as(t))
        offset += n
