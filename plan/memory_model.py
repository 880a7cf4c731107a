"""The memory model of sharing windows: what an open window keeps, in bytes (docs/design/windows.md).

    sizes = RowSizes.of(ModelDims.default(), "bfloat16", checkpointing="full", head="chunked")
    sizes.full_bytes(rows); sizes.kept_bytes(rows)                      # running; an open window
    sizes.export_bytes(attn_rows, conv_rows, kernel_rows, states)       # a recomputed window
    live, peak = rank_live_bytes(sizes, arrays_by_id, steps)            # a rank's live stack, per step

One module, three users: the partitioner's estimate (`planner_service.planner.memory_fit`), the
builder's `PlanStats.peak_live_bytes` and the validator's check; the trainer keeps exactly what is
counted here. Legend: D hidden, V vocab, H/Hkv attention query/key-value heads, hd head dim, Hk/Hv
linear key/value heads, Kd/Vd linear head dims, K conv kernel, C chunk size, I dense MLP width,
E experts, k top-k, Ie/Is routed/shared expert width, e element bytes of the model dtype, f = 4.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

from plan.microbatch import MicrobatchArrays
from plan.named_models import qwen3_next_80b_a3b
from plan.window_exports import ATTN, CONV, KERNEL, export_needs

LINEAR = "linear_attention"
FULL = "full_attention"

#: bytes per element of the model dtypes the trainer runs.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
#: activation checkpointing of the decoder blocks (`parallelism.activation_checkpointing`): none, every
#: block, or the FFN sub-block only (`checkpointed_bytes_per_row`)
CHECKPOINTING = ("none", "full", "selective")
#: the lm head: "full" fp32 logits [rows, V] (the CPU path), "chunked" (the GPU path: no logits kept)
HEADS = ("full", "chunked")


#: [low, high] of every integer `ModelDims.from_hf_config` reads, checked before anything is built.
#: Far above the published hybrid and large models (Qwen3-Next-80B-A3B: 48 layers, hidden 2048, 512
#: experts; `plan.named_models.hybrid_moe_124b`: 60 layers, hidden 2560; Llama-3.1-405B: 126 layers,
#: hidden 16384, 128 heads, MLP 53248; Gemma 3: vocabulary 262,144) and far below what exhausts the
#: planner (a 930-byte document with 10^7 layers held it for 271 s at 13.9 GB).
HF_CONFIG_BOUNDS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, 1024),
    "full_attention_interval": (1, 1024),
    "decoder_sparse_step": (1, 1024),
    "hidden_size": (1, 1 << 16),
    "vocab_size": (1, 1 << 22),
    "num_attention_heads": (0, 1024),
    "num_key_value_heads": (0, 1024),
    "head_dim": (0, 1024),
    "linear_num_key_heads": (0, 1024),
    "linear_num_value_heads": (0, 1024),
    "linear_key_head_dim": (0, 1024),
    "linear_value_head_dim": (0, 1024),
    "linear_conv_kernel_dim": (1, 64),
    "intermediate_size": (0, 1 << 18),
    "num_experts": (0, 4096),
    "num_experts_per_tok": (0, 4096),
    "moe_intermediate_size": (0, 1 << 18),
    "shared_expert_intermediate_size": (0, 1 << 18),
}


def _shown(v) -> str:
    """A value for an error message, at most 80 characters (an integer of 10^400 included)."""
    if isinstance(v, int) and v.bit_length() > 200:
        return f"an integer of about {int(v.bit_length() * 0.30103) + 1} digits"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(slots=True, kw_only=True, frozen=True)
class ModelDims:
    """The dimensions of a Qwen3-Next-style hybrid model that decide activation sizes.

    Field names and defaults are those of Hugging Face `Qwen3NextConfig` (`config.json` keys).
    """

    hidden_size: int
    """Residual width D."""
    layer_types: tuple[str, ...]
    """Per layer: "linear_attention" (Gated DeltaNet) or "full_attention" (gated softmax attention)."""
    vocab_size: int
    """Vocabulary size V (logits rows)."""
    num_attention_heads: int
    """Query heads H of the full-attention layers."""
    num_key_value_heads: int
    """Key/value heads Hkv of the full-attention layers."""
    head_dim: int
    """Head dimension hd of the full-attention layers."""
    rotary_dim: int
    """Dimensions RoPE rotates (head_dim x partial_rotary_factor)."""
    linear_num_key_heads: int
    """Gated DeltaNet key heads Hk."""
    linear_num_value_heads: int
    """Gated DeltaNet value heads Hv."""
    linear_key_head_dim: int
    """Gated DeltaNet key head dimension Kd."""
    linear_value_head_dim: int
    """Gated DeltaNet value head dimension Vd."""
    linear_conv_kernel_dim: int
    """Short-convolution kernel size K."""
    intermediate_size: int
    """Dense MLP width I."""
    num_experts: int
    """Routed experts E (0: every layer dense)."""
    num_experts_per_tok: int
    """Top-k."""
    moe_intermediate_size: int
    """Routed expert width Ie."""
    shared_expert_intermediate_size: int
    """Shared expert width Is (0: none)."""
    moe_layers: tuple[bool, ...] = field(default=())
    """Per layer: True for a MoE FFN, False for a dense MLP (empty: derived from num_experts)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and v < 0:
                raise ValueError(f"{f.name}: expected >= 0, got {v}")
        for name in ("hidden_size", "vocab_size", "linear_conv_kernel_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        for i, t in enumerate(self.layer_types):
            if t not in (LINEAR, FULL):
                raise ValueError(f"layer_types[{i}]: expected {LINEAR!r} or {FULL!r}, got {t!r}")
        if not self.layer_types:
            raise ValueError("layer_types: expected at least one layer, got none")
        if not self.moe_layers:
            object.__setattr__(self, "moe_layers", tuple(self.num_experts > 0 for _ in self.layer_types))
        if len(self.moe_layers) != len(self.layer_types):
            raise ValueError(f"moe_layers: expected {len(self.layer_types)} entries, got {len(self.moe_layers)}")

    @property
    def num_full(self) -> int:
        return sum(t == FULL for t in self.layer_types)

    @property
    def num_linear(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    @classmethod
    def from_hf_config(cls, d: dict) -> "ModelDims":
        """Read the fields above from a Qwen3-Next `config.json` dict (missing keys take the
        Hugging Face defaults; `layer_types` falls back to `full_attention_interval`, MoE layers to
        `decoder_sparse_step` and `mlp_only_layers`, as in `Qwen3NextConfig`).

        Every size is checked against `HF_CONFIG_BOUNDS` before anything is built, so that a
        document of a few bytes cannot make the caller build per-layer lists of 10^7 entries.

        Raises:
            ValueError: not a dict, a missing or malformed key, or a value outside its bound,
                naming the key ("model config <key>: expected ...").
        """
        if not isinstance(d, dict):
            raise ValueError(f"model config: expected a config.json object, got {type(d).__name__}")

        def num(key: str, default=None) -> int:
            v = d.get(key, default)
            if v is None:
                raise ValueError(f"model config {key}: expected an integer, got none")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
                raise ValueError(f"model config {key}: expected an integer, got {_shown(v)}")
            lo, hi = HF_CONFIG_BOUNDS[key]
            if not lo <= v <= hi:
                raise ValueError(f"model config {key}: expected an integer in [{lo}, {hi}], got {_shown(v)}")
            return int(v)

        n_layers = num("num_hidden_layers")
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = num("full_attention_interval", 4)
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers:
            got = f"{len(layer_types)} entries" if isinstance(layer_types, list) else _shown(layer_types)
            raise ValueError(f"model config layer_types: expected a list of {n_layers} layer types, got {got}")
        heads = num("num_attention_heads")
        head_dim = num("head_dim", num("hidden_size") // max(heads, 1))
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1.0
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor <= 1:
            raise ValueError(f"model config partial_rotary_factor: expected a number in [0, 1], got {_shown(factor)}")
        experts = num("num_experts", 0)
        top_k = num("num_experts_per_tok", 0) if experts else 0
        if top_k > experts:
            raise ValueError(f"model config num_experts_per_tok: expected at most num_experts ({experts}), got {top_k}")
        step = num("decoder_sparse_step", 1)
        mlp_only = d.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in mlp_only):
            raise ValueError(f"model config mlp_only_layers: expected a list of layer indices in [0, {n_layers}), "
                             f"got {_shown(mlp_only)}")
        mlp_only = set(mlp_only)
        return cls(
            hidden_size=num("hidden_size"), layer_types=tuple(layer_types), vocab_size=num("vocab_size"),
            num_attention_heads=heads, num_key_value_heads=num("num_key_value_heads", heads), head_dim=head_dim,
            rotary_dim=int(head_dim * factor),
            linear_num_key_heads=num("linear_num_key_heads", 16), linear_num_value_heads=num("linear_num_value_heads", 32),
            linear_key_head_dim=num("linear_key_head_dim", 128), linear_value_head_dim=num("linear_value_head_dim", 128),
            linear_conv_kernel_dim=num("linear_conv_kernel_dim", 4), intermediate_size=num("intermediate_size", 0),
            num_experts=experts, num_experts_per_tok=top_k,
            moe_intermediate_size=num("moe_intermediate_size", 0) if experts else 0,
            shared_expert_intermediate_size=num("shared_expert_intermediate_size", 0) if experts else 0,
            moe_layers=tuple(experts > 0 and i not in mlp_only and (i + 1) % step == 0 for i in range(n_layers)),
        )

    @classmethod
    def default(cls) -> "ModelDims":
        """Qwen3-Next-80B-A3B (the published `config.json`, `plan.named_models`): 48 layers, 3 Gated
        DeltaNet per gated attention layer, D = 2048, 512 experts top-10; the model class HARTS targets."""
        return cls.from_hf_config(qwen3_next_80b_a3b())


def _layer_parts(dims: ModelDims, dtype: str, chunk_size: int):
    """Per decoder layer, before MEASURED_FACTOR: (one RMSNorm over D, token-mixer component,
    its bytes, FFN component, its bytes) per computed row (`saved_bytes_per_row` derives them)."""
    e = DTYPE_BYTES[dtype]
    f = 4.0
    D = dims.hidden_size
    H, Hkv, hd, rd = dims.num_attention_heads, dims.num_key_value_heads, dims.head_dim, dims.rotary_dim
    Hk, Hv, Kd, Vd = dims.linear_num_key_heads, dims.linear_num_value_heads, dims.linear_key_head_dim, dims.linear_value_head_dim
    conv = 2 * Hk * Kd + Hv * Vd
    norm = _norm_bytes(D, e)
    for i, kind in enumerate(dims.layer_types):
        if dims.moe_layers[i]:
            k, Ie, Is = dims.num_experts_per_tok, dims.moe_intermediate_size, dims.shared_expert_intermediate_size
            ffn = "moe", dims.num_experts * f + 2 * k * f + k * (2 * D + 6 * Ie) * e + (6 * Is * e + D * e + 4 * e if Is else 0)
        else:
            ffn = "mlp", 6 * dims.intermediate_size * e
        if kind == LINEAR:
            mixer = LINEAR, (
                (dims.linear_conv_kernel_dim + 4) * conv * e + 2 * Hv * Kd * e + 8 * Hv * f
                + Hv * chunk_size * f + Hv * Kd * Vd * f / chunk_size
                + Hv * Vd * e + 3 * Hv * Vd * f + 3 * Hv * Vd * e + Hv * f + 3 * Hv * Vd * f
            )
        else:
            mixer = FULL, (
                (H + Hkv) * (hd * (2 * f + e) + f)  # q/k RMSNorms
                + Hkv * hd * e  # v
                + (H + Hkv) * rd * e + 2 * rd * e  # rotate-half terms, cos/sin
                + (H + Hkv) * hd * e  # rotated q, k
                + H * hd * e + H * f  # output and log-sum-exp
                + 3 * H * hd * e  # gate, exp, sigmoid
                + H * hd * e  # gated product (o_proj input)
            )
        yield norm, *mixer, *ffn


def _norm_bytes(n: int, e: int) -> float:
    """An RMSNorm over width n: its input and the normalised value in fp32, the rsqrt, its output
    in the model dtype (saved by the next projection)."""
    return n * (2 * 4.0 + e) + 4.0


def _head_bytes(dims: ModelDims, dtype: str, head: str) -> float:
    """The final norm and the lm head per row (see `saved_bytes_per_row`)."""
    if head not in HEADS:
        raise ValueError(f"head: expected one of {', '.join(HEADS)}, got {head!r}")
    return _norm_bytes(dims.hidden_size, DTYPE_BYTES[dtype]) + (dims.vocab_size * 4.0 if head == "full" else 2 * 4.0)


#: component names of the mixers in `saved_bytes_per_row`
_MIXER = {LINEAR: "linear_attention", FULL: "attention"}


def _row_extras(head: str) -> int:
    """Small per-row tensors outside the decoder blocks that `saved_bytes_per_row` leaves to
    MEASURED_FACTOR's slack (so that plans without checkpointing keep their bytes): the embedding's
    int64 token id, the lm head's int64 row index, the log-prob entry's int64 row and label (about
    one entry per row) and, with the full head, the loss's fp32 log-sum-exp (the chunked head
    counts its own). Counted under checkpointing, where a row keeps little else."""
    return 8 + 8 + 16 + (4 if head == "full" else 0)


def saved_bytes_per_row(dims: ModelDims, dtype: str = "float32", chunk_size: int = 64, head: str = "full") -> dict[str, float]:
    """Bytes autograd keeps per computed row for the backward of one microbatch, by component.

    Derived from `trainer/models/qwen3_next.py` (a tensor counted once however many ops save it;
    e = element bytes of `dtype`, f = 4 for the values computed in at least fp32):
    - every RMSNorm over width n: its input and the normalised value in fp32, the rsqrt, its
      output in the model dtype (saved by the next projection): n(2f + e) + f;
    - dense MLP: gate and up outputs, exp(-gate) and 1 + exp(-gate) of the silu, silu(gate), the
      product fed to down_proj: 6 I e;
    - MoE FFN: router softmax (E f), top-k weights (2k f), per selected expert the gathered input,
      the six tensors of its SwiGLU and its output (k (2D + 6 Ie) e), shared expert 6 Is e plus
      its sigmoid gate and output (D e + 4 e);
    - Gated DeltaNet: the K conv taps (gathered ancestor rows and the row itself), the three
      tensors of the silu after the conv and its output ((K + 4) conv e, conv = 2 Hk Kd + Hv Vd),
      q and k repeated to Hv heads (2 Hv Kd e), g, beta and their softplus/sigmoid intermediates
      (8 Hv f), the fused kernel's WY blocks (Hv C f) and chunk states (Hv Kd Vd f / C), the
      kernel output, the gated RMSNorm (3 Hv Vd f + 3 Hv Vd e + Hv f) and silu(z) (3 Hv Vd f);
    - gated attention: q and k RMSNorms over hd per head, v, the RoPE rotate-half terms, the
      rotated q and k, the output with its log-sum-exp (flash style), the sigmoid gate (three
      tensors) and the gated product fed to o_proj;
    - the final norm and the lm head: `head="full"` (the CPU path) keeps the logits in fp32 (V f);
      `head="chunked"` (the GPU path, which never builds [rows, V] logits) keeps its input (the
      final norm's output, counted with the norm) and two fp32 scalars per row, the log-sum-exp
      and an entropy term (2 f). An upper bound either way: only rows with a log-prob entry
      reach the head.

    Args:
        dims: the model.
        dtype: the trainer's parameter/activation dtype (DTYPE_BYTES).
        chunk_size: linear-attention chunk size C (the kernel's chunk states and WY blocks).
        head: "full" or "chunked" (HEADS).

    Returns:
        component -> bytes per row ("norms", "mlp", "moe", "linear_attention", "attention", "head");
        `sum(...)` is the per-row activation size without activation checkpointing.
    """
    out = {"norms": 0.0, "mlp": 0.0, "moe": 0.0, "linear_attention": 0.0, "attention": 0.0, "head": 0.0}
    for norm, mixer, mixer_bytes, ffn, ffn_bytes in _layer_parts(dims, dtype, chunk_size):
        out["norms"] += 2 * norm
        out[_MIXER[mixer]] += mixer_bytes
        out[ffn] += ffn_bytes
    out["head"] = _head_bytes(dims, dtype, head)
    return {k: v * MEASURED_FACTOR[k] for k, v in out.items()}


def layer_bytes_per_row(dims: ModelDims, dtype: str = "float32", chunk_size: int = 64) -> list[dict[str, float]]:
    """Per decoder layer, the bytes `saved_bytes_per_row` counts (MEASURED_FACTOR applied), split
    the way activation checkpointing splits a block: "input_norm", "mixer" (Gated DeltaNet or
    gated attention), "post_norm" (the post-attention norm) and "ffn" (MoE or dense MLP).
    Summed over layers they are `saved_bytes_per_row` less its "head"."""
    F = MEASURED_FACTOR
    return [{"input_norm": norm * F["norms"], "mixer": mb * F[_MIXER[mixer]], "post_norm": norm * F["norms"],
             "ffn": fb * F[ffn]} for norm, mixer, mb, ffn, fb in _layer_parts(dims, dtype, chunk_size)]


def checkpointed_bytes_per_row(dims: ModelDims, dtype: str = "float32", chunk_size: int = 64, *,
                               checkpointing: str = "none", head: str = "full") -> tuple[float, float]:
    """(kept, transient) bytes per computed row under an activation-checkpointing mode.

    kept: what a row holds from its forward to its backward (a running microbatch, or an open
    window that is not recomputed); transient: what the running microbatch holds on top while its
    backward recomputes one checkpointed sub-block. With L_i = `layer_bytes_per_row` of layer i
    (input_norm + mixer + post_norm + ffn), head = the final norm and lm head, and D e one
    [rows, D] tensor in the compute dtype:

    - "none":      kept = sum_i L_i + head                                     transient = 0
    - "full":      kept = layers x D e + head + x (each block keeps its input)  transient = max_i L_i
    - "selective": kept = sum_i (input_norm_i + mixer_i + D e) + head + x       transient = max_i (post_norm_i + ffn_i)
                   (the FFN sub-block keeps its input; the token mixer, its kernels and its window
                   exports are never recomputed)

    where x = 16 or 20 bytes of ids and the log-sum-exp (`_row_extras`).

    Raises:
        ValueError: an unknown mode or head.
    """
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"activation_checkpointing: expected one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    head_bytes = _head_bytes(dims, dtype, head) * MEASURED_FACTOR["head"] + _row_extras(head)
    if checkpointing == "none":
        return sum(saved_bytes_per_row(dims, dtype, chunk_size, head).values()), 0.0
    layers = layer_bytes_per_row(dims, dtype, chunk_size)
    block_input = dims.hidden_size * DTYPE_BYTES[dtype]
    if checkpointing == "full":
        return len(layers) * block_input + head_bytes, max(sum(x.values()) for x in layers)
    return (sum(x["input_norm"] + x["mixer"] + block_input for x in layers) + head_bytes,
            max(x["post_norm"] + x["ffn"] for x in layers))


#: measured / derived bytes per row, per component: the derivation above misses intermediates the
#: reference kernels save (the chunked gated delta rule's per-chunk blocks, the experts' gathered
#: rows and products). Measured with saved-tensor hooks on the `tiny` and `small` models
#: (`tests/plan/test_memory_model.py::test_formula_covers_the_measured_activations`): linear attention
#: 1.44 / 1.33, MoE 1.44 / 1.44, attention 1.17 / 1.23, norms and head below the derivation; the
#: larger ratio of the two, rounded up, so that the estimate stays an upper bound.
MEASURED_FACTOR = {"norms": 1.0, "mlp": 1.5, "moe": 1.5, "linear_attention": 1.5, "attention": 1.3, "head": 1.0}


@dataclass(slots=True, kw_only=True, frozen=True)
class RowSizes:
    """Byte sizes the memory model multiplies by row and state counts (PlanParams.memory)."""

    activation_row_bytes: int
    """Activations one computed row keeps from its forward to its backward: a running microbatch
    and an open window that is not recomputed (`checkpointed_bytes_per_row`'s kept bytes; without
    activation checkpointing the full `saved_bytes_per_row`)."""
    attn_row_bytes: int
    """Exported K and V of one ATTN row, summed over the softmax-attention layers."""
    conv_row_bytes: int
    """Exported conv inputs of one CONV row, summed over the linear-attention layers."""
    kernel_row_bytes: int
    """Exported q, k (before the per-value-head repeat), v, g, beta of one KERNEL (replay) row,
    summed over the linear-attention layers."""
    state_bytes: int
    """One exported fp32 state, summed over the linear-attention layers."""
    recompute_row_bytes: int = 0
    """Activation checkpointing: what a running microbatch holds per computed row on top of
    activation_row_bytes while its backward recomputes one checkpointed sub-block (the transient
    of `checkpointed_bytes_per_row`); 0: no checkpointing."""

    def __post_init__(self) -> None:
        if self.activation_row_bytes < 1:
            raise ValueError(f"activation_row_bytes: expected >= 1, got {self.activation_row_bytes}")
        for name in ("attn_row_bytes", "conv_row_bytes", "kernel_row_bytes", "state_bytes", "recompute_row_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")

    @classmethod
    def of(cls, dims: ModelDims, dtype: str = "float32", chunk_size: int = 64, *, checkpointing: str = "none",
           head: str = "full") -> "RowSizes":
        """The sizes of a model (docs/design/windows.md, "Memory accounting"; `checkpointed_bytes_per_row`).

        Raises:
            ValueError: an unknown dtype, checkpointing mode or head.
        """
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        e = DTYPE_BYTES[dtype]
        Hk, Hv, Kd, Vd = dims.linear_num_key_heads, dims.linear_num_value_heads, dims.linear_key_head_dim, dims.linear_value_head_dim
        conv = 2 * Hk * Kd + Hv * Vd
        kept, transient = checkpointed_bytes_per_row(dims, dtype, chunk_size, checkpointing=checkpointing, head=head)
        return cls(
            activation_row_bytes=math.ceil(kept),
            attn_row_bytes=dims.num_full * 2 * dims.num_key_value_heads * dims.head_dim * e,
            conv_row_bytes=dims.num_linear * conv * e,
            kernel_row_bytes=dims.num_linear * (conv * e + 2 * Hv * 4),
            state_bytes=dims.num_linear * Hv * Kd * Vd * 4,
            recompute_row_bytes=math.ceil(transient),
        )

    @classmethod
    def rows(cls) -> "RowSizes":
        """A row-counting profile: every computed row and every ATTN export row is one unit, the
        other exports free (the planner's accounting before it had a memory model; tests)."""
        return cls(activation_row_bytes=1, attn_row_bytes=1, conv_row_bytes=0, kernel_row_bytes=0, state_bytes=0)

    @property
    def row_bytes(self) -> int:
        """Bytes per computed row of the running microbatch: activation_row_bytes +
        recompute_row_bytes. The unit of M (memory_tokens) and of row-equivalents."""
        return self.activation_row_bytes + self.recompute_row_bytes

    def full_bytes(self, rows):
        """Live bytes of a running microbatch of `rows` computed rows (int or int64 array): kept
        plus the recompute transient. The partitioner also bounds an open window that is not
        recomputed by it (`kept_bytes` is exact)."""
        return np.asarray(rows, np.int64) * self.row_bytes if not isinstance(rows, int) else rows * self.row_bytes

    def kept_bytes(self, rows):
        """Live bytes of an open window that is not recomputed (int or int64 array of computed rows)."""
        return np.asarray(rows, np.int64) * self.activation_row_bytes if not isinstance(rows, int) else rows * self.activation_row_bytes

    def export_bytes(self, attn_rows, conv_rows, kernel_rows, states):
        """Live bytes of a recomputed open window: its own exported rows per kind and its states
        (ints or int64 arrays of equal shape)."""
        if all(isinstance(x, int) for x in (attn_rows, conv_rows, kernel_rows, states)):
            return (attn_rows * self.attn_row_bytes + conv_rows * self.conv_row_bytes
                    + kernel_rows * self.kernel_row_bytes + states * self.state_bytes)
        a, c, k, s = (np.asarray(x, np.int64) for x in (attn_rows, conv_rows, kernel_rows, states))
        return a * self.attn_row_bytes + c * self.conv_row_bytes + k * self.kernel_row_bytes + s * self.state_bytes

    def tokens(self, nbytes: int) -> int:
        """Row-equivalents of `nbytes` (rounded up), in rows of a running microbatch: how M is stated."""
        return -(-int(nbytes) // self.row_bytes)

    def fill(self, msg, memory_tokens: int) -> None:
        """Write these sizes and the budget into a `plan_pb2.MemoryModel`."""
        for f in fields(self):
            setattr(msg, f.name, getattr(self, f.name))
        msg.memory_bytes = int(memory_tokens) * self.row_bytes

    @classmethod
    def from_proto(cls, msg) -> "RowSizes":
        """Read a `plan_pb2.MemoryModel` (plans without recompute_row_bytes read as 0: no
        checkpointing). Raises ValueError when it is unset or inconsistent."""
        return cls(**{f.name: int(getattr(msg, f.name)) for f in fields(cls)})


def live_bytes_of(sizes: RowSizes, mb: MicrobatchArrays, local_counts: dict[str, int] | None, num_states: int) -> tuple[int, int]:
    """(bytes while it runs, live bytes as an open window) of one microbatch.

    Args:
        local_counts: `ExportNeeds.local_counts(num_rows)` of the microbatch (None: exports nothing).
        num_states: states it exports (`len(ExportNeeds.states)`).
    """
    rows = int(mb.num_rows) + int(mb.replay_tokens)
    full = sizes.full_bytes(rows)
    if not mb.recompute:
        return full, sizes.kept_bytes(rows)
    c = local_counts or {ATTN: 0, CONV: 0, KERNEL: 0}
    return full, sizes.export_bytes(c[ATTN], c[CONV], c[KERNEL], int(num_states))


def rank_live_bytes(sizes: RowSizes, mbs: dict[int, MicrobatchArrays], steps: list[tuple[bool, int]], *,
                    sent: dict | None = None, remote=(), held=None) -> tuple[list[int], int]:
    """Live bytes of a rank at each of its execution steps, and their maximum.

    Args:
        mbs: the rank's decoded microbatches by id.
        steps: (is_forward, microbatch id) in execution order, properly nested (depth-first).
        sent, remote: windows across ranks (plan.cross_edges), as `export_needs` takes them:
            exporter id -> what importers on other ranks read of it (`sent_needs`; a recomputed
            exporter keeps those exports too), and the (exporter, importer) pairs whose exporter
            is on another rank (`remote_imports`).
        held: int [len(steps)] bytes of received exports the rank holds at each step
            (`plan.cross_edges.held_bytes` at the step's phase); None: none.

    Returns:
        (live bytes per step, peak). At a step of microbatch m: m's running bytes (`full_bytes`:
        kept plus the recompute transient) plus the live bytes of every other open window (forward: those opened before m; backward: those still
        open once m closes), plus the received exports held then.
    """
    order = [m for fwd, m in steps if fwd]
    needs = export_needs(mbs, order, sent=sent, remote=remote)
    window: dict[int, int] = {}
    full: dict[int, int] = {}
    for m, mb in mbs.items():
        nd = needs.get(m)
        counts = nd.local_counts(mb.num_rows) if nd is not None else None
        full[m], window[m] = live_bytes_of(sizes, mb, counts, 0 if nd is None else int(nd.states.shape[0]))
    out: list[int] = []
    stack: list[int] = []
    open_bytes = 0
    for j, (fwd, m) in enumerate(steps):
        extra = int(held[j]) if held is not None else 0
        if fwd:
            out.append(open_bytes + full[m] + extra)
            stack.append(m)
            open_bytes += window[m]
        else:
            if stack and stack[-1] == m:
                stack.pop()
                open_bytes -= window[m]
            out.append(open_bytes + full[m] + extra)
    return out, max(out, default=0)
