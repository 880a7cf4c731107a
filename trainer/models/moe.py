"""Mixture-of-experts FFN over packed rows: router, expert-sorted dispatch, expert SwiGLUs, fixed-order combine.

    probs_RE, w_Rk, e_Rk = router(x_RD, ops)              # top-k experts of each row, ascending expert ids
    d = route(e_Rk, E, align=ops.group_align)             # Dispatch: slots, groups and counts, on the device
    x_SD = gather_rows(x_RD, d.slot_row, d.row_slots)     # each row copied to its k slots, grouped by expert
    y_SD = experts(x_SD, d, ops)                          # SwiGLU of every group: grouped GEMMs or a loop
    out_RD = combine(y_SD, w_Rk, d)                       # per row: its experts' outputs, ascending expert order

No dropped tokens, no float atomics, no host reads on the grouped path: docs/design/execution.md
("Mixture of experts"). Legend: R rows, D hidden, E experts, k top-k, A = R k assignments,
S slots (A plus group padding), I expert width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.ops import Ops

#: torch's grouped GEMM (`F.grouped_mm` in newer versions, `torch._grouped_mm` before)
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass(slots=True, kw_only=True)
class Dispatch:
    """Where every (row, expert) assignment of one MoE layer goes: device tensors, built by `route`."""

    num_rows: int
    """R."""
    top_k: int
    """k."""
    slot_row: torch.Tensor
    """long [S] source row of each slot; R for a padding slot (it reads a zero row)."""
    slot_assign: torch.Tensor
    """long [S] assignment r k + j of each slot; A for a padding slot."""
    row_slots: torch.Tensor
    """long [R, k] slot of each row's j-th expert (experts ascending)."""
    group_start: torch.Tensor
    """long [E] first slot of each expert's group."""
    group_end: torch.Tensor
    """int32 [E] end of each expert's group (padded): the `offs` of a grouped GEMM."""
    counts: torch.Tensor
    """long [E] rows routed to each expert (unpadded)."""

    @property
    def num_slots(self) -> int:
        return int(self.slot_row.shape[0])

    @property
    def padded(self) -> bool:
        """Whether there are padding slots (S > A): known from the shapes, no host read."""
        return self.num_slots > self.num_rows * self.top_k


def route(e_Rk: torch.Tensor, num_experts: int, *, align: int = 1) -> Dispatch:
    """The dispatch of top-k choices `e_Rk` (long [R, k], each row's experts ascending).

    Slots hold the assignments sorted by expert, stably (rows ascending within an expert); each
    expert's group starts at a multiple of `align` (padding slots read a zero row and are never
    combined). S = A + E (align - 1) rounded up to `align` is a bound known without the counts, so
    nothing is read back to the host.
    """
    R, k = e_Rk.shape
    A, E, dev = R * k, num_experts, e_Rk.device
    flat_A = e_Rk.reshape(-1)
    order = torch.argsort(flat_A, stable=True)  # sorted position -> assignment
    sorted_e = flat_A.index_select(0, order)
    bounds = torch.searchsorted(sorted_e, torch.arange(E + 1, device=dev, dtype=sorted_e.dtype))
    counts = bounds[1:] - bounds[:-1]
    if align == 1:
        start, end, S = bounds[:-1], bounds[1:], A
        slot_of_sorted = torch.arange(A, device=dev)
        slot_assign = order
    else:
        padded = (counts + (align - 1)) // align * align
        end = torch.cumsum(padded, 0)
        start = end - padded
        S = -(-(A + E * (align - 1)) // align) * align
        slot_of_sorted = torch.arange(A, device=dev) + (start - bounds[:-1]).index_select(0, sorted_e)
        # Every slot finds its source without a scatter: its group, its index in the group, and
        # (inside the group's count) the sorted position it holds.
        s = torch.arange(S, device=dev)
        g = torch.searchsorted(end, s, right=True).clamp_max(E - 1)
        i = s - start.index_select(0, g)
        valid = (i >= 0) & (i < counts.index_select(0, g))
        pos = (bounds[:-1].index_select(0, g) + i).clamp(0, max(A - 1, 0))
        slot_assign = torch.where(valid, order.index_select(0, pos), torch.full_like(s, A))
    inverse = torch.argsort(order)  # assignment -> sorted position (order is a permutation)
    row_slots = slot_of_sorted.index_select(0, inverse).view(R, k)
    slot_row = torch.where(slot_assign < A, slot_assign // k, torch.full_like(slot_assign, R))
    return Dispatch(num_rows=R, top_k=k, slot_row=slot_row, slot_assign=slot_assign, row_slots=row_slots,
                    group_start=start, group_end=end.to(torch.int32), counts=counts)


class _GatherRows(torch.autograd.Function):
    """out[m] = x[src[m]] (src = N: a zero row); backward dx[n] = sum_j dout[inv[n, j]] (inv = M: zero)."""

    @staticmethod
    def forward(ctx, x_ND, src_M, inv_NJ, src_pads: bool, inv_pads: bool):
        ctx.save_for_backward(inv_NJ)
        ctx.inv_pads = inv_pads
        return _with_zero_row(x_ND, src_pads).index_select(0, src_M)

    @staticmethod
    def backward(ctx, g_MD):
        (inv_NJ,) = ctx.saved_tensors
        ext = _with_zero_row(g_MD, ctx.inv_pads)
        N, J = inv_NJ.shape
        if J == 1:
            return ext.index_select(0, inv_NJ[:, 0]), None, None, None, None
        return ext.index_select(0, inv_NJ.reshape(-1)).view(N, J, *g_MD.shape[1:]).sum(1), None, None, None, None


def _with_zero_row(x: torch.Tensor, pad: bool) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])]) if pad else x


def gather_rows(x_ND: torch.Tensor, src_M: torch.Tensor, inv_NJ: torch.Tensor, *, src_pads: bool = False,
                inv_pads: bool = False) -> torch.Tensor:
    """Rows `x[src]`, differentiable without a scatter: `inv_NJ` lists, for each source row, the J
    outputs that read it, so the backward is a gather and a sum over J in a fixed order.

    Args:
        src_pads: `src` may hold N (the output row is zero). inv_pads: `inv` may hold M (no output).
    """
    return _GatherRows.apply(x_ND, src_M, inv_NJ, src_pads, inv_pads)


def dispatch_rows(x_RD: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """[S, D] each row at its k slots, padding slots zero."""
    return gather_rows(x_RD, d.slot_row, d.row_slots, src_pads=d.padded)


def combine(y_SD: torch.Tensor, w_Rk: torch.Tensor, d: Dispatch, *, chained: bool) -> torch.Tensor:
    """[R, D] per row: sum over its experts j (ascending ids) of w[r, j] * y[slot(r, j)], in w's dtype.

    Args:
        chained: sum with k - 1 elementwise adds in ascending expert order (the reference's order:
            bitwise equal to it on the CPU, and position-independent on a GPU); False: one sum over
            k (fewer launches, deterministic, but the reduction may depend on R).
    """
    R, k = w_Rk.shape
    y_RkD = gather_rows(y_SD, d.row_slots.reshape(-1), d.slot_assign[:, None], inv_pads=d.padded).view(R, k, -1)
    h_RkD = (y_RkD * w_Rk[..., None]).to(w_Rk.dtype)
    if not chained:
        return h_RkD.sum(1)
    out = h_RkD[:, 0]
    for j in range(1, k):
        out = out + h_RkD[:, j]
    return out


class Router(nn.Module):
    """Softmax router with deterministic top-k (no capacity, no token dropping)."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, norm_topk: bool):
        super().__init__()
        self.top_k, self.norm_topk = top_k, norm_topk
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x_RD: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs [R, E] in at least fp32, top-k weights [R, k] in x's dtype, top-k experts [R, k]),
        each row's experts in ascending order (weights permuted with them)."""
        return ops.router(ops.linear(x_RD, self.weight), top_k=self.top_k, norm=self.norm_topk)


class Experts(nn.Module):
    """Routed experts stored as 3D tensors (the transformers v5 in-memory layout)."""

    def __init__(self, E: int, D: int, inner: int):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inner, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, inner))
        self.expert_parallel = None
        """`trainer.expert_parallel.ExpertParallel` when the experts are split over ranks (the
        parameters are then DTensors holding this rank's experts)."""

    def forward(self, x_SD: torch.Tensor, d: Dispatch, ops: Ops) -> torch.Tensor:
        """[S, D] SwiGLU of every slot with its group's expert (padding slots: zeros, or anything
        the grouped GEMM leaves there; they are never combined). With expert parallelism, `d`
        (without padding) sorts the rows by global expert and the rows travel to their experts'
        ranks and back (`trainer.expert_parallel`)."""
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        if self.expert_parallel is not None:
            return self.expert_parallel.apply(x_SD, d, gate_up, down, ops)
        return expert_swiglu(x_SD, d, gate_up, down, ops)

    def forward_ref(self, x_RD: torch.Tensor, topk_Rk: torch.Tensor, weight_Rk: torch.Tensor, ops: Ops) -> torch.Tensor:
        """Plain reference of the whole routed output [R, D]: expert by expert (ascending), rows
        found with torch.where, accumulated with index_add."""
        out_RD = torch.zeros_like(x_RD)
        for e in torch.unique(topk_Rk).tolist():
            rows, slot = torch.where(topk_Rk == e)
            gate, up = ops.linear(x_RD.index_select(0, rows), self.gate_up_proj[e]).chunk(2, dim=-1)
            h = ops.linear(ops.swiglu(gate, up), self.down_proj[e]) * weight_Rk[rows, slot, None]
            out_RD = out_RD.index_add(0, rows, h.to(out_RD.dtype))
        return out_RD


def expert_swiglu(x_SD: torch.Tensor, d: Dispatch, gate_up: torch.Tensor, down: torch.Tensor, ops: Ops) -> torch.Tensor:
    """[S, D] down_e(silu(gate_e(x)) * up_e(x)) of every slot with the expert e of its group
    (gate_up [E, 2I, D], down [E, D, I]): two grouped GEMMs (`ops.experts == "grouped"` where they
    run) or expert by expert."""
    if ops.experts == "grouped" and _grouped_ok(x_SD):
        gu_S2I = _grouped_mm(x_SD, gate_up.transpose(-2, -1), offs=d.group_end)
        gate, up = gu_S2I.chunk(2, dim=-1)
        return _grouped_mm(ops.swiglu(gate, up), down.transpose(-2, -1), offs=d.group_end)
    return _expert_loop(x_SD, d, gate_up, down, ops)


def _expert_loop(x_SD: torch.Tensor, d: Dispatch, gate_up: torch.Tensor, down: torch.Tensor, ops: Ops) -> torch.Tensor:
    """Expert by expert through `ops.linear` (one host read of the group boundaries). An input
    with no row still depends on the weights (zero gradients), so that a sharded expert unit takes
    part in every backward."""
    starts, counts = torch.stack([d.group_start, d.counts]).tolist()  # one host read
    # unbind, not [e]: one node whose backward stacks, where each select's backward would
    # zero-fill a gradient of the whole [E, ...] weight.
    gate_up_E, down_E = gate_up.unbind(0), down.unbind(0)
    parts, at = [], 0
    for e, (lo, n) in enumerate(zip(starts, counts)):
        if not n:
            continue
        if lo > at:
            parts.append(x_SD.new_zeros(lo - at, x_SD.shape[1]))
        gate, up = ops.linear(x_SD[lo : lo + n], gate_up_E[e]).chunk(2, dim=-1)
        parts.append(ops.linear(ops.swiglu(gate, up), down_E[e]))
        at = lo + n
    if not at:  # no row for any expert: an exact zero that still reaches the weights
        return x_SD.new_zeros(x_SD.shape[0], down.shape[1]) + (gate_up.sum() + down.sum()) * 0.0
    if at < x_SD.shape[0]:
        parts.append(x_SD.new_zeros(x_SD.shape[0] - at, x_SD.shape[1]))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _local(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a parameter (a DTensor under expert parallelism), differentiably."""
    return w.to_local() if hasattr(w, "to_local") else w


def _grouped_ok(x_SD: torch.Tensor) -> bool:
    """Grouped GEMMs run here: a torch that has them, bf16 on CUDA (its kernel's only dtype); fp32 or
    bf16 on the CPU (torch's reference implementation: tests of this path)."""
    if _grouped_mm is None:
        return False
    if x_SD.is_cuda:
        return x_SD.dtype == torch.bfloat16
    return x_SD.device.type == "cpu" and x_SD.dtype in (torch.float32, torch.bfloat16)


__all__ = ["Dispatch", "Experts", "Router", "combine", "dispatch_rows", "gather_rows", "route"]
