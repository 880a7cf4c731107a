"""Executor exactness on CUDA (marker `gpu`: skipped without a GPU).

Seen on an H200 (torch 2.11+cu130): fp32 with the "ref" and "triton" kernel backends gives bitwise
equal linear-attention outputs and log-probs between tree and expanded plans, gradients within
5.5e-6 (relative, trainer/verify.py); bf16 forward is bitwise equal too, while bf16 parameter
gradients (accumulated in bf16) differ by ~2% relative, as any repacking of a bf16 batch does.
"""
from __future__ import annotations

import pytest
import torch

from tests.executor_helpers import make_plan
from tests.trainer.test_executor import _case
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.verify import compare_runs, run_and_capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
C = 16  # the Triton kernel needs C >= 16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["ref", "triton"])
@pytest.mark.parametrize("case", ["unaligned-branch", "nested", "ends-inside-tree", "duplicated-prefix-across-microbatches"])
def test_tree_matches_expanded_on_cuda(case, backend, dtype):
    model = build_model("tiny-deep", seed=0, dtype=getattr(torch, dtype)).cuda()
    ex = Executor(model, ExecutorConfig(chunk_size=C, backend=backend, want_logprobs=True, capture_linear=True, validate="none"))
    trajs, kw = _case(case)
    kw = {k: v for k, v in kw.items() if k not in ("old_logprobs", "ref_logprobs")}
    ref, g_ref = run_and_capture(ex, make_plan(trajs, chunk_size=C, sharing=False, all_positions=True,
                                               **{k: v for k, v in kw.items() if k != "groups"}))
    got, g_got = run_and_capture(ex, make_plan(trajs, chunk_size=C, all_positions=True, **kw))
    rep = compare_runs(ref, g_ref, got, g_got)
    assert rep["linear_outputs_bitwise_equal"] and rep["expert_load_equal"], rep
    assert rep["logprob_max_abs_diff"] <= 1e-5, rep
    if dtype == "float32":
        assert rep["grad_rel_diff_max"] <= 1e-5, rep
