"""Sequence-coupled operators over packed tree rows, each beside a plain reference.

    y_RC = ancestry_conv(x_NC, w_CK, layout.conv_src)      # the short conv over each row's K-1 ancestors
    out, states = linear_attention(q, k, v, g, beta, layout.linear_calls, layout.row_from_kept,
                                   num_states, fn=kernel, chunk_size=64)   # one layer's call schedule

Tree attention, the third, is `kernels.tree_attention`. The conv sums oldest first as a linear
sequence does; a call gathers replay + range rows, runs from the state table and discards replay
outputs (docs/design/min-calls.md, "Running a call"; docs/design/execution.md).
Legend: R rows, C channels, K conv kernel, J = K-1 ancestors, H heads, Hkv kv heads, hd head dim,
Kd/Vd linear key/value dims, n gathered rows of one call, N sequences (or rows of a table with
imported rows), E exports, S segments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.gated_delta_rule import prepare_layout

#: StateSource kinds (proto/harts/v1/plan.proto).
ZERO, LOCAL, IMPORTED = 0, 1, 2


@dataclass(slots=True, kw_only=True)
class LinearCall:
    """One varlen kernel launch of the schedule."""

    gather_idx: torch.Tensor
    """long [n] rows in kernel order: per sequence its replay rows then its range rows."""
    cu_seqlens: torch.Tensor
    """long [N+1] sequence offsets into gather_idx."""
    init_kind: list[int]
    """[N] ZERO / LOCAL / IMPORTED."""
    init_state: list[int]
    """[N] state-table id (LOCAL) or import id (IMPORTED); ignored for ZERO."""
    keep_idx: torch.Tensor
    """long [k] positions of the kernel output that are kept (range rows), in row-kept order."""
    export_seq: torch.Tensor
    """long [E] sequence of each export."""
    export_pos: torch.Tensor
    """long [E] rows of that sequence done at the export (a chunk multiple or its length)."""
    export_state: list[int]
    """[E] state-table id each export fills."""
    kernel_layout: object | None = None
    """The kernel's chunk layout of this call (`prepare_layout`), built on first use and shared by
    every linear-attention layer of the microbatch."""


def ancestry_conv(x_NC: torch.Tensor, w_CK: torch.Tensor, conv_src_RJ: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv through the conv ancestry (no activation).

    Args:
        x_NC: [N, C] inputs: the R local rows first, then any imported rows (sharing windows).
        w_CK: [C, K] weights, w[:, K-1] multiplies the row itself.
        conv_src_RJ: long [R, K-1] ancestor rows (into x_NC) oldest first; N means zero padding.
    Returns:
        [R, C] outputs of the local rows.
    """
    R = conv_src_RJ.shape[0]
    C = x_NC.shape[1]
    K = w_CK.shape[1]
    x_ext = torch.cat([x_NC, x_NC.new_zeros(1, C)], dim=0)
    acc = None
    for j in range(K - 1):
        term = x_ext.index_select(0, conv_src_RJ[:, j]) * w_CK[:, j]
        acc = term if acc is None else acc + term
    term = x_NC[:R] * w_CK[:, K - 1]
    return term if acc is None else acc + term


def causal_conv_ref(x_LC: torch.Tensor, w_CK: torch.Tensor) -> torch.Tensor:
    """Reference: one linear sequence through F.conv1d with left zero padding."""
    L, C = x_LC.shape
    K = w_CK.shape[1]
    y = F.conv1d(x_LC.t()[None], w_CK[:, None, :], padding=K - 1, groups=C)[0, :, :L]
    return y.t()


def linear_attention(
    q_NHK: torch.Tensor,
    k_NHK: torch.Tensor,
    v_NHV: torch.Tensor,
    g_NH: torch.Tensor,
    beta_NH: torch.Tensor,
    calls: list[LinearCall],
    row_from_kept: torch.Tensor,
    num_states: int,
    *,
    fn,
    chunk_size: int,
    imported_states: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Run the linear-attention call schedule of one microbatch for one layer.

    Args:
        q_NHK, k_NHK: [N, Hk, Kd] kernel-input table: the local rows, then any imported rows
            (sharing windows); q/k are repeated to the value heads after the gather.
        v_NHV: [N, Hv, Vd]. g_NH: [N, Hv] log decay (fp32, float64 in a float64 model). beta_NH: [N, Hv].
        calls: the schedule, in order (gather indices into the table). row_from_kept: long [R] row ->
            index in the concatenation of all calls' kept outputs. num_states: size of the
            microbatch's state table.
        fn: chunk_gated_delta_rule-compatible kernel. chunk_size: C.
        imported_states: [Q, Hv, Kd, Vd] states (fp32, or float64) imported from other microbatches.
    Returns:
        ([R, Hv, Vd] outputs, every row from the sequence that keeps it; the state table, id ->
        [Hv, Kd, Vd] state or None). States are never detached, so gradients of later calls (and of
        importers) flow into the calls and replay rows that produced them.
    """
    rep = v_NHV.shape[1] // q_NHK.shape[1]
    H, Kd, Vd = v_NHV.shape[1], q_NHK.shape[2], v_NHV.shape[2]
    states: list[torch.Tensor | None] = [None] * num_states
    zero = torch.zeros(H, Kd, Vd, dtype=torch.promote_types(q_NHK.dtype, torch.float32), device=q_NHK.device)
    imported = imported_states.unbind(0) if imported_states is not None else None
    kept = []
    # One gather for all calls (replay rows appear in several): its backward is one index_add into
    # one zero-filled gradient, where a gather per call zero-fills a full [N, ...] gradient each.
    sizes = [int(call.gather_idx.shape[0]) for call in calls]
    idx_all = calls[0].gather_idx if len(calls) == 1 else torch.cat([call.gather_idx for call in calls])
    gathered = [x.index_select(0, idx_all) for x in (q_NHK, k_NHK, v_NHV, g_NH, beta_NH)]
    gathered[0] = gathered[0].repeat_interleave(rep, dim=1)
    gathered[1] = gathered[1].repeat_interleave(rep, dim=1)
    gathered = [x.split(sizes) for x in gathered]
    for c, call in enumerate(calls):
        inits = []
        for kind, sid in zip(call.init_kind, call.init_state):
            if kind == ZERO:
                inits.append(zero)
            elif kind == LOCAL:
                if states[sid] is None:
                    raise ValueError(f"linear_calls[{c}]: state {sid} is read before any earlier call exported it")
                inits.append(states[sid])
            else:
                if imported is None:
                    raise ValueError(f"linear_calls[{c}]: imported state {sid} but no imports were given")
                inits.append(imported[sid])
        if call.kernel_layout is None:
            call.kernel_layout = prepare_layout(call.cu_seqlens, call.export_seq, call.export_pos, chunk_size,
                                                device=q_NHK.device)
        o, st = fn(
            *(x[c] for x in gathered),
            cu_seqlens=call.cu_seqlens, initial_state=torch.stack(inits), export_seq=call.export_seq,
            export_pos=call.export_pos, chunk_size=chunk_size, scale=None, use_qk_l2norm=True,
            layout=call.kernel_layout,
        )
        for sid, state in zip(call.export_state, st.unbind(0)):  # one unbind: its backward stacks
            states[sid] = state
        kept.append(o.index_select(0, call.keep_idx))
    return torch.cat(kept, dim=0).index_select(0, row_from_kept), states
