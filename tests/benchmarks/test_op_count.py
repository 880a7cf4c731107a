"""benchmarks.op_count: the GPU path reads nothing back from the device inside a microbatch, and its
launches do not grow with the number of experts (the per-expert loop's do)."""
from __future__ import annotations

import pytest

from benchmarks.op_count import count


@pytest.fixture(scope="module")
def counts():
    return {(path, E): count(experts=E, top_k=2, rows=256, layers=4, path=path)
            for path in ("cpu", "gpu") for E in (8, 16)}


def test_gpu_path_has_no_host_read_and_nothing_grows_with_the_experts(counts):
    small, large = counts["gpu", 8], counts["gpu", 16]
    assert small["host_reads"] == large["host_reads"] == 0
    assert small["gemm_ops"] == large["gemm_ops"] and small["aten_ops"] == large["aten_ops"]


def test_cpu_path_reads_the_group_bounds_once_per_moe_layer(counts):
    assert counts["cpu", 8]["host_reads"] == counts["cpu", 16]["host_reads"] == 4  # 4 MoE layers
    assert counts["cpu", 16]["gemm_ops"] > counts["cpu", 8]["gemm_ops"]  # expert by expert
    assert counts["gpu", 8]["gemm_ops"] < counts["cpu", 8]["gemm_ops"]
