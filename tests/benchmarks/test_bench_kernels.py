"""`benchmarks.bench_kernels.run(quick)`: the suite's kernels entry times the reference on CPU."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_kernels


def test_run_quick_times_reference_forward_and_backward():
    res = bench_kernels.run(quick=True)
    json.dumps(res)  # the suite writes it as JSON
    want = ["ref"] if not torch.cuda.is_available() else ["ref", "triton"]
    assert [r["backend"] for r in res["rows"]] == [b for b in want for _ in range(2)]
    assert {r["pass"] for r in res["rows"]} == {"forward", "forward+backward"}
    for r in res["rows"]:
        assert r["ms"] > 0 and r["tokens_per_s"] == pytest.approx(res["T"] / (r["ms"] / 1e3))
