"""`harts plan` as users run it: a subprocess on a JSON batch, plus in-process runs for the variants."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from harts_cli.main import main
from proto.harts.v1 import plan_pb2
from plan.validator import validate_plan

HARTS = [sys.executable, "-m", "harts_cli.main"]
FIELDS = {
    "unique_tokens", "expanded_tokens", "computed_tokens", "replay_tokens", "duplicated_tokens",
    "compression_ideal", "compression_achieved", "microbatches", "linear_attention_calls", "rank_costs",
    "imbalance", "peak_live_tokens", "peak_live_bytes", "makespan", "makespan_lower_bound", "makespan_ratio",
    "plan_seconds",
}


def _doc() -> dict:
    """Two tasks: 4 rollouts below a 40-token prompt (task a), 3 below a 25-token prompt (task b)."""
    trajs = []
    for b in range(4):
        toks = [(7 * i) % 200 for i in range(40)] + [(b * 31 + i) % 200 for i in range(30 + 5 * b)]
        trajs.append({"id": f"a{b}", "tree_id": "a", "tokens": toks, "loss_mask": [0] * 40 + [1] * (len(toks) - 40),
                      "advantage": 0.5 - b / 4})
    for b in range(3):
        toks = [(3 * i + 1) % 200 for i in range(25)] + [(b * 17 + 5 + i) % 200 for i in range(20)]
        trajs.append({"id": f"b{b}", "tree_id": "b", "tokens": toks, "advantage": 1.0})
    return {"batch_id": "cli-test", "vocab_size": 256, "trajectories": trajs}


@pytest.fixture()
def batch(tmp_path):
    path = tmp_path / "rollouts.json"
    path.write_text(json.dumps(_doc()))
    return path


@pytest.mark.slow
def test_plan_prints_the_report_and_writes_a_deterministic_plan(tmp_path, batch):
    args = ["plan", str(batch), "--world-size", "2", "--microbatch-tokens", "64", "--chunk-size", "8"]
    outs = []
    for i in range(2):
        out = tmp_path / f"plan{i}.bin"
        r = subprocess.run([*HARTS, *args, "-o", str(out)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert FIELDS <= report.keys() and report["validated"] is True and report["output"] == str(out)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1], "same batch and settings must give the same plan bytes"
    doc = _doc()
    assert report["expanded_tokens"] == sum(len(t["tokens"]) for t in doc["trajectories"])
    assert report["unique_tokens"] == 40 + sum(30 + 5 * b for b in range(4)) + 25 + 3 * 20
    assert report["computed_tokens"] == report["unique_tokens"] + report["replay_tokens"] + report["duplicated_tokens"]
    assert report["compression_achieved"] <= report["compression_ideal"]
    assert len(report["rank_costs"]) == 2 and report["plan_seconds"] > 0
    plan = plan_pb2.Plan()
    plan.ParseFromString(outs[0])
    validate_plan(plan)
    assert plan.header.params.world_size == 2 and plan.header.params.microbatch_tokens == 64
    assert plan.header.stats.microbatches == report["microbatches"]
    assert all(mb.num_rows + mb.replay_tokens <= 64 for rank in plan.ranks for mb in rank.microbatches)


def test_plan_rejects_impossible_settings_with_exit_code_2(batch):
    r = subprocess.run([*HARTS, "plan", str(batch), "--microbatch-tokens", "64", "--chunk-size", "8", "--no-windows"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "harts plan: error: microbatch_tokens: trajectory 'a3' has 85 tokens" in r.stderr
    assert "raise microbatch_tokens to >= 85 or enable windows" in r.stderr


@pytest.mark.parametrize(
    "flags,check",
    [
        (["--no-sharing"], lambda r: r["computed_tokens"] == r["expanded_tokens"] and r["compression_achieved"] == 1.0),
        (["--no-replay"], lambda r: r["replay_tokens"] == 0),
        (["--no-windows", "--microbatch-tokens", "128"], lambda r: r["windows"] == 0),
        (["--all-positions", "--python"], lambda r: r["microbatches"] >= 2),
    ],
    ids=["no-sharing", "no-replay", "no-windows", "all-positions-python"],
)
def test_plan_variants(capsys, batch, flags, check):
    args = ["plan", str(batch), "--world-size", "2", "--microbatch-tokens", "64", "--chunk-size", "8", *flags]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert check(report), report


def test_plan_reads_protobuf_from_stdin(tmp_path):
    from planner_service.ingest import json_to_proto

    pb = tmp_path / "batch.pb"
    pb.write_bytes(json_to_proto(_doc()).SerializeToString())
    with open(pb, "rb") as fh:
        r = subprocess.run([*HARTS, "plan", "-", "--format", "pb", "--microbatch-tokens", "256", "--chunk-size", "8"],
                           stdin=fh, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["microbatches"] >= 1 and report["unique_tokens"] == 40 + 150 + 25 + 60


def test_plan_rejects_bad_config(capsys, batch):
    assert main(["plan", str(batch), "--chunk-size", "48"]) == 2
    assert "chunk_size: expected a power of two" in capsys.readouterr().err


def test_plan_sizes_windows_with_the_named_model_and_balances_with_a_cost_model(capsys, tmp_path, batch):
    from planner_service.planner.cost_model import CostModel
    from plan.memory_model import ModelDims, RowSizes
    from trainer.models.config import debugmodel

    cost = tmp_path / "cost.json"
    cost.write_text(CostModel(row=2.0, attention=0.001, linear_call=5.0, logprob_row=1.0, source="test").to_json())
    out = tmp_path / "plan.bin"
    args = ["plan", str(batch), "--world-size", "4", "--microbatch-tokens", "64", "--chunk-size", "8", "--model", "tiny",
            "--dtype", "bfloat16", "--cost-model", str(cost), "--memory-tokens", "64", "-o", str(out)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    plan = plan_pb2.Plan.FromString(out.read_bytes())
    mm = plan.header.params.memory
    want = RowSizes.of(ModelDims.from_hf_config(debugmodel().to_hf_dict()), "bfloat16", 8)
    assert (mm.activation_row_bytes, mm.state_bytes, mm.model, mm.dtype) == (want.activation_row_bytes, want.state_bytes, "tiny", "bfloat16")
    assert plan.header.params.cost_model.linear_call == 5.0 and plan.header.params.cost_model.source == "test"
    assert report["peak_live_bytes"] <= 64 * mm.activation_row_bytes
    assert report["makespan_ratio"] >= 1.0 and report["makespan"] == max(report["rank_costs"])
    config = tmp_path / "config.json"
    config.write_text(json.dumps(debugmodel().to_hf_dict()))
    assert main([*args[:-2], "--model", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["peak_live_bytes"] == report["peak_live_bytes"]
    assert main([*args[:-2], "--model", "no-such-model"]) == 2
    assert "--model: expected a config.json path or one of" in capsys.readouterr().err


def test_plan_report_names_its_memory_model_and_where_the_budget_comes_from(capsys, batch):
    base = ["plan", str(batch), "--world-size", "2", "--microbatch-tokens", "64", "--chunk-size", "8"]
    assert main(base) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["memory_model"] == "default: Qwen3-Next-80B-A3B" and "memory_report" not in report
    assert report["memory_budget"]["memory_tokens"] == 8 * 64 and report["memory_budget"]["source"].startswith("8 x microbatch_tokens")
    assert main([*base, "--model", "tiny", "--device-memory-gb", "0.5"]) == 0
    report = json.loads(capsys.readouterr().out)
    budget, mem = report["memory_budget"], report["memory_report"]
    assert report["memory_model"] == "tiny" and "tiny at W = 2 on 0.5 GiB (float32): device - shards" in budget["source"]
    assert budget["memory_tokens"] == mem["activation_tokens"] > 8 * 64 and mem["fits"] and mem["world_size"] == 2
    assert budget["memory_bytes"] == budget["memory_tokens"] * mem["bytes_per_row"] == budget["memory_tokens"] * budget["bytes_per_row"]
    assert main([*base, "--model", "qwen3-next-80b-a3b"]) == 2  # 80B on 2 ranks: no room for one microbatch
    assert "memory_tokens: expected the memory model to leave room for one microbatch" in capsys.readouterr().err


def test_plan_lockstep_reports_the_phases(capsys, tmp_path, batch):
    out = tmp_path / "plan.bin"
    args = ["plan", str(batch), "--world-size", "2", "--microbatch-tokens", "32", "--chunk-size", "8", "--lockstep",
            "-o", str(out)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    plan = plan_pb2.Plan.FromString(out.read_bytes())
    validate_plan(plan)
    assert plan.header.params.lockstep and all(len(r.steps) == report["lockstep_phases"] for r in plan.ranks)
    assert report["lockstep_phases"] == (report["lockstep_forward_phases"] + report["lockstep_backward_phases"]
                                         + report["lockstep_recompute_phases"]) > 0
    assert report["lockstep_ratio"] == pytest.approx(report["lockstep_makespan"] / report["makespan"])
    assert main(args[:-3]) == 0  # a free plan's report names no phases
    assert "lockstep_phases" not in json.loads(capsys.readouterr().out)


def test_plan_lockstep_compares_windows_across_ranks_unless_told_not_to(capsys, tmp_path, batch):
    out = tmp_path / "plan.bin"
    args = ["plan", str(batch), "--world-size", "3", "--microbatch-tokens", "32", "--chunk-size", "8", "--lockstep",
            "-o", str(out)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    plan = plan_pb2.Plan.FromString(out.read_bytes())
    assert plan.header.params.cross_rank_windows and report["cross_edges"] == plan.header.stats.cross_edges
    assert report["without_cross_edges"]["lockstep_makespan"] > 0 and report["without_cross_edges"]["cross_edges"] == 0
    assert main(args + ["--no-cross-rank-windows"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = plan_pb2.Plan.FromString(out.read_bytes())
    assert not plan.header.params.cross_rank_windows and report["cross_edges"] == 0
    assert "with_cross_edges" not in report and not any(r.cross_edges for r in plan.ranks)


def test_memory_report_under_checkpointing_and_expert_parallelism(capsys):
    """The sizing goal (README "Planning a cluster") as `harts plan` answers it: hybrid-moe-124b,
    W = 32, 141 GiB, B = 16,384."""
    base = ["plan", "--model", "hybrid-moe-124b", "--world-size", "32", "--device-memory-gb", "141",
            "--microbatch-tokens", "16384"]
    docs = {}
    for mode in ("none", "full", "selective"):
        for E in ("1", "8"):
            assert main([*base, "--activation-checkpointing", mode, "--expert-parallel", E, "--json"]) == 0
            docs[mode, E] = doc = json.loads(capsys.readouterr().out)
            assert {"activation_rows_per_rank", "bytes_per_row", "peak_bytes_per_rank", "fits", "shortfall_bytes",
                    "kept_row_bytes", "recompute_row_bytes", "gathered_bytes", "free_schedule"} <= doc.keys()
            assert (doc["activation_checkpointing"], doc["expert_parallel"], doc["head"]) == (mode, int(E), "chunked")
            assert doc["bytes_per_row"] == doc["kept_row_bytes"] + doc["recompute_row_bytes"]
            assert doc["fits"] == (doc["activation_rows_per_rank"] >= 16384) == (doc["shortfall_bytes"] == 0)
    assert docs["full", "1"]["fits"] and docs["full", "8"]["fits"]
    assert not docs["none", "8"]["fits"] and not docs["selective", "8"]["fits"]
    assert docs["full", "8"]["gathered_bytes"] < docs["full", "1"]["gathered_bytes"] / 3  # 64 of 512 experts per block
    assert docs["full", "8"]["all_to_all_bytes_per_microbatch"] > 0 == docs["full", "1"]["all_to_all_bytes_per_microbatch"]
    assert main([*base, "--activation-checkpointing", "full", "--expert-parallel", "8"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel E = 8" in out and "activation checkpointing full, chunked lm head" in out
    assert "of 141 GiB: fits" in out and "all-to-all per rank" in out


@pytest.mark.parametrize("flags,message", [
    (["--expert-parallel", "5"], "harts plan: error: --expert-parallel: expected a divisor of world_size (32) and of "
                                 "num_experts (512), got 5"),
    (["--expert-parallel", "0"], "harts plan: error: --expert-parallel: expected an integer >= 1, got 0"),
], ids=["not-a-divisor", "zero"])
def test_memory_report_names_the_flag_in_its_one_line_error(capsys, flags, message):
    assert main(["plan", "--model", "hybrid-moe-124b", "--world-size", "32", *flags]) == 2
    err = capsys.readouterr().err
    assert err.strip() == message


def test_plan_rejects_an_unknown_checkpointing_mode_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--activation-checkpointing", "some"])
    assert "argument --activation-checkpointing: invalid choice: 'some'" in capsys.readouterr().err


def test_plan_sizes_rows_under_checkpointing_and_reports_all_to_all_bytes(capsys, tmp_path, batch):
    out = tmp_path / "plan.bin"
    base = ["plan", str(batch), "--world-size", "2", "--microbatch-tokens", "32", "--chunk-size", "8", "--model", "tiny",
            "--memory-tokens", "64", "--lockstep"]
    assert main([*base, "--activation-checkpointing", "full", "--expert-parallel", "2", "--head", "chunked",
                 "-o", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = plan_pb2.Plan.FromString(out.read_bytes())
    validate_plan(plan)
    mm = plan.header.params.memory
    assert (mm.activation_checkpointing, mm.head) == ("full", "chunked") and mm.recompute_row_bytes > 0
    budget = report["memory_budget"]
    assert budget["bytes_per_row"] == mm.activation_row_bytes + mm.recompute_row_bytes
    assert (budget["activation_checkpointing"], budget["expert_parallel"], budget["head"]) == ("full", 2, "chunked")
    assert report["memory_report"]["expert_parallel"] == 2
    # tiny: 4 MoE layers, top-2, D = 64, float32: 4 x 2 x 64 x 4 x 1/2 = 1024 bytes per row and transfer
    def rows(plan):
        return [(sum(mb.num_rows + mb.replay_tokens for mb in r.microbatches),
                 sum(mb.num_rows + mb.replay_tokens for mb in r.microbatches if mb.recompute)) for r in plan.ranks]

    assert report["collectives"]["all_to_all_bytes"] == max(1024 * (7 * n + 2 * rec) for n, rec in rows(plan)) > 0
    assert main([*base, "--expert-parallel", "2", "--head", "chunked", "-o", str(out)]) == 0  # no checkpointing
    report = json.loads(capsys.readouterr().out)
    plan = plan_pb2.Plan.FromString(out.read_bytes())
    assert report["memory_budget"]["bytes_per_row"] > budget["bytes_per_row"]
    assert report["collectives"]["all_to_all_bytes"] == max(1024 * (5 * n + 2 * rec) for n, rec in rows(plan))
    assert main([*base[:-1], "--expert-parallel", "2"]) == 2  # a free plan cannot exchange tokens
    assert "harts plan: error: --expert-parallel: expected 1 without lockstep" in capsys.readouterr().err
