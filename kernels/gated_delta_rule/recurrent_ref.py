"""Token-by-token gated delta rule: the oracle every chunked implementation is tested against.

    S_t = exp(g_t) S_{t-1};  S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T;  o_t = S_t^T (scale * q_t)

Per sequence and head, state S [K, V], q and k optionally L2-normalised first: exactly transformers'
`torch_recurrent_gated_delta_rule`. A Python loop over tokens, for small test shapes
(docs/design/execution.md, "The gated delta rule").
Legend: T packed rows, N sequences, E exported states, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import torch

from kernels.dtypes import compute_dtype
from kernels.gated_delta_rule.layout import validate_inputs

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, written as transformers/fla write it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(
    q_THK: torch.Tensor, k_THK: torch.Tensor, scale: float | None, use_qk_l2norm: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast to the compute dtype, optionally L2-normalise, and scale q (default K ** -0.5)."""
    q_THK = q_THK.to(dtype)
    k_THK = k_THK.to(dtype)
    if use_qk_l2norm:
        q_THK = l2norm(q_THK)
        k_THK = l2norm(k_THK)
    if scale is None:
        scale = q_THK.shape[-1] ** -0.5
    return q_THK * scale, k_THK


def recurrent_gated_delta_rule_ref(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    export_seq: torch.Tensor,
    export_pos: torch.Tensor,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `chunk_gated_delta_rule`; chunk_size only validates export_pos.

    Returns:
        o [T, H, V] in v's dtype, states [E, H, K, V] in the compute dtype (fp32, or float64 for
        float64 inputs).
    """
    validate_inputs(
        q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state, export_seq, export_pos, chunk_size
    )
    dt = compute_dtype(q_THK, k_THK, v_THV)
    T, H, K = q_THK.shape
    V = v_THV.shape[-1]
    out_dtype = v_THV.dtype
    q_THK, k_THK = prepare_qk(q_THK, k_THK, scale, use_qk_l2norm, dt)
    v_THV = v_THV.to(dt)
    a_TH = g_TH.to(dt).exp()
    beta_TH = beta_TH.to(dt)
    cu = cu_seqlens.cpu().tolist()
    wanted: dict[tuple[int, int], list[int]] = {}
    for e, (n, p) in enumerate(zip(export_seq.tolist(), export_pos.tolist())):
        wanted.setdefault((n, p), []).append(e)
    states: list[torch.Tensor | None] = [None] * export_seq.numel()
    outs = []
    for n in range(len(cu) - 1):
        if initial_state is None:
            S_HKV = q_THK.new_zeros(H, K, V)
        else:
            S_HKV = initial_state[n].to(dt)
        for t in range(cu[n], cu[n + 1]):
            S_HKV = S_HKV * a_TH[t][:, None, None]
            pred_HV = (S_HKV * k_THK[t][:, :, None]).sum(dim=1)
            delta_HV = (v_THV[t] - pred_HV) * beta_TH[t][:, None]
            S_HKV = S_HKV + k_THK[t][:, :, None] * delta_HV[:, None, :]
            outs.append((S_HKV * q_THK[t][:, :, None]).sum(dim=1))
            for e in wanted.get((n, t + 1 - cu[n]), ()):
                states[e] = S_HKV
    o_THV = torch.stack(outs).to(out_dtype)
    if states:
        states_EHKV = torch.stack(states)
    else:
        states_EHKV = q_THK.new_zeros(0, H, K, V)
    return o_THV, states_EHKV
