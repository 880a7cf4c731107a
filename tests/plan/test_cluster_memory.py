"""plan/cluster_memory.py: per-rank memory of FSDP2 training and collective bytes, by hand on a tiny
config; the full-size units against two independent counts (transformers' and the trainer's models
built on the meta device); the planner's default budget; the `harts plan` memory report."""
from __future__ import annotations

import json
import pathlib
import runpy
import sys

import numpy as np
import pytest

from harts_cli.main import main
from plan.cluster_memory import (GIB, PhaseCounts, collective_bytes, default_memory_tokens, fsdp_units, gathered_bytes,
                                 memory_report)
from plan.memory_model import ModelDims, RowSizes
from plan.named_models import NAMED_MODELS, hybrid_moe_124b, qwen3_next_80b_a3b
from planner_service.planner import PlanConfig
from proto.harts.v1 import plan_pb2

#: 2 layers (linear, full), D = 8, V = 15 (odd: dim-0 padding when sharded), 2 experts top-1
TINY = {
    "model_type": "qwen3_next", "hidden_size": 8, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
    "vocab_size": 15, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "partial_rotary_factor": 0.5,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4, "intermediate_size": 16, "num_experts": 2, "num_experts_per_tok": 1,
    "moe_intermediate_size": 4, "shared_expert_intermediate_size": 4, "tie_word_embeddings": False,
}
# By hand. Root: embed 15x8 + norm 8 + lm head 15x8 = 248. MoE FFN: router 2x8 = 16, gate_up 2x8x8 = 128,
# down 2x8x4 = 64, shared expert 4x8 + 4x8 + 8x4 = 96, its gate 1x8 = 8: 312. Linear block: norms 16,
# in_proj_qkvz 24x8 = 192, in_proj_ba 4x8 = 32, conv 16x1x4 = 64, dt_bias 2, A_log 2, gated norm 4,
# out_proj 8x8 = 64: 376 + 312 = 688. Full block: norms 16, q 16x8 = 128, k 32, v 32, o 64, q/k norms 8:
# 280 + 312 = 592.
ROOT_P, LINEAR_P, FULL_P = 248, 688, 592
# Shards at W = 2: ceil(d0 / 2) rows of each parameter. Root 8x8 + 4 + 8x8 = 132; MoE 8 + 64 + 32 + 16 +
# 16 + 16 + 8 = 160; linear block 8 + 96 + 16 + 32 + 1 + 1 + 2 + 32 + 160 = 348; full block 8 + 64 + 16 +
# 16 + 32 + 2 + 2 + 160 = 300.
SHARD_W2 = 132 + 348 + 300


def test_units_and_shards_by_hand():
    units = fsdp_units(TINY)
    assert [u.name for u in units] == ["root", "layers.0", "layers.1"]
    assert [u.numel for u in units] == [ROOT_P, LINEAR_P, FULL_P]
    assert sum(u.shard_numel(2) for u in units) == SHARD_W2 == 780
    assert sum(u.shard_numel(1) for u in units) == ROOT_P + LINEAR_P + FULL_P
    tied = fsdp_units({**TINY, "tie_word_embeddings": True, "attention_bias": True})
    assert tied[0].numel == ROOT_P - 120  # one embedding matrix
    assert tied[2].numel == FULL_P + 16 + 4 + 4 + 8  # q, k, v, o biases


def test_report_by_hand():
    device_gb = 1e-4  # 107,374 bytes
    rep = memory_report(TINY, 2, dtype="bfloat16", device_memory_gb=device_gb, microbatch_tokens=3, model_name="tiny")
    assert (rep.parameters, rep.units, rep.root_parameters, rep.largest_block_parameters) == (1528, 3, 248, 688)
    assert (rep.param_shard_bytes, rep.grad_shard_bytes, rep.optimizer_shard_bytes) == (4 * 780, 4 * 780, 8 * 780)
    # lock-step, bf16: root params + grads 2 x 2 x 248, the largest block gathered twice (prefetch) + its
    # bf16 gradient + its fp32 reduce-scatter input (2 + 2 + 2 + 4) x 688
    assert rep.gathered_bytes == 4 * 248 + 10 * 688 == 7872
    device = int(device_gb * GIB)
    assert (rep.device_memory_bytes, rep.margin_bytes) == (107374, 10737)
    row = RowSizes.of(ModelDims.from_hf_config(TINY), "bfloat16", 64, head="chunked").activation_row_bytes
    left = 107374 - 10737 - (16 * 780 + 7872)
    assert rep.bytes_per_row == rep.kept_row_bytes == row and rep.recompute_row_bytes == 0
    assert rep.activation_bytes == left // row * row
    assert rep.activation_tokens == left // row >= 3 and rep.fits
    assert rep.peak_bytes + rep.margin_bytes <= device
    fp32 = memory_report(TINY, 2, dtype="float32", device_memory_gb=device_gb)
    assert fp32.gathered_bytes == 8 * 248 + 16 * 688
    free = memory_report(TINY, 2, dtype="bfloat16", device_memory_gb=device_gb, lockstep=False)
    assert free.gathered_bytes == 2 * 2 * 1528 + 4 * 688  # every unit and its gradient, one fp32 reduce buffer
    given = memory_report(TINY, 2, device_memory_gb=device_gb, memory_tokens=2)
    assert given.activation_bytes == 2 * given.bytes_per_row and given.activation_source == "the budget M"
    small = memory_report(TINY, 2, dtype="bfloat16", device_memory_gb=device_gb, microbatch_tokens=left // row + 1)
    assert not small.fits and "does NOT fit (activations hold" in small.lines()[-1]
    d = rep.to_dict()
    assert d["static_bytes"] == 16 * 780 + 7872 and d["fits"] is True and json.dumps(d)


def test_collective_bytes_by_hand():
    blocks = LINEAR_P + FULL_P
    got = collective_bytes(TINY, 4, dtype="bfloat16", phases=PhaseCounts(forward=3, backward=2, recompute=1))
    # all-gather 3/4 x 2 x ((3 + 2 + 2 x 1) blocks + (3 + 1) root); reduce-scatter 3/4 x 4 x (2 + 1) x all
    assert got.all_gather_bytes == 0.75 * 2 * (7 * blocks + 4 * ROOT_P) == 14928
    assert got.reduce_scatter_bytes == 0.75 * 4 * 3 * (blocks + ROOT_P) == 13752
    assert "F = 3, B = 2, R = 1" in got.formula and got.to_dict()["phases"] == {"forward": 3, "backward": 2, "recompute": 1}
    free = collective_bytes(TINY, 4, dtype="bfloat16")
    assert (free.all_gather_bytes, free.reduce_scatter_bytes) == (0.75 * 2 * 1528, 0.75 * 4 * 1528)


def test_phase_counts_of_a_header():
    header = plan_pb2.PlanHeader()
    assert PhaseCounts.of(header) is None  # a free plan
    header.params.lockstep = True
    header.lockstep_phases = np.array([0, 0, 0, 2, 1, 1], np.uint8).tobytes()
    assert PhaseCounts.of(header) == PhaseCounts(forward=3, backward=2, recompute=1)
    header.lockstep_phases = bytes([0, 7])
    with pytest.raises(ValueError, match=r"lockstep_phases\[1\]: expected a PhaseKind \(0, 1 or 2\), got 7"):
        PhaseCounts.of(header)


def test_bad_arguments_name_the_field():
    for kw, match in ((dict(world_size=0), "world_size: expected >= 1"), (dict(dtype="int8"), "dtype: expected one of"),
                      (dict(device_memory_gb=0), "device_memory_gb: expected > 0"),
                      (dict(margin_fraction=1.0), "margin_fraction: expected in"),
                      (dict(memory_tokens=-1), "memory_tokens, microbatch_tokens: expected >= 0")):
        args = {"world_size": 2, **kw}
        with pytest.raises(ValueError, match=match):
            memory_report(TINY, args.pop("world_size"), **args)
    with pytest.raises(ValueError, match="model config num_hidden_layers"):
        fsdp_units({"hidden_size": 8})


def _units_of(named_shapes, layers_prefix: str) -> dict[str, list[tuple[int, ...]]]:
    out: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in named_shapes:
        unit = "root"
        if name.startswith(layers_prefix):
            unit = "layers." + name[len(layers_prefix):].split(".", 1)[0]
        out.setdefault(unit, []).append(tuple(shape))
    return {k: sorted(v) for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(NAMED_MODELS))
def test_full_size_units_match_transformers_and_the_trainer_on_meta(name):
    """Two counts built independently of plan/cluster_memory.py: transformers' Qwen3NextForCausalLM and
    the trainer's Qwen3NextForRL, both on the meta device, unit by unit, shape by shape."""
    torch = pytest.importorskip("torch")
    sys.modules.setdefault("fla", None)  # transformers would bind fla's GPU kernels, even for CPU tensors
    # optional and deferred: the trainer extra, and transformers only after the fla choice above
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from trainer.models.config import ModelConfig
    from trainer.models.qwen3_next import Qwen3NextForRL

    cfg = NAMED_MODELS[name]()
    mine = {u.name: sorted(u.shapes + u.expert_shapes) for u in fsdp_units(cfg)}
    hf_cfg = Qwen3NextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("meta"):
        hf = Qwen3NextForCausalLM(hf_cfg)
        ours = Qwen3NextForRL(ModelConfig.from_hf_dict(cfg))
    assert _units_of(((n, p.shape) for n, p in hf.named_parameters()), "model.layers.") == mine
    assert _units_of(((n, p.shape) for n, p in ours.named_parameters()), "model.layers.") == mine


def test_named_model_figures():
    """The totals the named configs' docstrings and the README state."""
    for fn, total, blocks, block, root in ((qwen3_next_80b_a3b, 79_674_391_296, 48, 1_648_531_648, 622_331_904),
                                           (hybrid_moe_124b, 124_453_671_360, 60, 2_063_081_472, 777_914_880)):
        units = fsdp_units(fn())
        assert (sum(u.numel for u in units), len(units) - 1) == (total, blocks)
        assert (max(u.numel for u in units[1:]), units[0].numel) == (block, root)
    assert ModelDims.default() == ModelDims.from_hf_config(qwen3_next_80b_a3b())


def test_default_budget_is_what_the_device_leaves():
    cfg = qwen3_next_80b_a3b()
    tokens, source = default_memory_tokens(cfg, 64, 2048, dtype="bfloat16", lockstep=True)
    rep = memory_report(cfg, 64, dtype="bfloat16")
    assert tokens == rep.activation_tokens and 2048 <= tokens < 3100
    assert "qwen3" not in source and "W = 64 on 141 GiB (bfloat16): device - shards" in source
    with pytest.raises(ValueError, match=r"memory_tokens: expected the memory model to leave room for one microbatch of "
                                         r"4096 rows, got \d+ .*lower microbatch_tokens, raise world_size"):
        default_memory_tokens(cfg, 64, 4096, dtype="bfloat16")
    with pytest.raises(ValueError, match="got 0"):
        default_memory_tokens(cfg, 8, 1024)  # the shards alone exceed the device


def test_plan_config_takes_its_default_budget_from_the_model():
    from trainer.models.config import debugmodel  # optional: the trainer extra (plan/ itself needs no torch)

    tiny = debugmodel().to_hf_dict()
    cfg = PlanConfig(world_size=2, microbatch_tokens=512, chunk_size=16, model_config=tiny, model_name="tiny")
    want, source = default_memory_tokens(tiny, 2, 512, dtype="float32", chunk_size=16, lockstep=False, model_name="tiny",
                                         head="full")  # the planner's default head: the CPU trainer's
    assert (cfg.memory_tokens, cfg.memory_source) == (want, source) and want > 8 * 512
    smaller = PlanConfig(world_size=2, microbatch_tokens=512, chunk_size=16, model_config=tiny, device_memory_gb=1.0)
    assert smaller.memory_tokens < cfg.memory_tokens
    assert PlanConfig(microbatch_tokens=512, chunk_size=16).memory_tokens == 8 * 512  # no model: no device
    assert PlanConfig(microbatch_tokens=512, chunk_size=16, memory_tokens=600).memory_source == "memory_tokens (given)"
    with pytest.raises(ValueError, match="memory_tokens: expected the memory model to leave room"):
        PlanConfig(world_size=8, microbatch_tokens=1024, model_config=qwen3_next_80b_a3b())
    with pytest.raises(ValueError, match="device_memory_gb: expected > 0"):
        PlanConfig(device_memory_gb=0)


def test_harts_plan_prints_the_memory_report(capsys):
    assert main(["plan", "--model", "hybrid-moe-124b", "--world-size", "32", "--microbatch-tokens", "1024"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("hybrid-moe-124b: 124.45B parameters in 61 FSDP2 units, W = 32, bfloat16 compute, lock-step")
    for label in ("parameter shards (fp32, the master weights)", "gradient shards (fp32)", "AdamW state shards",
                  "gathered units", "activations:", "margin (10% of the device)"):
        assert any(line.strip().startswith(label) for line in lines), label
    assert "of 141 GiB: fits" in lines[-2] and lines[-1].startswith("free schedule") and "does NOT fit" in lines[-1]
    assert main(["plan", "--world-size", "8", "--json", "--device-memory-gb", "80"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "qwen3-next-80b-a3b" and doc["fits"] is False and doc["lockstep"] is True
    assert doc["device_memory_bytes"] == 80 * GIB and doc["free_schedule"]["lockstep"] is False


def test_expert_parallel_by_hand():
    """TINY on W = 4 with E = 2: each rank holds one of the two experts of every MoE layer, sharded over
    the 2 ranks that hold it; a block gathers its non-expert parameters and that one expert."""
    units = fsdp_units(TINY)
    experts = [u.expert_numel for u in units]
    assert experts == [0, 192, 192]  # gate_up 2x8x8 + down 2x8x4 per MoE layer
    assert [u.gathered_numel(2) for u in units] == [ROOT_P, LINEAR_P - 96, FULL_P - 96]
    # dim 0 of an expert tensor: 2 experts / E = 1 per rank, ceil(1 / (W / E)) = 1 row; the same as ceil(2 / 4) here
    assert sum(u.shard_numel(4, 2) for u in units) == sum(u.shard_numel(4) for u in units)
    rep = memory_report(TINY, 4, dtype="bfloat16", device_memory_gb=1e-4, expert_parallel=2, microbatch_tokens=3)
    assert rep.largest_block_parameters == LINEAR_P - 96 and rep.expert_parallel == 2
    assert rep.gathered_bytes == 4 * ROOT_P + 10 * (LINEAR_P - 96) == 6912
    # all-to-all: 2 MoE layers x top-1 x D 8 x 2 bytes x (E-1)/E per row and transfer; a forward makes 2
    # (copies out, outputs back), a backward 3 (copies and output gradients out, input gradients back)
    assert (rep.all_to_all_row_bytes, rep.all_to_all_transfers) == (16, 5)
    assert rep.to_dict()["all_to_all_bytes_per_microbatch"] == 16 * 5 * 3
    assert "expert parallel E = 2" in rep.lines()[0] and "all-to-all per rank" in rep.lines()[-1]
    full = memory_report(TINY, 4, dtype="bfloat16", device_memory_gb=1e-4, expert_parallel=2, activation_checkpointing="full")
    assert full.all_to_all_transfers == 7  # the backward re-runs the FFN: a forward's 2 more
    assert memory_report(TINY, 4, dtype="bfloat16", device_memory_gb=1e-4).all_to_all_row_bytes == 0


def test_collective_bytes_with_expert_parallel_by_hand():
    got = collective_bytes(TINY, 4, dtype="bfloat16", phases=PhaseCounts(forward=3, backward=2, recompute=1),
                           expert_parallel=2, activation_checkpointing="full", rank_rows=[(10, 4), (7, 0)])
    # per pass over the blocks: 3/4 of the 896 non-expert parameters + 1/2 (W / E = 2 holders) of 384 / 2 experts'
    moved, root = 0.75 * 896 + 0.5 * 192, 0.75 * ROOT_P
    assert got.all_gather_bytes == 2 * (7 * moved + 4 * root) == 12240
    assert got.reduce_scatter_bytes == 4 * 3 * (moved + root) == 11448
    # the busiest rank: 16 bytes per row and transfer x (7 transfers x 10 rows + 2 x 4 recomputed rows)
    assert got.all_to_all_bytes == 16 * (7 * 10 + 2 * 4)
    assert "x (7 x computed rows + 2 x recomputed rows)" in got.all_to_all_formula
    plain = collective_bytes(TINY, 4, dtype="bfloat16", phases=PhaseCounts(forward=3, backward=2, recompute=1),
                             rank_rows=[(10, 4)])
    assert plain.all_to_all_bytes == 0 and plain.all_gather_bytes == 14928  # E = 1: as before


@pytest.mark.parametrize("config,E,match", [
    (TINY, 3, r"expert_parallel: expected a divisor of world_size \(4\) and of num_experts \(2\), got 3"),
    (TINY, 0, "expert_parallel: expected an integer >= 1, got 0"),
    ({**TINY, "num_experts": 0}, 2, "expert_parallel: expected 1 for a model without routed experts, got 2"),
])
def test_expert_parallel_must_split_whole_experts_over_whole_ranks(config, E, match):
    for fn in (memory_report, collective_bytes):
        with pytest.raises(ValueError, match=match):
            fn(config, 4, expert_parallel=E)


def test_default_budget_follows_checkpointing_and_expert_parallelism():
    """The sizing goal of README "Planning a cluster": hybrid-moe-124b, B = 16,384 rows per
    microbatch, W = 32 on 141 GiB devices."""
    cfg = hybrid_moe_124b()
    kw = dict(dtype="bfloat16", lockstep=True)
    with pytest.raises(ValueError, match="turn on activation_checkpointing"):
        default_memory_tokens(cfg, 32, 16384, **kw)
    full, source = default_memory_tokens(cfg, 32, 16384, activation_checkpointing="full", **kw)
    ep, ep_source = default_memory_tokens(cfg, 32, 16384, activation_checkpointing="full", expert_parallel=8, **kw)
    assert 16384 < full < ep and "activation checkpointing full, expert parallel E = 8" in ep_source
    with pytest.raises(ValueError, match="turn on activation_checkpointing"):
        default_memory_tokens(cfg, 32, 16384, activation_checkpointing="selective", expert_parallel=8, **kw)
    rep = memory_report(cfg, 32, activation_checkpointing="full", expert_parallel=8, microbatch_tokens=16384)
    assert rep.fits and rep.activation_tokens == ep and rep.to_dict()["shortfall_bytes"] == 0
    none = memory_report(cfg, 32, expert_parallel=8, microbatch_tokens=16384)
    assert not none.fits and none.to_dict()["shortfall_bytes"] == none.microbatch_bytes - none.device_memory_bytes > 0


def test_plan_config_carries_checkpointing_expert_parallelism_and_the_head():
    cfg = hybrid_moe_124b()
    plan = PlanConfig(world_size=32, microbatch_tokens=16384, model_config=cfg, dtype="bfloat16", lockstep=True,
                      activation_checkpointing="full", expert_parallel=8, head="chunked")
    want, _ = default_memory_tokens(cfg, 32, 16384, dtype="bfloat16", lockstep=True, activation_checkpointing="full",
                                    expert_parallel=8, head="chunked")
    assert plan.memory_tokens == want and plan.memory_bytes == want * plan.sizes.row_bytes
    assert plan.sizes == RowSizes.of(ModelDims.from_hf_config(cfg), "bfloat16", checkpointing="full", head="chunked")
    with pytest.raises(ValueError, match="expert_parallel: expected 1 without lockstep"):
        PlanConfig(world_size=4, expert_parallel=2)
    with pytest.raises(ValueError, match=r"expert_parallel: expected a divisor of world_size \(4\)"):
        PlanConfig(world_size=4, expert_parallel=3, lockstep=True)
    with pytest.raises(ValueError, match="activation_checkpointing: expected one of"):
        PlanConfig(activation_checkpointing="some")
    with pytest.raises(ValueError, match="head: expected one of"):
        PlanConfig(head="fused")


def test_readme_memory_table_is_what_the_script_prints():
    root = pathlib.Path(__file__).parents[2]
    tables = runpy.run_path(str(root / "scripts" / "memory_table.py"))["tables"]
    readme = (root / "README.md").read_text()
    assert "\n".join(tables(16384, 141.0)) in readme, "regenerate with python scripts/memory_table.py"
