"""plan.memory_model: model dimensions from config.json, the per-row formula, byte sizes per
export kind, and the live stack of a rank step by step."""
from __future__ import annotations

import numpy as np
import pytest

from plan.memory_model import MEASURED_FACTOR, ModelDims, RowSizes, rank_live_bytes, saved_bytes_per_row
from trainer.models.config import NAMED_CONFIGS, ModelConfig


@pytest.mark.parametrize("name", sorted(NAMED_CONFIGS))
def test_dims_from_config_json_match_the_trainer_model_config(name):
    # proto cannot import the trainer: both read the same config.json keys, and must agree.
    cfg: ModelConfig = NAMED_CONFIGS[name]()
    dims = ModelDims.from_hf_config(cfg.to_hf_dict())
    assert list(dims.layer_types) == cfg.layer_types
    assert [bool(x) for x in dims.moe_layers] == [cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)]
    for f in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
              "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"):
        assert getattr(dims, f) == getattr(cfg, f), f
    assert dims.rotary_dim == cfg.rotary_dim


def test_export_sizes_per_kind_follow_the_layer_shapes():
    dims = ModelDims.from_hf_config(NAMED_CONFIGS["tiny"]().to_hf_dict())  # 3 linear + 1 full layer
    s = RowSizes.of(dims, "float32", chunk_size=64)
    assert s.attn_row_bytes == 1 * 2 * 2 * 16 * 4  # K and V, 2 KV heads x 16
    conv = 2 * 2 * 16 + 4 * 16  # q, k (Hk x Kd) and v (Hv x Vd)
    assert s.conv_row_bytes == 3 * conv * 4
    assert s.kernel_row_bytes == 3 * (conv * 4 + 2 * 4 * 4)  # + fp32 g and beta per value head
    assert s.state_bytes == 3 * 4 * 16 * 16 * 4
    bf16 = RowSizes.of(dims, "bfloat16", chunk_size=64)
    assert bf16.state_bytes == s.state_bytes, "states stay fp32"
    assert bf16.attn_row_bytes * 2 == s.attn_row_bytes
    assert bf16.activation_row_bytes < s.activation_row_bytes
    parts = saved_bytes_per_row(dims, "float32", 64)
    assert s.activation_row_bytes == int(np.ceil(sum(parts.values())))
    assert all(parts[k] > 0 for k in ("norms", "moe", "linear_attention", "attention", "head")) and parts["mlp"] == 0
    dense = saved_bytes_per_row(ModelDims.from_hf_config(NAMED_CONFIGS["tiny-dense"]().to_hf_dict()))
    assert dense["moe"] == 0 and dense["mlp"] == 4 * 6 * 128 * 4 * MEASURED_FACTOR["mlp"]


def test_default_model_is_qwen3_next_80b_and_exports_are_small_next_to_activations():
    d = ModelDims.default()
    assert (d.hidden_size, len(d.layer_types), d.num_full, d.num_experts) == (2048, 48, 12, 512)
    s = RowSizes.of(d)
    assert s.attn_row_bytes * 100 < s.activation_row_bytes  # why recomputation pays
    assert s.state_bytes == 36 * 32 * 128 * 128 * 4


@pytest.mark.parametrize("bad,match", [
    ({"hidden_size": 64}, "num_hidden_layers: expected an integer"),
    ({"num_hidden_layers": 2, "layer_types": ["linear_attention"], "hidden_size": 8, "vocab_size": 4,
      "num_attention_heads": 2}, "layer_types: expected a list of 2"),
    ({"num_hidden_layers": 1, "hidden_size": "big", "vocab_size": 4, "num_attention_heads": 1}, "hidden_size: expected an integer"),
    ([1, 2], "expected a config.json object"),
])
def test_bad_model_configs_are_rejected_naming_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelDims.from_hf_config(bad)


def test_rank_live_bytes_counts_full_or_exported_windows_along_the_steps():
    # Through the builder: a root window, a recomputed middle window, a leaf (test_plan_builder
    # checks the kinds); here the step-by-step series: forward of each adds the open windows.
    from planner_service.planner import PlanConfig
    from planner_service.planner.build import build_plan
    from planner_service.planner.spec import MicrobatchSpec, Partition
    from plan.decode import decode_microbatch
    from tests.builder_helpers import forest_from_trajectories

    base = list(range(1, 25))
    f = forest_from_trajectories([base, base[:19] + [80, 81]])
    segs = {(int(f.seg_depth[s]), int(f.tokens[f.seg_offset[s]])): s for s in range(f.num_segments)}
    s0, s2, s3 = segs[(0, 1)], segs[(19, 20)], segs[(19, 80)]
    part = Partition(microbatches=[
        MicrobatchSpec(ranges=np.array([[s0, 0, 11]])),
        MicrobatchSpec(ranges=np.array([[s0, 11, 19]]), parent=0, shared=True, recompute=True),
        MicrobatchSpec(ranges=np.array([[s2, 0, 5], [s3, 0, 2]]), parent=1, shared=True),
    ])
    sizes = RowSizes(activation_row_bytes=1000, attn_row_bytes=1, conv_row_bytes=0, kernel_row_bytes=0, state_bytes=0)
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, row_sizes=sizes), part)
    rank = plan.ranks[0]
    mbs = {mb.id: decode_microbatch(mb, plan.header.params) for mb in rank.microbatches}
    steps = [(s.kind == 0, rank.microbatches[s.microbatch].id) for s in rank.steps]
    live, peak = rank_live_bytes(sizes, mbs, steps)
    full = {m: (mb.num_rows + mb.replay_tokens) * 1000 for m, mb in mbs.items()}
    # F0, F1 (0 open: full), F2 (0 full + 1's 8 own ATTN rows), B2, B1 (1 recomputes), B0
    assert live == [full[0], full[0] + full[1], full[0] + 8 + full[2], full[0] + 8 + full[2], full[0] + full[1], full[0]]
    assert peak == plan.header.stats.peak_live_bytes


@pytest.mark.parametrize("name", ["tiny", "tiny-dense", "small"])
def test_formula_covers_the_measured_activations(name):
    """The per-row activation bytes of the memory model against what autograd really keeps for one
    microbatch of the trainer's model (saved-tensor hooks): an upper bound, and not a loose one."""
    import torch

    from benchmarks.peer import SavedTensorBytes
    from plan.memory_model import ModelDims, saved_bytes_per_row
    from trainer.executor import kernel_backend
    from trainer.layout import layout_from_sequences
    from trainer.models import RunOptions, build_model

    model = build_model(name, seed=0)
    L = 512
    lay = layout_from_sequences([np.random.default_rng(0).integers(0, 256, L).tolist()], conv_kernel=4, chunk_size=16)
    with SavedTensorBytes(model) as gauge:
        out = model(lay, RunOptions(linear_fn=kernel_backend("ref"), chunk_size=16), logprobs=True)
        out.logprob.sum()
    measured = gauge.peak / L
    estimate = sum(saved_bytes_per_row(ModelDims.from_hf_config(model.config.to_hf_dict()), "float32", 16).values())
    print(f"{name}: measured {measured:.0f} B/row, estimate {estimate:.0f} B/row ({estimate / measured:.2f}x)")
    assert measured <= estimate <= 1.6 * measured, (measured, estimate)
