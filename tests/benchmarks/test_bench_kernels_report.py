"""`benchmarks.bench_kernels --gpu`: the CPU fallback runs and says what it is; the GPU report's
markdown computes the target ratios from the measured rows."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback runs only without CUDA")
def test_cpu_fallback_times_the_references_and_labels_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_kernels, "CPU_GDN_SHAPES", [("T=256 H=2", 256, 2, 2, 16)])
    monkeypatch.setattr(bench_kernels, "CPU_TREE_SHAPES", [("P=64 B=2 L=32", 64, 2, 32, 2, 1, 16)])
    res = bench_kernels.report(out_dir=tmp_path, quick=True, budget_s=1e9, reps=1)
    assert res["mode"] == "cpu-fallback" and "no GPU kernel was timed" in res["env"]["note"]
    backends = [r["backend"] for r in res["rows"]]
    assert backends[:1] == ["harts ref"] and "ref tree" in backends and "sdpa expanded" in backends
    assert all("error" not in r for r in res["rows"]), res["rows"]
    assert all(r["fwd_bwd_ms"] > 0 for r in res["rows"] if "fwd_bwd_ms" in r)
    md = (tmp_path / "kernels-cpu-fallback.md").read_text()
    assert "cpu-fallback" in md and "no GPU kernel was timed" in md
    assert json.loads((tmp_path / "kernels-cpu-fallback.json").read_text())["rows"] == json.loads(json.dumps(res["rows"]))


def test_gpu_markdown_reports_the_target_ratios():
    rows = [
        {"kernel": "gdn", "shape": "s", "N": 4, "backend": "harts triton", "forward_ms": 3.0, "fwd_bwd_ms": 12.0},
        {"kernel": "gdn", "shape": "s", "N": 4, "backend": "fla chunk_gated_delta_rule", "forward_ms": 2.0, "fwd_bwd_ms": 10.0},
        {"kernel": "tree_attention", "shape": "t", "backend": "triton expanded", "rows": 8, "forward_ms": 1.0, "fwd_bwd_ms": 4.0},
        {"kernel": "tree_attention", "shape": "t", "backend": "triton tree", "rows": 5, "forward_ms": 0.5, "fwd_bwd_ms": 2.0},
        {"kernel": "tree_attention", "shape": "t", "backend": "flash_attn varlen expanded", "rows": 8, "forward_ms": 1.0,
         "fwd_bwd_ms": 3.2},
        {"kernel": "tree_attention", "shape": "t", "backend": "sdpa expanded", "error": "RuntimeError: boom"},
    ]
    md = bench_kernels.markdown({"mode": "gpu", "env": {"device": "x"}, "rows": rows, "skipped": ["gdn big"]})
    assert "| GDN forward+backward: harts triton / fla | s | 1.20 |" in md
    assert "| GDN forward: harts triton / fla | s | 1.50 |" in md
    assert "equal work: triton expanded / flash_attn varlen expanded | t | 1.25 | <= 1.3 |" in md
    assert "tree vs expanded: triton tree / flash_attn varlen expanded | t | 0.62 |" in md
    assert "RuntimeError: boom" in md and "Skipped (time budget): gdn big" in md
