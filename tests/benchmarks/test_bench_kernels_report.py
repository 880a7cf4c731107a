"""`benchmarks.bench_kernels --gpu` / `--dry-run`: the dry run exercises the report's code on tiny
CPU shapes (our Triton kernels too, under the interpreter in a subprocess), writes every shape's rows
as it goes, honours its budgets; the markdown computes the target ratios from measured rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import bench_kernels


def test_dry_run_writes_each_kind_and_labels_itself(tmp_path):
    """Without the interpreter: references, SDPA and torch.mm rows (no Triton rows), every kind."""
    res = bench_kernels.report(out_dir=tmp_path, quick=False, budget_s=1e9, reps=1, dry_run=True)
    assert res["mode"] == "dry-run" and "not a measurement" in res["env"]["note"]
    kinds = {r["kernel"] for r in res["rows"]}
    assert kinds == {"gdn", "tree_attention", "matmul"}
    backends = {r["backend"] for r in res["rows"]}
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert {"harts ref", "ref tree", "sdpa expanded", "torch.mm"} <= backends and "harts triton" not in backends
    assert all("error" not in r for r in res["rows"]), res["rows"]
    lines = (tmp_path / "kernels-dry-run.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == json.loads(json.dumps(res["rows"]))
    assert json.loads((tmp_path / "kernels-dry-run.json").read_text())["rows"] == json.loads(json.dumps(res["rows"]))
    md = (tmp_path / "kernels-dry-run.md").read_text()
    assert "# Kernel benchmark (dry-run)" in md and "## Batch-invariant matmul" in md


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path")
def test_dry_run_under_the_interpreter_runs_our_triton_kernels(tmp_path):
    """`python -m benchmarks.bench_kernels --dry-run` with TRITON_INTERPRET=1: our Triton GDN, tree
    attention and batch-invariant matmul rows are measured and agree with the references."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_kernels", "--dry-run", "--out", str(tmp_path),
                           "--reps", "1", "--quick"], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "kernels-dry-run.json").read_text())["rows"]
    by = {(r["kernel"], r["backend"]): r for r in rows}
    assert all("error" not in r for r in rows), rows
    assert by[("gdn", "harts triton")]["max_rel_diff_vs_ref"] < 1e-5
    assert by[("tree_attention", "triton expanded")]["fwd_bwd_ms"] > 0
    assert by[("matmul", "batch-invariant mm_t")]["max_rel_diff_vs_torch"] < 1e-5
    md = (tmp_path / "kernels-dry-run.md").read_text()
    assert "| tree attention fwd+bwd, equal work: triton expanded / sdpa expanded |" in md


def test_a_spent_shape_budget_leaves_errors_and_a_spent_total_budget_skips_shapes(tmp_path):
    res = bench_kernels.report(out_dir=tmp_path, quick=False, budget_s=1e9, reps=1, shape_budget_s=-1.0, dry_run=True)
    timed = [r for r in res["rows"] if r["kernel"] == "gdn"]
    assert timed and all("BudgetSpent" in r["error"] for r in timed)
    res = bench_kernels.report(out_dir=tmp_path, quick=False, budget_s=-1.0, reps=1, dry_run=True)
    assert res["rows"] == [] and len(res["skipped"]) == 4
    assert "Skipped (time budget): gdn T=40 H=1, tree P=16 B=2 L=8" in (tmp_path / "kernels-dry-run.md").read_text()


def test_gpu_markdown_reports_the_target_ratios():
    rows = [
        {"kernel": "gdn", "shape": "s", "N": 4, "backend": "harts triton", "forward_ms": 3.0, "fwd_bwd_ms": 12.0},
        {"kernel": "gdn", "shape": "s", "N": 4, "backend": "fla chunk_gated_delta_rule", "forward_ms": 2.0, "fwd_bwd_ms": 10.0},
        {"kernel": "tree_attention", "shape": "t", "backend": "triton expanded", "rows": 8, "forward_ms": 1.0, "fwd_bwd_ms": 4.0},
        {"kernel": "tree_attention", "shape": "t", "backend": "triton tree", "rows": 5, "forward_ms": 0.5, "fwd_bwd_ms": 2.0},
        {"kernel": "tree_attention", "shape": "t", "backend": "flash_attn varlen expanded", "rows": 8, "forward_ms": 1.0,
         "fwd_bwd_ms": 3.2},
        {"kernel": "tree_attention", "shape": "t", "backend": "sdpa flash expanded", "rows": 8, "forward_ms": 1.0,
         "fwd_bwd_ms": 2.0},
        {"kernel": "tree_attention", "shape": "t", "backend": "fa3 varlen expanded", "error": "RuntimeError: boom"},
        {"kernel": "matmul", "shape": "m", "backend": "torch.mm", "forward_ms": 1.0, "tflops": 700.0},
        {"kernel": "matmul", "shape": "m", "backend": "batch-invariant mm_t", "forward_ms": 1.25, "tflops": 560.0},
    ]
    md = bench_kernels.markdown({"mode": "gpu", "env": {"device": "x"}, "rows": rows, "skipped": ["gdn big"]})
    assert "| GDN forward+backward: harts triton / fla | s | 1.20 |" in md
    assert "| GDN forward: harts triton / fla | s | 1.50 |" in md
    # FA3 failed: the ratios use the next baseline present, FA2
    assert "equal work: triton expanded / flash_attn varlen expanded | t | 1.25 | <= 1.3 |" in md
    assert "tree vs expanded: triton tree / flash_attn varlen expanded | t | 0.62 |" in md
    assert "| batch-invariant matmul time / torch.mm | m | 1.25 |" in md and "| 560.0 |" in md
    assert "RuntimeError: boom" in md and "Skipped (time budget): gdn big" in md
