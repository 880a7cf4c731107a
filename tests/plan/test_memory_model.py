"""plan.memory_model: model dimensions from config.json, the per-row formula, byte sizes per
export kind, and the live stack of a rank step by step."""
from __future__ import annotations

import numpy as np
import pytest

from plan.memory_model import (DTYPE_BYTES, MEASURED_FACTOR, ModelDims, RowSizes, checkpointed_bytes_per_row,
                               layer_bytes_per_row, rank_live_bytes, saved_bytes_per_row)
from plan.microbatch import decode_microbatch
from plan.named_models import NAMED_MODELS
from planner_service.planner import PlanConfig
from planner_service.planner.build import build_plan
from planner_service.planner.spec import MicrobatchSpec, Partition
from proto.harts.v1 import plan_pb2
from tests.builder_helpers import forest_from_trajectories
from tests.memory_helpers import compare_with_memory_model
from trainer.executor import kernel_backend
from trainer.layout import layout_from_sequences
from trainer.models import RunOptions, build_model
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


@pytest.mark.parametrize("name", ["tiny", "hybrid-moe-124b"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_checkpointing_modes_split_the_same_per_layer_numbers(name, dtype):
    config = NAMED_MODELS[name]() if name in NAMED_MODELS else NAMED_CONFIGS[name]().to_hf_dict()
    dims = ModelDims.from_hf_config(config)
    e, D = DTYPE_BYTES[dtype], dims.hidden_size
    parts = saved_bytes_per_row(dims, dtype, 64)
    layers = layer_bytes_per_row(dims, dtype, 64)
    assert len(layers) == len(dims.layer_types)
    assert sum(sum(x.values()) for x in layers) + parts["head"] == pytest.approx(sum(parts.values()), rel=1e-12)
    head = parts["head"]
    chunked = saved_bytes_per_row(dims, dtype, 64, head="chunked")["head"]
    assert head - chunked == dims.vocab_size * 4 - 2 * 4  # fp32 logits against lse and entropy terms
    assert checkpointed_bytes_per_row(dims, dtype, 64) == (sum(parts.values()), 0.0)
    kept, transient = checkpointed_bytes_per_row(dims, dtype, 64, checkpointing="full")
    ids, lse = 8 + 8 + 16, 4  # int64 token id, head row index, entry row and label; the full head's lse
    assert kept == len(layers) * D * e + head + ids + lse and transient == max(sum(x.values()) for x in layers)
    kept_s, transient_s = checkpointed_bytes_per_row(dims, dtype, 64, checkpointing="selective", head="chunked")
    assert kept_s == pytest.approx(sum(x["input_norm"] + x["mixer"] + D * e for x in layers) + chunked + ids)
    assert transient_s == max(x["post_norm"] + x["ffn"] for x in layers)
    assert kept < kept_s < sum(parts.values()) and transient_s < transient
    sizes = {m: RowSizes.of(dims, dtype, 64, checkpointing=m, head="chunked") for m in ("none", "full", "selective")}
    assert sizes["none"].recompute_row_bytes == 0 and sizes["none"].row_bytes == sizes["none"].activation_row_bytes
    assert sizes["full"].row_bytes < sizes["selective"].row_bytes < sizes["none"].row_bytes
    assert all(s.state_bytes == sizes["none"].state_bytes for s in sizes.values())  # exports do not depend on the mode


def test_the_124b_row_by_hand():
    """hybrid-moe-124b in bf16 (D = 2560, 45 Gated DeltaNet + 15 gated attention layers, MoE FFNs of
    512 experts top-10 of width 512 + a shared expert of 512), before MEASURED_FACTOR: a norm
    2560 x 10 + 4 = 25,604; Gated DeltaNet 320,640; attention 130,480; MoE 177,240 per row."""
    dims = ModelDims.from_hf_config(NAMED_MODELS["hybrid-moe-124b"]())
    F = MEASURED_FACTOR
    linear = 2 * 25_604 * F["norms"] + 320_640 * F["linear_attention"] + 177_240 * F["moe"]
    full_attn = 2 * 25_604 * F["norms"] + 130_480 * F["attention"] + 177_240 * F["moe"]
    assert [sum(x.values()) for x in layer_bytes_per_row(dims, "bfloat16")] == pytest.approx(
        [full_attn if (i + 1) % 4 == 0 else linear for i in range(60)])
    chunked_head = 25_604 + 8 + 32  # the final norm, lse and entropy, token id, row index, entry row and label
    assert checkpointed_bytes_per_row(dims, "bfloat16", checkpointing="full", head="chunked") == pytest.approx(
        (60 * 2560 * 2 + chunked_head, linear))
    assert checkpointed_bytes_per_row(dims, "bfloat16", checkpointing="selective", head="chunked") == pytest.approx(
        (45 * (25_604 + 320_640 * 1.5 + 5120) + 15 * (25_604 + 130_480 * 1.3 + 5120) + chunked_head,
         25_604 + 177_240 * 1.5))


def test_modes_and_heads_are_checked():
    dims = ModelDims.from_hf_config(NAMED_CONFIGS["tiny"]().to_hf_dict())
    with pytest.raises(ValueError, match="activation_checkpointing: expected one of none, full, selective, got 'some'"):
        RowSizes.of(dims, checkpointing="some")
    with pytest.raises(ValueError, match="head: expected one of full, chunked, got 'fused'"):
        RowSizes.of(dims, head="fused")
    with pytest.raises(ValueError, match="recompute_row_bytes: expected >= 0, got -1"):
        RowSizes(activation_row_bytes=1, attn_row_bytes=0, conv_row_bytes=0, kernel_row_bytes=0, state_bytes=0,
                 recompute_row_bytes=-1)


def test_row_sizes_round_trip_the_plan_and_old_plans_read_without_recompute():
    sizes = RowSizes.of(ModelDims.default(), "bfloat16", checkpointing="full", head="chunked")
    msg = plan_pb2.MemoryModel()
    sizes.fill(msg, 100)
    assert RowSizes.from_proto(msg) == sizes and msg.memory_bytes == 100 * sizes.row_bytes
    assert sizes.tokens(msg.memory_bytes) == 100 and sizes.tokens(msg.memory_bytes + 1) == 101
    old = plan_pb2.MemoryModel(activation_row_bytes=7, attn_row_bytes=1, conv_row_bytes=2, kernel_row_bytes=3,
                               state_bytes=4, memory_bytes=70)
    assert RowSizes.from_proto(old).recompute_row_bytes == 0 and RowSizes.from_proto(old).row_bytes == 7


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


@pytest.mark.parametrize("recompute_row_bytes", [0, 300], ids=["none", "checkpointed"])
def test_rank_live_bytes_counts_full_or_exported_windows_along_the_steps(recompute_row_bytes):
    # Through the builder: a root window, a recomputed middle window, a leaf (test_plan_builder
    # checks the kinds); here the step-by-step series: forward of each adds the open windows.
    base = list(range(1, 25))
    f = forest_from_trajectories([base, base[:19] + [80, 81]])
    segs = {(int(f.seg_depth[s]), int(f.tokens[f.seg_offset[s]])): s for s in range(f.num_segments)}
    s0, s2, s3 = segs[(0, 1)], segs[(19, 20)], segs[(19, 80)]
    part = Partition(microbatches=[
        MicrobatchSpec(ranges=np.array([[s0, 0, 11]])),
        MicrobatchSpec(ranges=np.array([[s0, 11, 19]]), parent=0, shared=True, recompute=True),
        MicrobatchSpec(ranges=np.array([[s2, 0, 5], [s3, 0, 2]]), parent=1, shared=True),
    ])
    sizes = RowSizes(activation_row_bytes=1000, attn_row_bytes=1, conv_row_bytes=0, kernel_row_bytes=0, state_bytes=0,
                     recompute_row_bytes=recompute_row_bytes)
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, row_sizes=sizes), part)
    rank = plan.ranks[0]
    mbs = {mb.id: decode_microbatch(mb, plan.header.params) for mb in rank.microbatches}
    steps = [(s.kind == 0, rank.microbatches[s.microbatch].id) for s in rank.steps]
    live, peak = rank_live_bytes(sizes, mbs, steps)
    rows = {m: mb.num_rows + mb.replay_tokens for m, mb in mbs.items()}
    run = {m: r * (1000 + recompute_row_bytes) for m, r in rows.items()}  # a running microbatch
    kept = rows[0] * 1000  # the open root window (not recomputed) keeps no recompute transient
    # F0, F1 (0 open: kept), F2 (0 kept + 1's 8 own ATTN rows), B2, B1 (1 recomputes), B0
    assert live == [run[0], kept + run[1], kept + 8 + run[2], kept + 8 + run[2], kept + run[1], run[0]]
    assert peak == plan.header.stats.peak_live_bytes


def _tiny_forward(name: str, rows: int = 512):
    """(model, run(mode) -> a scalar to backward from, rows): one packed sequence through a trainer
    model in float32 on the CPU, logits of every row (the full-logits head)."""
    model = build_model(name, seed=0)
    lay = layout_from_sequences([np.random.default_rng(0).integers(0, 256, rows).tolist()], conv_kernel=4, chunk_size=16)

    def run(mode: str):
        out = model(lay, _run_options(mode, kernel_backend("ref")), logprobs=True)
        return out.logprob.sum()
    return model, run, rows


def _run_options(mode: str, linear_fn):
    """The trainer's RunOptions for a checkpointing mode."""
    return RunOptions(linear_fn=linear_fn, chunk_size=16, checkpointing=mode)


@pytest.mark.parametrize("name", ["tiny", "tiny-dense", "small"])
def test_formula_covers_the_measured_activations(name):
    """The per-row activation bytes of the memory model against what autograd really keeps for one
    microbatch of the trainer's model (saved-tensor hooks, tests/memory_helpers.py): an upper bound,
    and not a loose one, in total, per decoder layer and per FFN sub-block (the two recompute
    transients)."""
    model, run, rows = _tiny_forward(name)
    got = compare_with_memory_model(model, run, rows=rows, mode="none", chunk_size=16)
    print(f"{name}: measured {got.kept[0]:.0f} B/row, estimate {got.kept[1]:.0f} B/row ({got.kept[1] / got.kept[0]:.2f}x)")
    got.check()
    assert got.kept[0] > 10 * max(m for m, _ in got.layers) / len(got.layers)  # the layers are measured, not empty


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_checkpointed_formula_covers_the_measured_activations(name, mode):
    """Under activation checkpointing: what a forward keeps for backward (the checkpointed blocks'
    inputs and what they do not recompute) and the recompute transient, against the memory model."""
    model, run, rows = _tiny_forward(name)
    got = compare_with_memory_model(model, run, rows=rows, mode=mode, chunk_size=16)
    print(f"{name} {mode}: kept measured {got.kept[0]:.0f} / model {got.kept[1]:.0f} B/row, transient measured "
          f"{got.transient[0]:.0f} / model {got.transient[1]:.0f}")
    got.check()
    plain = compare_with_memory_model(model, run, rows=rows, mode="none", chunk_size=16)
    assert got.kept[0] < plain.kept[0]  # the mode keeps less than the whole graph
