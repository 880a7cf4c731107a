"""Full-size named models for memory planning and the GPU benchmark: Qwen3-Next `config.json` dicts, usable by name.

    from plan.named_models import NAMED_MODELS
    config = NAMED_MODELS["qwen3-next-80b-a3b"]()      # what `harts plan --model qwen3-next-80b-a3b` reads

The memory model's default (`plan.memory_model.ModelDims.default`) and the cluster memory report
(`plan.cluster_memory`) read these; the trainer builds them by name (`trainer.models.build_model`,
through `ModelConfig.from_hf_dict`: they are Hugging Face `Qwen3NextConfig` documents). Named configs are plain functions
returning a fresh dict, so that a caller may change its copy (docs/design/planner.md, "The memory
budget M").
"""
from __future__ import annotations

from collections.abc import Callable


def qwen3_next_80b_a3b() -> dict:
    """Qwen3-Next-80B-A3B as published (`Qwen/Qwen3-Next-80B-A3B-Instruct` config.json): 48 layers,
    3 Gated DeltaNet layers per gated-attention layer, hidden 2048, 512 experts top-10 of width 512
    plus a shared expert of 512, 16 query / 2 key-value heads of 256, linear attention 16 key /
    32 value heads of 128, vocabulary 151,936, untied embeddings: 79.67B parameters (the published
    "80B"; the multi-token-prediction head is not part of the model trained here), 3.56B active per
    token counting the lm head; decoder blocks of 1.65B, the root unit 0.62B."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": 2048, "num_hidden_layers": 48, "full_attention_interval": 4, "vocab_size": 151936,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25,
        "rope_theta": 10000000, "attention_bias": False,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "intermediate_size": 5120, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "router_aux_loss_coef": 0.001,
        "max_position_embeddings": 262144, "torch_dtype": "bfloat16",
    }


def hybrid_moe_124b() -> dict:
    """A 124B-class hybrid MoE of the paper's larger size, designed here (no published config):
    Qwen3-Next-80B-A3B's layer recipe widened and deepened. 60 layers (45 Gated DeltaNet, 15 gated
    attention, the same 3:1 pattern), hidden 2560, 20 query / 4 key-value heads of 256, linear
    attention 16 key / 32 value heads of 128, 512 experts top-10 of width 512 plus a shared expert of
    512, vocabulary 151,936, untied embeddings: 124.45B parameters, 5.63B active per token counting
    the lm head; decoder blocks of 2.06B (the experts 2.01B), the root unit 0.78B, so that FSDP2's
    gathered units stay a few GiB."""
    cfg = qwen3_next_80b_a3b()
    cfg.update({
        "hidden_size": 2560, "num_hidden_layers": 60, "num_attention_heads": 20, "num_key_value_heads": 4,
        "intermediate_size": 6400,
    })
    return cfg


def qwen3_next_8l_64e() -> dict:
    """The GPU benchmark's model (`benchmarks.bench_gpu`): Qwen3-Next-80B-A3B's layer shapes cut to
    8 layers (6 Gated DeltaNet, 2 gated attention: the same 3:1 pattern) and 64 experts top-8 of
    width 512 plus the shared expert of 512; hidden 2048, vocabulary 151,936, untied embeddings:
    2.52B parameters (2,516,045,952, of them 0.62B the embedding and lm head), 0.80B active per
    token counting the lm head."""
    cfg = qwen3_next_80b_a3b()
    cfg.update({"num_hidden_layers": 8, "num_experts": 64, "num_experts_per_tok": 8})
    return cfg


#: `--model NAME` of the planning commands (harts_cli/model_arg.py), besides the trainer's small configs
NAMED_MODELS: dict[str, Callable[[], dict]] = {
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b,
    "hybrid-moe-124b": hybrid_moe_124b,
    "qwen3-next-8l-64e": qwen3_next_8l_64e,
}
