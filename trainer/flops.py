"""Model FLOPs of a plan: the work an executor must do to run it, counted from the model config.

    f = plan_flops(plan, cfg, chunk_size=64)     # PlanFlops: dense, attention, linear_kernel, lm_head
    ideal = plan_flops(expanded, cfg, chunk_size=64).total / f.total   # the FLOP compression

The ideal speedup of tree over trajectory-expanded execution, the benchmarks' "fraction of ideal";
what is counted and why token compression is not that ideal: docs/design/execution.md ("Counting
FLOPs").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.models.config import FULL, ModelConfig


@dataclass(slots=True, kw_only=True)
class PlanFlops:
    """FLOPs of one plan by kind (forward; docs/design/execution.md, "Counting FLOPs")."""

    dense: float = 0.0
    attention: float = 0.0
    linear_kernel: float = 0.0
    lm_head: float = 0.0

    @property
    def total(self) -> float:
        return self.dense + self.attention + self.linear_kernel + self.lm_head

    def as_dict(self) -> dict:
        return {"dense": self.dense, "attention": self.attention, "linear_kernel": self.linear_kernel,
                "lm_head": self.lm_head, "total": self.total}


def dense_flops_per_row(cfg: ModelConfig) -> float:
    """Forward FLOPs of one row through every layer's per-row matmuls (no attention scores, no kernel)."""
    D = cfg.hidden_size
    total = 0.0
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            q = D * cfg.num_attention_heads * cfg.head_dim * 2  # query and output gate
            kv = 2 * D * cfg.num_key_value_heads * cfg.head_dim
            o = cfg.num_attention_heads * cfg.head_dim * D
            total += 2 * (q + kv + o)
        else:
            key, value = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
            qkvz = D * (2 * key + 2 * value)
            ba = D * 2 * cfg.linear_num_value_heads
            out = value * D
            conv = (2 * key + value) * cfg.linear_conv_kernel_dim
            total += 2 * (qkvz + ba + out + conv)
        if cfg.is_moe_layer(i):
            router = D * cfg.num_experts
            routed = cfg.num_experts_per_tok * 3 * D * cfg.moe_intermediate_size
            shared = 3 * D * cfg.shared_expert_intermediate_size + D if cfg.shared_expert_intermediate_size else 0
            total += 2 * (router + routed + shared)
        else:
            total += 2 * 3 * D * cfg.intermediate_size
    return total


def linear_kernel_flops_per_row(cfg: ModelConfig, chunk_size: int) -> float:
    """Forward FLOPs of the chunked gated delta rule per kernel row and Gated DeltaNet layer (all heads)."""
    C, K, V = chunk_size, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    # Per row of a chunk: (beta k) k^T and q k^T (C x K each), the two unit-triangular solves
    # (C x (V + K) / 2 multiply-adds), attn V' (C x V), and W S, q S, k^T V' (K x V each).
    per_head = 2 * (2 * C * K + C * (V + K) / 2 + C * V + 3 * K * V)
    return per_head * cfg.linear_num_value_heads


def plan_flops(plan, cfg: ModelConfig, *, chunk_size: int) -> PlanFlops:
    """FLOPs of every microbatch of `plan` (a plan_pb2.Plan or PlanSlice) on a model of config `cfg`."""
    from plan.microbatch import decode_microbatch
    from plan.decode import rank_plans

    n_linear = sum(1 for kind in cfg.layer_types if kind != FULL)
    n_full = len(cfg.layer_types) - n_linear
    dense_row = dense_flops_per_row(cfg)
    kernel_row = linear_kernel_flops_per_row(cfg, chunk_size)
    attn_key = 2 * 2 * cfg.num_attention_heads * cfg.head_dim  # q k^T and p v per (row, key)
    out = PlanFlops()
    header, ranks = rank_plans(plan)
    for rank in ranks:
        for mb in rank.microbatches:
            a = decode_microbatch(mb, header.params)
            R = a.num_rows
            out.dense += dense_row * R
            out.attention += n_full * attn_key * float(a.depth.astype(np.float64).sum() + R)
            out.linear_kernel += n_linear * kernel_row * (R + a.num_replay_rows)
            out.lm_head += 2 * cfg.hidden_size * cfg.vocab_size * int(np.unique(a.lp_row).shape[0])
    return out
