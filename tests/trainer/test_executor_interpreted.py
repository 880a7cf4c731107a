"""The executor's GPU code path on the CPU: FAST primitives (torch's activations, grouped-GEMM
experts through torch's CPU implementation), the chunked head, and the Triton gated delta rule and
tree attention under the Triton interpreter. What only CUDA runs (cuBLAS, the grouped GEMM's
kernel, pinned copies) is left to tests/trainer/test_executor_gpu.py; everything around it is
checked here, so that a GPU run does not fail on code the CPU could have run.

Runs only with TRITON_INTERPRET=1 set before triton loads (`test_executor.py` starts it in a
subprocess); otherwise skipped.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs on the CPU under TRITON_INTERPRET=1 (see module docstring)", allow_module_level=True)

from tests.trainer.test_executor_gpu import C, _plans  # noqa: E402
from trainer.executor import Executor, ExecutorConfig  # noqa: E402
from trainer.models import build_model  # noqa: E402
from trainer.models.ops import FAST  # noqa: E402
from trainer.verify import compare_runs, run_and_capture  # noqa: E402


def test_tree_matches_expanded_on_the_gpu_code_path():
    model = build_model("tiny", seed=0, dtype=torch.float32)
    ex = Executor(model, ExecutorConfig(chunk_size=C, backend="triton", attention_backend="triton", head="chunked",
                                        head_chunk=64, want_logprobs=True, capture_linear=True, validate="none",
                                        aux_loss_coef=0.01))
    ex.run_options = dataclasses.replace(ex.run_options, ops=FAST)  # the CPU would pick EXACT
    expanded, tree = _plans("nested")
    ref, g_ref = run_and_capture(ex, expanded)
    got, g_got = run_and_capture(ex, tree)
    rep = compare_runs(ref, g_ref, got, g_got)
    print(f"tree vs expanded: log-probs {rep['logprob_max_abs_diff']:.2g}, gradients {rep['grad_rel_diff_max']:.2g} relative")
    # the GPU test's fp32 bounds; seen: log-probs 4.8e-7, gradients 7.1e-7 relative
    # (TRITON_INTERPRET=1 pytest tests/trainer/test_executor_interpreted.py, 2 CPU cores, 2026-12-04)
    assert rep["expert_load_equal"], rep
    assert rep["logprob_max_abs_diff"] <= 1e-5 and rep["grad_rel_diff_max"] <= 1e-5, rep
