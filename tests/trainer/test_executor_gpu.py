"""The executor on CUDA (marker `gpu`: skipped without a GPU): what the GPU path guarantees.

- Determinism: the same plan run twice gives bitwise equal log-probs, loss, expert loads and every
  gradient, in fp32 and bf16 (`ExecutorConfig.deterministic`, on by default on CUDA: no float
  atomics in our code, torch's deterministic algorithms for the rest), with no warning.
- fp32: tree vs expanded log-probs within 1e-5 and gradients within 1e-5 relative (IEEE fp32 dots
  in the Triton kernels for fp32 inputs; cuBLAS fp32 without TF32, torch's default).
- bf16: tree vs expanded within the bf16 figures below (rounding that depends on the row count in
  cuBLAS and the grouped GEMMs, as any repacking of a bf16 batch shows).
- With `batch_invariant` (fixed-tile GEMMs, `kernels.batch_invariant`): bf16 tree and expanded
  log-probs bitwise equal, when the installation has the kernels.
- With `compile` (the elementwise chains fused by torch.compile): deterministic as above, fp32
  within 1e-5 of the eager kernels.

The figures each test sees are appended to $HARTS_GPU_FIGURES (JSON lines) when that is set, so
that `scripts/gpu_check.sh` returns them.
"""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch

from tests.executor_helpers import make_plan
from tests.trainer.test_executor import _case
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.verify import compare_runs, run_and_capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
C = 16  # the Triton kernel needs C >= 16
CASES = ["unaligned-branch", "nested", "ends-inside-tree", "duplicated-prefix-across-microbatches"]
#: bf16 tree vs expanded bounds (log-prob max abs diff, nats)
BF16_LOGPROB_BOUND = 0.25


def _record(test: str, **figures) -> None:
    path = os.environ.get("HARTS_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **figures}, default=float) + "\n")


def _plans(case: str):
    trajs, kw = _case(case)
    kw = {k: v for k, v in kw.items() if k not in ("old_logprobs", "ref_logprobs")}
    expanded = make_plan(trajs, chunk_size=C, sharing=False, all_positions=True,
                         **{k: v for k, v in kw.items() if k != "groups"})
    return expanded, make_plan(trajs, chunk_size=C, all_positions=True, **kw)


def _executor(dtype: str, **kw) -> Executor:
    model = build_model("tiny-deep", seed=0, dtype=getattr(torch, dtype)).cuda()
    return Executor(model, ExecutorConfig(chunk_size=C, backend="triton", want_logprobs=True, capture_linear=True,
                                          validate="none", aux_loss_coef=0.01, **kw))


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_plan_twice_is_bitwise_equal(dtype, compile):
    ex = _executor(dtype, compile=compile)
    expanded, tree = _plans("nested")
    if compile:  # compile the chains first: what Inductor says while compiling is not a step's warning
        run_and_capture(ex, expanded)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for plan in (expanded, tree):
            a, ga = run_and_capture(ex, plan)
            b, gb = run_and_capture(ex, plan)
            assert a.loss == b.loss and np.array_equal(a.expert_load, b.expert_load)
            for tid in a.logprobs:
                assert a.logprobs[tid].tobytes() == b.logprobs[tid].tobytes(), tid
            differ = [n for n in ga if not torch.equal(ga[n], gb[n])]
            assert not differ, differ
    _record(f"same_plan_twice[{dtype}-{'compiled' if compile else 'eager'}]", bitwise=True)


def test_compiled_chains_match_eager_fp32():
    """`executor.compile` (the elementwise chains fused by torch.compile) against the eager kernels."""
    _, tree = _plans("nested")
    eager, g_eager = run_and_capture(_executor("float32"), tree)
    got, g_got = run_and_capture(_executor("float32", compile=True), tree)
    rep = compare_runs(eager, g_eager, got, g_got)
    _record("compiled_vs_eager_fp32", logprob=rep["logprob_max_abs_diff"], grad=rep["grad_rel_diff_max"])
    assert rep["expert_load_equal"], rep
    assert rep["logprob_max_abs_diff"] <= 1e-5 and rep["grad_rel_diff_max"] <= 1e-5, rep


@pytest.mark.parametrize("case", CASES)
def test_tree_matches_expanded_fp32(case):
    ex = _executor("float32")
    expanded, tree = _plans(case)
    ref, g_ref = run_and_capture(ex, expanded)
    got, g_got = run_and_capture(ex, tree)
    rep = compare_runs(ref, g_ref, got, g_got)
    _record(f"tree_vs_expanded_fp32[{case}]", logprob=rep["logprob_max_abs_diff"], grad=rep["grad_rel_diff_max"],
            linear_bitwise=rep["linear_outputs_bitwise_equal"], linear=rep["linear_outputs_max_abs_diff"])
    assert rep["expert_load_equal"], rep
    assert rep["logprob_max_abs_diff"] <= 1e-5, rep
    assert rep["grad_rel_diff_max"] <= 1e-5, rep


@pytest.mark.parametrize("case", CASES)
def test_tree_matches_expanded_bf16(case):
    ex = _executor("bfloat16")
    expanded, tree = _plans(case)
    ref, g_ref = run_and_capture(ex, expanded)
    got, g_got = run_and_capture(ex, tree)
    rep = compare_runs(ref, g_ref, got, g_got)
    _record(f"tree_vs_expanded_bf16[{case}]", logprob=rep["logprob_max_abs_diff"], grad=rep["grad_rel_diff_max"],
            expert_load_equal=rep["expert_load_equal"])
    assert np.isfinite(rep["logprob_max_abs_diff"]) and rep["logprob_max_abs_diff"] <= BF16_LOGPROB_BOUND, rep


def _invariant_available() -> bool:
    try:
        import kernels.batch_invariant  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _invariant_available(), reason="kernels.batch_invariant is not installed")
@pytest.mark.parametrize("case", CASES)
def test_batch_invariant_bf16_tree_equals_expanded_bitwise(case):
    ex = _executor("bfloat16", batch_invariant=True)
    expanded, tree = _plans(case)
    ref = ex.run_step(expanded, backward=False)
    got = ex.run_step(tree, backward=False)
    differ = [tid for tid in ref.logprobs if ref.logprobs[tid].tobytes() != got.logprobs[tid].tobytes()]
    worst = max(float(np.nanmax(np.abs(ref.logprobs[t] - got.logprobs[t]))) for t in ref.logprobs)
    _record(f"batch_invariant_bf16[{case}]", trajectories_differing=len(differ), logprob=worst)
    assert not differ, (differ, worst)
