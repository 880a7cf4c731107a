"""Expert parallelism: each MoE layer's routed experts split over a group of ranks, tokens moved by all-to-all.

    mesh = make_mesh(cfg.parallelism, ctx)           # 2-D ("dp", "ep") when parallelism.expert_parallel = E > 1
    shard_experts(model, mesh["ep"])                 # on the meta model, before fully_shard (trainer.parallelize)

Rank (i, j) of the (W / E) x E mesh holds experts [j E_l, (j + 1) E_l) of every MoE layer; the
exchange and its self-contained backward (`ExpertParallel.apply`): docs/design/execution.md
("Expert parallelism").
Legend: R rows, D hidden, E experts, E_l local experts, P ranks of a group, S sorted rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.models.moe import Dispatch, expert_swiglu, gather_rows, route
from trainer.models.ops import Ops


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class ExpertParallel:
    """One expert-parallel group's exchange (shared by every MoE layer of a rank's model)."""

    def __init__(self, group, *, size: int, rank: int):
        """`group`: the process group of the "ep" mesh dimension; `rank` this rank's index in it."""
        self.group, self.size, self.rank = group, size, rank

    def apply(self, x_SD: torch.Tensor, d: Dispatch, gate_up: torch.Tensor, down: torch.Tensor, ops: Ops) -> torch.Tensor:
        """[S, D] the experts' outputs of the rows `x_SD` (sorted by global expert: dispatch `d`
        without padding), computed on the ranks that own those experts; `gate_up`, `down` are this
        rank's experts. Differentiable w.r.t. x_SD and the local weights (docs/design/execution.md,
        "Expert parallelism")."""
        return _ExpertExchange.apply(x_SD, d.counts, gate_up, down, self, ops)

    def _splits(self, counts_E: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """(rows sent to each rank, rows received from each rank, received rows per (source, local
        expert) [P, E_l]): one all-to-all of the counts and one host read."""
        P = self.size
        send_PE = counts_E.view(P, -1)
        El = send_PE.shape[1]
        recv_PE = _all_to_all(send_PE.reshape(-1), [El] * P, [El] * P, self.group).view(P, El)
        send, recv = torch.stack([send_PE.sum(1), recv_PE.sum(1)]).tolist()
        return send, recv, recv_PE

    @staticmethod
    def _local_dispatch(recv_PE: torch.Tensor, N: int, ops: Ops) -> Dispatch:
        """The received rows (by source rank, then local expert) grouped by local expert."""
        P, El = recv_PE.shape
        local_e = torch.arange(El, device=recv_PE.device).repeat(P)
        e_N1 = torch.repeat_interleave(local_e, recv_PE.reshape(-1), output_size=N)[:, None]
        return route(e_N1, El, align=ops.group_align)

    @staticmethod
    def _local_experts(x_ND: torch.Tensor, dl: Dispatch, gate_up, down, ops: Ops) -> torch.Tensor:
        y_SD = expert_swiglu(gather_rows(x_ND, dl.slot_row, dl.row_slots, src_pads=dl.padded), dl, gate_up, down, ops)
        return gather_rows(y_SD, dl.row_slots.reshape(-1), dl.slot_assign[:, None], inv_pads=dl.padded)


class _ExpertExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, counts_E, gate_up, down, ep: ExpertParallel, ops: Ops):
        send, recv, recv_PE = ep._splits(counts_E)
        x_ND = _all_to_all(x_SD, recv, send, ep.group)
        y_ND = ep._local_experts(x_ND, ep._local_dispatch(recv_PE, sum(recv), ops), gate_up, down, ops)
        ctx.save_for_backward(x_SD, counts_E, gate_up, down)
        ctx.ep, ctx.ops = ep, ops
        return _all_to_all(y_ND, send, recv, ep.group)

    @staticmethod
    def backward(ctx, g_SD):
        x_SD, counts_E, gate_up, down = ctx.saved_tensors
        ep, ops = ctx.ep, ctx.ops
        send, recv, recv_PE = ep._splits(counts_E)
        x_ND = _all_to_all(x_SD, recv, send, ep.group)
        g_ND = _all_to_all(g_SD, recv, send, ep.group)
        with torch.enable_grad():
            x = x_ND.detach().requires_grad_()
            gu, dn = gate_up.detach().requires_grad_(), down.detach().requires_grad_()
            y_ND = ep._local_experts(x, ep._local_dispatch(recv_PE, sum(recv), ops), gu, dn, ops)
            dx_ND, dgu, ddn = torch.autograd.grad(y_ND, (x, gu, dn), g_ND, allow_unused=True, materialize_grads=True)
        return _all_to_all(dx_ND, send, recv, ep.group), None, dgu, ddn, None, None


def shard_experts(model: torch.nn.Module, ep_mesh) -> int:
    """Make every MoE layer's routed-expert parameters DTensors sharded on dim 0 over `ep_mesh` (a
    meta model, before FSDP2) and give their layers the group's exchange. Returns the MoE layers.

    Raises:
        ValueError: num_experts not divisible by the expert-parallel size.
    """
    from torch.distributed.tensor import DTensor, Shard

    P = ep_mesh.size()
    ep = ExpertParallel(ep_mesh.get_group(), size=P, rank=ep_mesh.get_local_rank())
    n = 0
    for layer in model.model.layers:
        moe = layer.mlp
        if not getattr(layer, "is_moe", False):
            continue
        ex = moe.experts
        if ex.num_experts % P:
            raise ValueError(f"parallelism.expert_parallel: expected a divisor of num_experts ({ex.num_experts}), got {P}")
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)
            local = torch.empty((p.shape[0] // P, *p.shape[1:]), dtype=p.dtype, device=p.device)
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(ex, name, torch.nn.Parameter(dt, requires_grad=p.requires_grad))
        ex.expert_parallel = ep
        n += 1
    return n


__all__ = ["ExpertParallel", "shard_experts"]
