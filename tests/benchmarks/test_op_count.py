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


@pytest.mark.slow
def test_chain_launches_count_every_chain_eager_and_compiled():
    """`--chains`: each elementwise chain's calls in a microbatch (from the model's structure), its
    eager launches, and fewer launches compiled (Inductor compiles each chain here, ~10 s)."""
    got = count(experts=8, top_k=2, rows=256, layers=4, path="gpu", chains=True)["chain_launches"]
    calls = {name: c["calls"] for name, c in got["chains"].items()}
    # 4 layers (3 GDN, 1 attention), every FFN an MoE with a shared expert: two norms a layer and the
    # final one, attention's q/k norms; SwiGLU in each MoE's expert GEMMs and its shared expert; a router each
    assert calls == {"rms_norm": 2 * 4 + 1 + 2, "gdn_gates": 3, "gated_norm": 3, "rope": 2,
                     "swiglu": 2 * 4, "sigmoid_mul": 1 + 4, "router": 4}
    for name, c in got["chains"].items():
        assert 1 <= c["compiled_launches_per_call"] < c["eager_launches_per_call"], (name, c)
    assert got["compiled_launches"] < got["eager_launches"] / 3


def test_triton_path_counts_the_kernels_launches():
    """`--path gpu --triton` starts itself again under the Triton interpreter and counts the gated
    delta rule's Triton launches beside the aten ops (what a GPU microbatch launches)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.op_count", "--path", "gpu", "--triton", "--layers", "1",
                           "--experts", "4", "--top-k", "2", "--rows", "64"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["triton_launches"] > 0 and got["host_reads"] == 0
    assert got["gemm_ops"] < count(experts=4, top_k=2, rows=64, layers=1, path="gpu")["gemm_ops"]  # no PyTorch GDN
    assert 0 < got["launches"] < got["non_view_ops"] + got["triton_launches"]  # allocations launch nothing
