"""Qwen3-Next-style hybrid decoder over packed rows: the arithmetic of transformers' `models/qwen3_next`.

    model = Qwen3NextForRL(debugmodel())
    out = model(layout, RunOptions(linear_fn=kernel_backend("ref")), imports, logprobs=True)  # ModelOutput; pure

Per-token operators run once per packed row of a `trainer.layout.RowLayout`; the sequence-coupled
ones go through its ancestry and call schedule (`trainer.tree_ops`). Parameter names are the
Hugging Face module names. Primitives (`RunOptions.ops`), checkpointing (`RunOptions.checkpointing`)
and dtypes: docs/design/execution.md ("The model over packed rows"), docs/design/numerics.md.
Legend: R rows, D hidden, H heads, Hk/Hv linear key/value heads, Kd/Vd linear head dims,
hd attention head dim, E experts, k top-k, C conv channels, K conv kernel, V vocab.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from plan.window_exports import ATTN, CONV, KERNEL
from trainer import tree_ops
from trainer.boundary import Boundary
from kernels.dtypes import compute_dtype
from kernels.tree_attention import attention_backend
from trainer.models.config import FULL, ModelConfig
from trainer.models.head import DEFAULT_CHUNK, chunked_logprobs, full_logprobs
from trainer.models.moe import Experts, Router, combine, dispatch_rows, route
from trainer.models.ops import EXACT, ROW_TILE, Ops, row_linear

CHECKPOINTING = ("none", "full", "selective")
HEADS = ("full", "chunked")


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: `x_hat * (1 + w)`, computed in at least fp32 (`compute_dtype`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, ops: Ops = EXACT) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, eps=self.eps, zero_centered=True)


class GatedRMSNorm(nn.Module):
    """RMSNorm (plain weight) followed by a `silu(z)` gate, per value head (norm and gate in at
    least fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor, ops: Ops = EXACT) -> torch.Tensor:
        return ops.gated_norm(x, z, self.weight, eps=self.eps)


@dataclass(slots=True, kw_only=True)
class ModelOutput:
    """What a microbatch forward returns (nothing else changes: the forward can be re-run)."""

    hidden: torch.Tensor
    """[R, D] final (normed) hidden states."""
    logprob: torch.Tensor | None
    """[P] log-probs of the layout's log-prob entries in at least fp32, with graph; None when the
    forward was asked for none."""
    entropy: torch.Tensor | None
    """[P] entropies of those entries (only when asked)."""
    router_probs: dict[int, torch.Tensor]
    """MoE layer -> [R, E] router softmax (with graph)."""
    router_topk: dict[int, torch.Tensor]
    """MoE layer -> [R, k] selected experts, ascending per row."""
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
        self.in_proj_qkvz = nn.Linear(D, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(D, 2 * self.Hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=False, padding=self.K - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.empty(self.Hv).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.Vd, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, D, bias=False)

    def forward(self, x_RD: torch.Tensor, layout, run: "RunOptions", bd: Boundary) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [R, D], kernel output [R, Hv, Vd])."""
        ops = run.ops
        R = x_RD.shape[0]
        r = self.Hv // self.Hk
        name = f"{self.layer_idx}."
        qkvz = ops.linear(x_RD, self.in_proj_qkvz.weight).view(R, self.Hk, 2 * self.Kd + 2 * r * self.Vd)
        q, k, v, z = torch.split(qkvz, [self.Kd, self.Kd, r * self.Vd, r * self.Vd], dim=-1)
        b, a = torch.split(ops.linear(x_RD, self.in_proj_ba.weight).view(R, self.Hk, 2 * r), [r, r], dim=-1)
        mixed_RC = torch.cat([q.reshape(R, -1), k.reshape(R, -1), v.reshape(R, -1)], dim=-1)
        mixed_NC = bd.table(name + "conv", mixed_RC, CONV)
        mixed_RC = ops.silu(tree_ops.ancestry_conv(mixed_NC, self.conv1d.weight[:, 0, :], layout.conv_src))
        key_dim = self.Hk * self.Kd
        q_RHK, k_RHK, v_RHV = torch.split(mixed_RC, [key_dim, key_dim, self.Hv * self.Vd], dim=-1)
        beta_RH, g_RH = ops.gdn_gates(b.reshape(R, self.Hv), a.reshape(R, self.Hv), self.A_log, self.dt_bias)
        o_RHV, states = tree_ops.linear_attention(
            bd.table(name + "q", q_RHK.reshape(R, self.Hk, self.Kd), KERNEL),
            bd.table(name + "k", k_RHK.reshape(R, self.Hk, self.Kd), KERNEL),
            bd.table(name + "v", v_RHV.reshape(R, self.Hv, self.Vd), KERNEL),
            bd.table(name + "g", g_RH, KERNEL), bd.table(name + "beta", beta_RH, KERNEL),
            layout.linear_calls, layout.row_from_kept, layout.num_states, fn=run.linear_fn,
            chunk_size=run.chunk_size, imported_states=bd.states(name + "state"),
        )
        bd.export_states(name + "state", states)
        y_RHV = self.norm(o_RHV, z.reshape(R, self.Hv, self.Vd), ops)
        return ops.linear(y_RHV.reshape(R, -1), self.out_proj.weight), o_RHV


class Attention(nn.Module):
    """Gated softmax attention with q/k RMSNorm, partial RoPE at each row's depth and GQA."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.H, self.Hkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(D, self.H * self.hd * 2, bias=bias)
        self.k_proj = nn.Linear(D, self.Hkv * self.hd, bias=bias)
        self.v_proj = nn.Linear(D, self.Hkv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.H * self.hd, D, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.rotary_dim = cfg.rotary_dim
        self.theta = cfg.rope_theta

    def forward(self, x_RD: torch.Tensor, layout, run: "RunOptions", bd: Boundary) -> tuple[torch.Tensor, None]:
        ops = run.ops
        R = x_RD.shape[0]
        name = f"{self.layer_idx}."
        q_gate = _proj(ops, x_RD, self.q_proj).view(R, self.H, 2 * self.hd)
        q_RHd, gate = q_gate[..., : self.hd], q_gate[..., self.hd :].reshape(R, -1)
        q_RHd = self.q_norm(q_RHd, ops)
        k_RHd = self.k_norm(_proj(ops, x_RD, self.k_proj).view(R, self.Hkv, self.hd), ops)
        v_RHd = _proj(ops, x_RD, self.v_proj).view(R, self.Hkv, self.hd)
        cos, sin = rope_cos_sin(layout.depth, self.rotary_dim, self.theta, x_RD.dtype)
        q_RHd, k_RHd = ops.rope(q_RHd, cos, sin), ops.rope(k_RHd, cos, sin)
        k_NHd = bd.table(name + "attn_k", k_RHd, ATTN)
        v_NHd = bd.table(name + "attn_v", v_RHd, ATTN)
        o_RHd = attention_backend(run.attention_backend)(q_RHd, k_NHd, v_NHd, layout.attention, self.hd**-0.5)
        o_RD = ops.sigmoid_mul(gate, o_RHd.reshape(R, -1))
        return _proj(ops, o_RD, self.o_proj), None


def _proj(ops: Ops, x: torch.Tensor, lin: nn.Linear) -> torch.Tensor:
    return ops.linear(x, lin.weight, lin.bias)


def rope_cos_sin(depth_R: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, rotary_dim] cos/sin at each row's depth (the RoPE position), computed in `compute_dtype(dtype)`."""
    cdt = compute_dtype(dtype)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=depth_R.device).to(cdt) / rotary_dim))
    freqs = depth_R[:, None].to(cdt) * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, D: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(D, inner, bias=False)
        self.up_proj = nn.Linear(D, inner, bias=False)
        self.down_proj = nn.Linear(inner, D, bias=False)

    def forward(self, x: torch.Tensor, ops: Ops = EXACT) -> torch.Tensor:
        gate = ops.linear(x, self.gate_proj.weight)
        return ops.linear(ops.swiglu(gate, ops.linear(x, self.up_proj.weight)), self.down_proj.weight)


class SparseMoe(nn.Module):
    """Routed experts (`trainer.models.moe`) plus a sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = Router(cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x_RD: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output [R, D], router probabilities [R, E], selected experts [R, k])."""
        probs_RE, w_Rk, e_Rk = self.gate(x_RD, ops)
        # with expert parallelism the rows travel sorted by expert, unpadded (trainer.expert_parallel)
        d = route(e_Rk, self.experts.num_experts, align=1 if self.experts.expert_parallel else ops.group_align)
        y_SD = self.experts(dispatch_rows(x_RD, d), d, ops)
        out = combine(y_SD, w_Rk, d, chained=ops.invariant)
        if self.has_shared:
            out = out + ops.sigmoid_mul(ops.linear(x_RD, self.shared_expert_gate.weight), self.shared_expert(x_RD, ops))
        return out, probs_RE, e_Rk


class DecoderLayer(nn.Module):
    """One block: token mixer and FFN, each behind an RMSNorm and a residual.

    `forward` returns the block's output and what the model records of it (MoE routing, the
    kernel output, the window exports) instead of writing them anywhere, so that activation
    checkpointing can re-run it in the backward without side effects (`RunOptions.checkpointing`).
    """

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

    def forward(self, x_RD: torch.Tensor, layout, run: "RunOptions", bd: Boundary):
        """(output [R, D], router probs or None, router top-k or None, exports {name: tensor},
        kernel output [R, Hv, Vd] or None)."""
        if run.checkpointing == "full":
            return checkpoint(self._block, x_RD, layout, run, bd, use_reentrant=False, preserve_rng_state=False)
        return self._block(x_RD, layout, run, bd)

    def _block(self, x_RD, layout, run, bd):
        io = bd.scope()
        mixer = self.linear_attn if self.is_linear else self.self_attn
        mixed, kernel_out = mixer(self.input_layernorm(x_RD, run.ops), layout, run, io)
        h = x_RD + mixed
        if run.checkpointing == "selective":
            y, probs, topk = checkpoint(self._ffn, h, run.ops, use_reentrant=False, preserve_rng_state=False)
        else:
            y, probs, topk = self._ffn(h, run.ops)
        return h + y, probs, topk, io.exports, kernel_out

    def _ffn(self, h_RD: torch.Tensor, ops: Ops):
        y = self.post_attention_layernorm(h_RD, ops)
        if self.is_moe:
            return self.mlp(y, ops)
        return self.mlp(y, ops), None, None


@dataclass(slots=True, kw_only=True)
class RunOptions:
    """How a forward runs: kernels, arithmetic primitives, activation checkpointing, the head."""

    linear_fn: object
    """chunk_gated_delta_rule-compatible callable (the kernel backend)."""
    chunk_size: int = 64
    """Linear-attention chunk size C; must equal the plan's."""
    attention_backend: str = "blocked"
    """Tree-attention backend (`kernels.tree_attention.BACKENDS`): "blocked" (exact blocked, bitwise
    batch-invariant on the CPU), "triton" (GPU), "ref" (plain reference)."""
    ops: Ops = EXACT
    """The arithmetic primitives (`trainer.models.ops`: EXACT on the CPU, FAST or INVARIANT on CUDA)."""
    checkpointing: str = "none"
    """Activation checkpointing per decoder block: "none"; "full" (keep each block's input, re-run
    the block in the backward); "selective" (keep the token mixer's activations, re-run the FFN:
    post-attention norm and MoE/MLP, whose saved activations grow with top-k)."""
    head: str = "full"
    """"full": logits [U, V] of the log-prob rows, then logsumexp (the CPU's exact path);
    "chunked": `trainer.models.head.chunked_logprobs`, never a [U, V] tensor (the GPU's)."""
    head_chunk: int = DEFAULT_CHUNK
    """Vocabulary columns per step of the chunked head."""

    def __post_init__(self) -> None:
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(f"checkpointing: expected one of {CHECKPOINTING}, got {self.checkpointing!r}")
        if self.head not in HEADS:
            raise ValueError(f"head: expected one of {HEADS}, got {self.head!r}")


class Backbone(nn.Module):
    """Embedding, decoder layers and the final norm (HF `model.*`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextForRL(nn.Module):
    """The hybrid decoder plus lm head; `forward` runs a layout's rows and returns a `ModelOutput`
    (the final normed hidden states, the log-probs of the layout's entries, MoE routing, window exports)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
                logprobs: bool = False, entropy: bool = False, capture_linear: bool = False) -> ModelOutput:
        """One microbatch forward over the layout's rows; no effect outside the returned value.

        Args:
            layout: the microbatch's `RowLayout`.
            run: kernels, primitives, checkpointing and head.
            imports: sharing-window imports by name, None without windows; under FSDP2 a
                `trainer.boundary.Imports` (a mapping FSDP2 does not look into: see there).
            logprobs: compute the log-probs of the layout's log-prob entries (inside the forward,
                so that a sharded wrapper holds the head's weights while it runs).
            entropy: with logprobs, their entropies too.
            capture_linear: also return every linear-attention layer's outputs (verification).
        """
        bd = Boundary(layout.window, imports)
        probs, topk, linear = {}, {}, {}
        x = self.model.embed_tokens(layout.tokens)
        for i, layer in enumerate(self.model.layers):
            x, p, t, exports, kernel_out = layer(x, layout, run, bd)
            bd.exports.update(exports)
            if p is not None:
                probs[i], topk[i] = p, t
            if capture_linear and kernel_out is not None:
                linear[i] = kernel_out.detach()
        h_RD = self.model.norm(x, run.ops)
        lp = ent = None
        if logprobs:
            lp, ent = self.head_logprobs(h_RD, layout.logprobs, run, entropy=entropy)
        return ModelOutput(hidden=h_RD, logprob=lp, entropy=ent, router_probs=probs, router_topk=topk, linear=linear,
                           exports=bd.exports)

    def head_logprobs(self, h_RD: torch.Tensor, lp, run: RunOptions, *, entropy: bool):
        """Log-probs (and entropies) [P] of the log-prob map `lp` (`trainer.layout.LogprobMap`)."""
        rows_U = lp.rows_U
        if run.head == "chunked":
            return chunked_logprobs(h_RD.index_select(0, rows_U), self.lm_head.weight, lp.inv_P, lp.label,
                                    chunk=run.head_chunk, entropy=entropy)
        # One whole-tile GEMM: U rows padded with copies of the last one (its output is the GEMM's own
        # tensor, not a view: FSDP2 warns that a view returned by a sharded module can lose its
        # pre-backward hook to an in-place op).
        pad = (-rows_U.shape[0]) % ROW_TILE
        rows = torch.cat([rows_U, rows_U[-1:].expand(pad)]) if pad else rows_U
        logits_UV = _proj(run.ops, h_RD.index_select(0, rows), self.lm_head)
        return full_logprobs(logits_UV, lp.inv_P, lp.label, entropy=entropy, logsumexp=run.ops.logsumexp)

    def logits(self, h_RD: torch.Tensor) -> torch.Tensor:
        """lm head of hidden states (outside a forward: tests and single-process tools)."""
        return row_linear(h_RD, self.lm_head.weight)
