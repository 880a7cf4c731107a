"""Qwen3-Next-compatible model configuration and named tiny configs.

    cfg = debugmodel()                                     # the tiny MoE of the tests and the demo
    cfg = ModelConfig.from_hf_dict(json.load(open("config.json")))

`ModelConfig` mirrors the fields of Hugging Face `Qwen3NextConfig` that change the arithmetic;
`from_hf_dict` rejects what this trainer cannot run exactly (token-dropping MoE capacity factors,
other model types, activations; docs/design/execution.md, "The model over packed rows").
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

LINEAR = "linear_attention"
FULL = "full_attention"

#: config.json keys that would make MoE routing drop tokens; any non-null value is rejected.
_CAPACITY_KEYS = ("capacity_factor", "moe_capacity_factor", "expert_capacity", "train_capacity_factor", "eval_capacity_factor")


@dataclass(slots=True, kw_only=True)
class ModelConfig:
    """Architecture of a Qwen3-Next-style hybrid decoder. Defaults are the tiny `debugmodel()`."""

    vocab_size: int = 256
    """Vocabulary size V."""
    hidden_size: int = 64
    """Residual width D."""
    num_hidden_layers: int = 4
    """Number of decoder layers."""
    layer_types: list[str] = field(default_factory=lambda: [LINEAR, LINEAR, LINEAR, FULL])
    """Per layer: "linear_attention" (Gated DeltaNet) or "full_attention" (gated softmax attention)."""
    num_attention_heads: int = 4
    """Query heads of the full-attention layers."""
    num_key_value_heads: int = 2
    """Key/value heads of the full-attention layers (GQA); divides num_attention_heads."""
    head_dim: int = 16
    """Head dimension of the full-attention layers."""
    partial_rotary_factor: float = 0.25
    """Fraction of head_dim that RoPE rotates (the first ones)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    attention_bias: bool = False
    """Biases on q/k/v/o projections."""
    linear_num_key_heads: int = 2
    """Gated DeltaNet query/key heads."""
    linear_num_value_heads: int = 4
    """Gated DeltaNet value heads; a multiple of linear_num_key_heads."""
    linear_key_head_dim: int = 16
    """Gated DeltaNet key head dimension."""
    linear_value_head_dim: int = 16
    """Gated DeltaNet value head dimension."""
    linear_conv_kernel_dim: int = 4
    """Short causal convolution kernel size K."""
    intermediate_size: int = 128
    """Dense MLP width (layers without experts)."""
    num_experts: int = 8
    """Routed experts per MoE layer; 0 means every layer has a dense MLP."""
    num_experts_per_tok: int = 2
    """Top-k of the router."""
    moe_intermediate_size: int = 32
    """Width of one routed expert."""
    shared_expert_intermediate_size: int = 32
    """Width of the shared expert (0: none)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to one."""
    decoder_sparse_step: int = 1
    """Layer i has experts when (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layers forced to a dense MLP."""
    router_aux_loss_coef: float = 0.001
    """Coefficient of the load-balancing loss in the checkpoint's config (the executor decides whether to use it)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix."""
    hidden_act: str = "silu"
    """Activation; only "silu" exists in Qwen3-Next."""
    initializer_range: float = 0.02
    """Std of the random initialisation."""

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: expected {self.num_hidden_layers} entries (num_hidden_layers), got {len(self.layer_types)}"
            )
        for i, t in enumerate(self.layer_types):
            if t not in (LINEAR, FULL):
                raise ValueError(f"layer_types[{i}]: expected {LINEAR!r} or {FULL!r}, got {t!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads: expected a divisor of num_attention_heads ({self.num_attention_heads}), "
                f"got {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads: expected a multiple of linear_num_key_heads ({self.linear_num_key_heads}), "
                f"got {self.linear_num_value_heads}"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: expected 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")
        if self.linear_conv_kernel_dim < 1:
            raise ValueError(f"linear_conv_kernel_dim: expected >= 1, got {self.linear_conv_kernel_dim}")
        if int(self.head_dim * self.partial_rotary_factor) % 2:
            raise ValueError(
                f"partial_rotary_factor: expected head_dim * factor to be even, got {self.head_dim} * {self.partial_rotary_factor}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    def to_hf_dict(self) -> dict:
        """A config.json dict that transformers' Qwen3NextConfig accepts."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": out.pop("rope_theta"),
            "partial_rotary_factor": out.pop("partial_rotary_factor"),
        }
        out["model_type"] = "qwen3_next"
        out["architectures"] = ["Qwen3NextForCausalLM"]
        return out

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Read a Hugging Face Qwen3-Next config.json.

        Raises:
            ValueError: not a Qwen3-Next config, a MoE capacity factor (token dropping), an
                unsupported RoPE type, or an inconsistent field.
        """
        if d.get("model_type") != "qwen3_next":
            raise ValueError(f"config.json model_type: expected 'qwen3_next', got {d.get('model_type')!r}")
        for key in _CAPACITY_KEYS:
            if d.get(key) is not None:
                raise ValueError(
                    f"config.json {key}: expected none (HARTS routes every token, no capacity dropping), got {d[key]!r}"
                )
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json rope_parameters.rope_type: expected 'default', got {rope_type!r}")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        n_layers = int(d["num_hidden_layers"])
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = int(d.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        names = {f.name for f in fields(cls)} - {"rope_theta", "partial_rotary_factor", "layer_types"}
        kw = {k: d[k] for k in names if k in d and d[k] is not None}
        if "head_dim" not in kw:
            kw["head_dim"] = int(d["hidden_size"]) // int(d["num_attention_heads"])
        return cls(**kw, layer_types=list(layer_types), rope_theta=float(theta), partial_rotary_factor=float(factor))


def debugmodel() -> ModelConfig:
    """The tiny hybrid MoE (`--model tiny`): 4 layers (linear x3 + full), 8 experts top-2."""
    return ModelConfig()


def debugmodel_dense() -> ModelConfig:
    """debugmodel with a dense MLP in every layer."""
    return ModelConfig(num_experts=0)


def debugmodel_deep() -> ModelConfig:
    """8 layers with full attention at layers 3 and 7, so linear layers also sit after attention."""
    return ModelConfig(num_hidden_layers=8, layer_types=([LINEAR] * 3 + [FULL]) * 2)


def smallmodel() -> ModelConfig:
    """A 4.7M-parameter hybrid MoE (D = 256): big enough that per-token work, not per-op overhead,
    dominates a CPU step, so update-throughput benchmarks measure what a real model would."""
    return ModelConfig(
        hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        intermediate_size=512, moe_intermediate_size=128, shared_expert_intermediate_size=128,
    )


#: named configs for `--model NAME`.
NAMED_CONFIGS = {"tiny": debugmodel, "debugmodel": debugmodel, "tiny-dense": debugmodel_dense, "tiny-deep": debugmodel_deep,
                 "small": smallmodel}
