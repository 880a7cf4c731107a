"""Qwen3-Next-style hybrid decoder over packed rows (DESIGN §5.1-§5.2).

The arithmetic follows transformers' `models/qwen3_next` (zero-centred RMSNorm, Gated DeltaNet with
fused `in_proj_qkvz`/`in_proj_ba` grouped per key head, gated softmax attention with partial RoPE,
softmax top-k MoE with a gated shared expert), but the model runs on a packed set of rows described
by a `trainer.layout.RowLayout` instead of a [batch, seq] grid: per-token operators run once per
row, and the sequence-coupled ones (short conv, attention, linear attention) go through the
layout's ancestry and call schedule (`trainer.tree_ops`).

Parameter names equal the Hugging Face module names (`model.layers.3.self_attn.q_proj.weight`),
so a checkpoint's state dict loads with only the per-expert weights regrouped (`loading.py`).

Batch invariance (DESIGN §5.3 asks for bitwise equal linear-attention outputs between tree and
expanded runs on CPU): a row's result must not depend on the other rows of the microbatch or on
its position. Every projection is a `RowLinear`, a matmul over fixed-size row tiles (plain CPU
GEMMs pick different blockings for different row counts); sigmoid/silu/softplus are written with
`exp` (torch's own kernels round their vector body and scalar tail differently, measured);
attention reduces over keys in blocks at fixed depths (`kernels.tree_attention.blocked`). The whole
forward is therefore bitwise equal between a tree run and its expanded run in fp32 on CPU.

Dtypes: where a value is upcast for accuracy (norms, the decay g, the router softmax, RoPE) it goes
to `compute_dtype(x)` = promote(x.dtype, fp32) (`kernels.dtypes`, shared with the kernels), never
to a hard-coded fp32: fp32 and bf16 models compute exactly as before, and a float64 model
(`model.double()`) computes in float64 end to end, the oracle of `harts verify --f64-reference`.

Legend: R rows, D hidden, H heads, Hk/Hv linear key/value heads, Kd/Vd linear head dims,
hd attention head dim, E experts, k top-k, C conv channels, K conv kernel, V vocab.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from plan.window_exports import ATTN, CONV, KERNEL
from trainer import tree_ops
from trainer.boundary import Boundary
from kernels.dtypes import compute_dtype
from kernels.tree_attention import attention_backend
from trainer.models.config import FULL, ModelConfig

#: rows per tile of RowLinear; every tile is one same-shape GEMM.
ROW_TILE = 32


def row_linear(x_RI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T + b`, batch-invariant: each row's result is independent of the other rows.

    Pads the rows to a multiple of ROW_TILE and runs one GEMM over them (the same kernel as a
    matmul of [ROW_TILE, I] tiles, which torch folds into it); the padded row count keeps the CPU
    GEMM's blocking independent of R. Without padding the result is the GEMM's output itself.
    """
    R = x_RI.shape[0]
    pad = (-R) % ROW_TILE
    y_PO = torch.mm(F.pad(x_RI, (0, 0, 0, pad)) if pad else x_RI.contiguous(), w_OI.t())
    y_RO = y_PO[:R] if pad else y_PO
    return y_RO if b_O is None else y_RO + b_O


def row_linear_ref(x_RI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None) -> torch.Tensor:
    """Plain reference of `row_linear` (not batch-invariant)."""
    return F.linear(x_RI, w_OI, b_O)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)): unlike torch.sigmoid, bitwise the same wherever x sits in the tensor."""
    return 1.0 / (1.0 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), position-independent (torch's silu rounds its vector body and tail differently)."""
    return x / (1.0 + torch.exp(-x))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) with torch's threshold of 20, position-independent."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp_max(20.0))))


class RowLinear(nn.Linear):
    """nn.Linear whose forward is the batch-invariant `row_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `x_hat * (1 + w)`, computed in at least fp32 (`compute_dtype`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(compute_dtype(x))
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.to(xf.dtype))).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight) followed by a `silu(z)` gate, per value head (norm and gate in at
    least fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(compute_dtype(x))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * silu(z.to(compute_dtype(z)))).to(dtype)


class Capture:
    """What one forward records besides the hidden states (filled per layer, in layer order).

    Created by `Qwen3NextForRL.forward` for each call and returned in its `ModelOutput`: the
    forward has no effect outside its return value, so it can be re-run (recomputation).

    A plain class, not a dataclass: it travels into every decoder block's forward, and FSDP2
    rebuilds a dataclass input that holds tensors requiring grad (`dataclasses.replace`, to wrap
    them in its post-backward function), so a sharded block would record its router
    probabilities into a copy the model never reads (the load-balancing loss lost every MoE
    layer after the first; `tests/trainer/test_lockstep.py` compares it with an unsharded run).
    """

    __slots__ = ("boundary", "linear_outputs", "linear", "router_probs", "router_topk")

    def __init__(self, *, boundary: Boundary, linear_outputs: bool = False):
        self.boundary = boundary
        """The microbatch's sharing-window imports and exports (`trainer.boundary`)."""
        self.linear_outputs = linear_outputs
        """Keep each linear-attention layer's kernel output (detached) in `linear`."""
        self.linear: dict[int, torch.Tensor] = {}
        """layer -> [R, Hv, Vd] kept kernel outputs."""
        self.router_probs: dict[int, torch.Tensor] = {}
        """MoE layer -> [R, E] router softmax in the compute dtype (with graph, for the auxiliary loss)."""
        self.router_topk: dict[int, torch.Tensor] = {}
        """MoE layer -> [R, k] selected experts."""


@dataclass(slots=True, kw_only=True)
class ModelOutput:
    """What a microbatch forward returns."""

    hidden: torch.Tensor
    """[R, D] final (normed) hidden states."""
    logits: torch.Tensor | None
    """[U', V] logits of the requested rows (`logit_rows`, U of them), then U' - U < ROW_TILE padding
    rows (copies of the last one); None when no rows were requested. The padding makes the lm head
    one whole-tile GEMM whose output is the GEMM's own tensor, not a view of it: FSDP2 warns that a
    view returned by a sharded module can lose its pre-backward hook to an in-place op."""
    router_probs: dict[int, torch.Tensor]
    """MoE layer -> [R, E] router softmax (with graph)."""
    router_topk: dict[int, torch.Tensor]
    """MoE layer -> [R, k] selected experts."""
    linear: dict[int, torch.Tensor]
    """layer -> [R, Hv, Vd] linear-attention outputs (only with capture_linear)."""
    exports: dict[str, torch.Tensor]
    """Sharing-window exports by name (`trainer.boundary`), with graph when grad is enabled."""


class GatedDeltaNet(nn.Module):
    """Linear-attention token mixer (Gated DeltaNet), run through the layout's call schedule."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.Kd, self.Vd = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.K = cfg.linear_conv_kernel_dim
        key_dim, value_dim = self.Hk * self.Kd, self.Hv * self.Vd
        self.conv_dim = 2 * key_dim + value_dim
        D = cfg.hidden_size
        self.in_proj_qkvz = RowLinear(D, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = RowLinear(D, 2 * self.Hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=False, padding=self.K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.empty(self.Hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.Vd, cfg.rms_norm_eps)
        self.out_proj = RowLinear(value_dim, D, bias=False)

    def forward(self, x_RD: torch.Tensor, layout, run: "RunOptions", capture: Capture) -> torch.Tensor:
        R = x_RD.shape[0]
        r = self.Hv // self.Hk
        bd, name = capture.boundary, f"{self.layer_idx}."
        qkvz = self.in_proj_qkvz(x_RD).view(R, self.Hk, 2 * self.Kd + 2 * r * self.Vd)
        q, k, v, z = torch.split(qkvz, [self.Kd, self.Kd, r * self.Vd, r * self.Vd], dim=-1)
        b, a = torch.split(self.in_proj_ba(x_RD).view(R, self.Hk, 2 * r), [r, r], dim=-1)
        mixed_RC = torch.cat([q.reshape(R, -1), k.reshape(R, -1), v.reshape(R, -1)], dim=-1)
        mixed_NC = bd.table(name + "conv", mixed_RC, CONV)
        mixed_RC = silu(tree_ops.ancestry_conv(mixed_NC, self.conv1d.weight[:, 0, :], layout.conv_src))
        key_dim = self.Hk * self.Kd
        q_RHK, k_RHK, v_RHV = torch.split(mixed_RC, [key_dim, key_dim, self.Hv * self.Vd], dim=-1)
        beta_RH = sigmoid(b.reshape(R, self.Hv))
        g_RH = -self.A_log.to(compute_dtype(self.A_log)).exp() * softplus(a.reshape(R, self.Hv).to(compute_dtype(a)) + self.dt_bias)
        o_RHV, states = tree_ops.linear_attention(
            bd.table(name + "q", q_RHK.reshape(R, self.Hk, self.Kd), KERNEL),
            bd.table(name + "k", k_RHK.reshape(R, self.Hk, self.Kd), KERNEL),
            bd.table(name + "v", v_RHV.reshape(R, self.Hv, self.Vd), KERNEL),
            bd.table(name + "g", g_RH, KERNEL), bd.table(name + "beta", beta_RH, KERNEL),
            layout.linear_calls, layout.row_from_kept, layout.num_states, fn=run.linear_fn,
            chunk_size=run.chunk_size, imported_states=bd.states(name + "state"),
        )
        bd.export_states(name + "state", states)
        if capture.linear_outputs:
            capture.linear[self.layer_idx] = o_RHV.detach()
        o_RHV = self.norm(o_RHV, z.reshape(R, self.Hv, self.Vd))
        return self.out_proj(o_RHV.reshape(R, -1))


class Attention(nn.Module):
    """Gated softmax attention with q/k RMSNorm, partial RoPE at each row's depth and GQA."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H, self.Hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = RowLinear(D, self.H * self.hd * 2, bias=bias)
        self.k_proj = RowLinear(D, self.Hkv * self.hd, bias=bias)
        self.v_proj = RowLinear(D, self.Hkv * self.hd, bias=bias)
        self.o_proj = RowLinear(self.H * self.hd, D, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.rotary_dim = cfg.rotary_dim
        self.theta = cfg.rope_theta

    def forward(self, x_RD: torch.Tensor, layout, run: "RunOptions", capture: Capture) -> torch.Tensor:
        R = x_RD.shape[0]
        bd, name = capture.boundary, f"{self.layer_idx}."
        q_gate = self.q_proj(x_RD).view(R, self.H, 2 * self.hd)
        q_RHd, gate = q_gate[..., : self.hd], q_gate[..., self.hd :].reshape(R, -1)
        q_RHd = self.q_norm(q_RHd)
        k_RHd = self.k_norm(self.k_proj(x_RD).view(R, self.Hkv, self.hd))
        v_RHd = self.v_proj(x_RD).view(R, self.Hkv, self.hd)
        cos, sin = rope_cos_sin(layout.depth, self.rotary_dim, self.theta, x_RD.dtype)
        q_RHd, k_RHd = apply_rope(q_RHd, cos, sin), apply_rope(k_RHd, cos, sin)
        k_NHd = bd.table(name + "attn_k", k_RHd, ATTN)
        v_NHd = bd.table(name + "attn_v", v_RHd, ATTN)
        o_RHd = attention_backend(run.attention_backend)(q_RHd, k_NHd, v_NHd, layout.attention, self.hd**-0.5)
        o_RD = o_RHd.reshape(R, -1) * sigmoid(gate)
        return self.o_proj(o_RD)


def rope_cos_sin(depth_R: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, rotary_dim] cos/sin at each row's depth (the RoPE position), computed in `compute_dtype(dtype)`."""
    cdt = compute_dtype(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=depth_R.device).to(cdt) / rotary_dim))
    freqs = depth_R[:, None].to(cdt) * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_RHd: torch.Tensor, cos_Rr: torch.Tensor, sin_Rr: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head (rotate-half convention)."""
    rd = cos_Rr.shape[-1]
    x_rot, x_pass = x_RHd[..., :rd], x_RHd[..., rd:]
    half = rd // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    x_rot = x_rot * cos_Rr[:, None, :] + rotated * sin_Rr[:, None, :]
    return torch.cat([x_rot, x_pass], dim=-1)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, D: int, inner: int):
        super().__init__()
        self.gate_proj = RowLinear(D, inner, bias=False)
        self.up_proj = RowLinear(D, inner, bias=False)
        self.down_proj = RowLinear(inner, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Routed experts stored as 3D tensors (the transformers v5 in-memory layout)."""

    def __init__(self, E: int, D: int, inner: int):
        super().__init__()
        self.num_experts = E
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inner, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, inner))

    def forward(self, x_RD: torch.Tensor, topk_Rk: torch.Tensor, weight_Rk: torch.Tensor) -> torch.Tensor:
        """Routed output [R, D]: the same bits as `forward_ref` with one gather, one weight
        product and one index_add for all experts (assignments sorted by expert, stably, so each
        row still sums its experts' contributions in ascending expert order)."""
        R, k = topk_Rk.shape
        flat_A = topk_Rk.reshape(-1)
        order_A = torch.argsort(flat_A, stable=True)
        counts = torch.bincount(flat_A, minlength=self.num_experts).tolist()  # one host sync
        rows_A = order_A // k
        x_AD = x_RD.index_select(0, rows_A)
        w_A = weight_Rk.reshape(-1).index_select(0, order_A)
        parts, lo = [], 0
        # unbind, not [e]: one node whose backward stacks, where each select's backward would
        # zero-fill a gradient of the whole [E, ...] weight.
        gate_up_E, down_E = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        for e, n in enumerate(counts):
            if n:
                gate, up = row_linear(x_AD[lo : lo + n], gate_up_E[e]).chunk(2, dim=-1)
                parts.append(row_linear(silu(gate) * up, down_E[e]))
            lo += n
        h_AD = torch.cat(parts) * w_A[:, None] if parts else x_AD
        return torch.zeros_like(x_RD).index_add(0, rows_A, h_AD.to(x_RD.dtype))

    def forward_ref(self, x_RD: torch.Tensor, topk_Rk: torch.Tensor, weight_Rk: torch.Tensor) -> torch.Tensor:
        """Plain reference: expert by expert, rows found with torch.where."""
        out_RD = torch.zeros_like(x_RD)
        hit = torch.unique(topk_Rk).tolist()
        for e in hit:
            rows, slot = torch.where(topk_Rk == e)
            gate, up = row_linear(x_RD.index_select(0, rows), self.gate_up_proj[e]).chunk(2, dim=-1)
            h = row_linear(silu(gate) * up, self.down_proj[e]) * weight_Rk[rows, slot, None]
            out_RD = out_RD.index_add(0, rows, h.to(out_RD.dtype))
        return out_RD


class Router(nn.Module):
    """Softmax router with deterministic top-k (no capacity, no token dropping)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))

    def forward(self, x_RD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns (probs [R, E] in `compute_dtype`, top-k weights [R, k], top-k experts [R, k])."""
        probs_RE = torch.softmax(row_linear(x_RD, self.weight), dim=-1, dtype=compute_dtype(x_RD))
        top_w, top_i = torch.topk(probs_RE, self.top_k, dim=-1)
        if self.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs_RE, top_w.to(x_RD.dtype), top_i


class SparseMoe(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = Router(cfg)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = RowLinear(cfg.hidden_size, 1, bias=False)

    def forward(self, x_RD: torch.Tensor, capture: Capture) -> torch.Tensor:
        probs_RE, top_w, top_i = self.gate(x_RD)
        capture.router_probs[self.layer_idx] = probs_RE
        capture.router_topk[self.layer_idx] = top_i
        out = self.experts(x_RD, top_i, top_w)
        if self.has_shared:
            out = out + sigmoid(self.shared_expert_gate(x_RD)) * self.shared_expert(x_RD)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] != FULL
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = SparseMoe(cfg, layer_idx) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x_RD, layout, run, capture):
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x_RD + mixer(self.input_layernorm(x_RD), layout, run, capture)
        y = self.post_attention_layernorm(h)
        y = self.mlp(y, capture) if self.is_moe else self.mlp(y)
        return h + y


@dataclass(slots=True, kw_only=True)
class RunOptions:
    """How the sequence-coupled operators run."""

    linear_fn: object
    """chunk_gated_delta_rule-compatible callable (the kernel backend)."""
    chunk_size: int = 64
    """Linear-attention chunk size C; must equal the plan's."""
    attention_backend: str = "blocked"
    """Tree-attention backend (`kernels.tree_attention.BACKENDS`): "blocked" (exact blocked, bitwise
    batch-invariant on the CPU), "triton" (GPU), "ref" (plain reference)."""


class Backbone(nn.Module):
    """Embedding, decoder layers and the final norm (HF `model.*`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForRL(nn.Module):
    """The hybrid decoder plus lm head; `forward` runs a layout's rows and returns a `ModelOutput`
    (the final normed hidden states, the logits of the requested rows, MoE routing, window exports)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = RowLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the lm head share the embedding matrix when the config ties them (one Parameter)."""
        if self.config.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int) -> None:
        """Seeded random initialisation with transformers' Qwen3-Next scheme (`trainer.models.init`:
        the same weights as any sharded initialisation from `seed`)."""
        from trainer.models.init import init_rows

        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(init_rows(name, tuple(p.shape), slice(None), seed=seed, cfg=self.config))

    def forward(self, layout, run: RunOptions, imports: Mapping[str, torch.Tensor] | None = None, *,
                logit_rows: torch.Tensor | None = None, capture_linear: bool = False) -> ModelOutput:
        """One microbatch forward over the layout's rows; no effect outside the returned value.

        Args:
            layout: the microbatch's `RowLayout`.
            run: kernel options.
            imports: sharing-window imports by name, None without windows; under FSDP2 a
                `trainer.boundary.Imports` (a mapping FSDP2 does not look into: see there).
            logit_rows: long [U] rows whose logits to compute (inside the forward, so that a
                sharded wrapper holds the head's weights while it runs); see ModelOutput.logits.
            capture_linear: also return every linear-attention layer's outputs (verification).
        """
        capture = Capture(boundary=Boundary(layout.window, imports), linear_outputs=capture_linear)
        x = self.model.embed_tokens(layout.tokens)
        for layer in self.model.layers:
            x = layer(x, layout, run, capture)
        h_RD = self.model.norm(x)
        logits = None
        if logit_rows is not None:
            pad = (-logit_rows.shape[0]) % ROW_TILE
            rows_U = torch.cat([logit_rows, logit_rows[-1:].expand(pad)]) if pad else logit_rows
            logits = self.lm_head(h_RD.index_select(0, rows_U))
        return ModelOutput(hidden=h_RD, logits=logits, router_probs=capture.router_probs, router_topk=capture.router_topk,
                           linear=capture.linear, exports=capture.boundary.exports)

    def logits(self, h_RD: torch.Tensor) -> torch.Tensor:
        """lm head of hidden states (outside a forward: tests and single-process tools)."""
        return self.lm_head(h_RD)
