"""The float64 oracle: a float64 model computes in float64 end to end (`compute_dtype`), and
`harts verify --f64-reference` measures each fp32 run against it (trainer/verify.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harts_cli.main import main
from tests.executor_helpers import make_plan
from trainer.executor import Executor, ExecutorConfig, StepResult
from trainer.models import build_model
from kernels.dtypes import compute_dtype
from trainer.objectives import ObjectiveConfig
from trainer.verify import compare_runs, f64_reference_report, grad_rel_errors, run_and_capture

C = 8


def _trajs(seed: int = 0) -> list[list[int]]:
    """A small tree: shared prefixes branching inside and at chunk boundaries."""
    rng = np.random.default_rng(seed)
    p = rng.integers(0, 256, 21).tolist()
    q = p[:13] + rng.integers(0, 256, 4).tolist()
    return [p + rng.integers(0, 256, n).tolist() for n in (30, 17, 5)] + [q, p[:9]]


def test_compute_dtype_is_at_least_fp32():
    assert compute_dtype(torch.bfloat16) == torch.float32
    assert compute_dtype(torch.float16) == torch.float32
    assert compute_dtype(torch.float32) == torch.float32
    assert compute_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64


@pytest.mark.parametrize("spec", ["tiny", "tiny-deep"])
def test_f64_tree_matches_expanded_to_1e12(spec):
    """In float64 the tree and expanded runs differ only by float64 reassociation (with any fp32
    upcast left in the model they differ by ~2e-7, the fp32 rounding of that step)."""
    trajs = _trajs()
    rng = np.random.default_rng(1)
    adv = rng.normal(size=len(trajs)).tolist()
    old = [(-rng.random(len(t)) * 5).tolist() for t in trajs]
    model = build_model(spec, seed=1).double()
    obj = ObjectiveConfig(kl_coef=0.1, entropy_coef=0.01)
    ex = Executor(model, ExecutorConfig(chunk_size=C, objective=obj, aux_loss_coef=0.01, want_logprobs=True,
                                        capture_linear=True, validate="none"))
    kw = dict(chunk_size=C, advantages=adv, old_logprobs=old, ref_logprobs=old, all_positions=True)
    ref, g_ref = run_and_capture(ex, make_plan(trajs, sharing=False, **kw))
    got, g_got = run_and_capture(ex, make_plan(trajs, **kw))
    assert all(g.dtype == torch.float64 for g in g_ref.values())
    assert all(x.dtype == np.float64 for by_layer in ref.linear_outputs.values() for x in by_layer.values())
    rep = compare_runs(ref, g_ref, got, g_got)
    assert rep["logprob_positions"] == sum(len(t) - 1 for t in trajs)
    assert rep["logprob_max_abs_diff"] <= 1e-12, rep["logprob_max_abs_diff"]
    assert rep["loss_diff"] <= 1e-14, rep["loss_diff"]
    assert rep["grad_rel_diff_max"] <= 1e-12, {k: v for k, v in rep["grad_rel_diff"].items() if v > 1e-12}
    assert rep["expert_load_equal"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_f64_gradient_matches_central_differences(dtype):
    """A float64 step's gradient is the derivative of its loss: (L(w + hd) - L(w - hd)) / 2h matches
    <grad, d> to ~1.5e-9 relative at h = 1e-7 (rounding ~1e-16 |L| / (h |<grad, d>|); the
    truncation error grows as h^2: 2.5e-8 at h = 1e-6). A value rounded to fp32 anywhere on the path
    (an fp32 upcast left in a float64 model) puts ~1e-9 noise in L, ~1e-2 in the quotient: the fp32
    model shows it. Old log-probs make L the surrogate itself (without them
    the ratio is exp(lp - lp.detach()) = 1 in value); wide clips keep it smooth."""
    trajs = _trajs(3)
    rng = np.random.default_rng(4)
    adv = rng.normal(size=len(trajs)).tolist()
    old = [(-5.5 + 0.3 * rng.normal(size=len(t))).tolist() for t in trajs]
    model = build_model("tiny", seed=5).to(dtype)
    obj = ObjectiveConfig(entropy_coef=0.01, kl_coef=0.1, clip_low=0.9, clip_high=10.0)
    ex = Executor(model, ExecutorConfig(chunk_size=C, objective=obj, aux_loss_coef=0.01, validate="none"))
    plan = make_plan(trajs, chunk_size=C, advantages=adv, old_logprobs=old, ref_logprobs=old)
    res, grads = run_and_capture(ex, plan)
    gen = torch.Generator().manual_seed(6)
    d = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in model.named_parameters()}
    slope = sum(float((grads[n].double() * d[n]).sum()) for n in d)
    w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    h = 1e-7

    def loss_at(t: float) -> float:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(w0[n] + t * d[n])
        r = ex.run_step(plan, backward=False)
        assert np.array_equal(r.expert_load, res.expert_load)  # no routing flip: L is smooth here
        return r.loss

    err = abs((loss_at(h) - loss_at(-h)) / (2 * h) - slope) / abs(slope)
    if dtype == torch.float64:
        assert err < 1e-8, err
    else:
        assert err > 1e-4, err


def _result(loss: float, logprobs: dict[str, np.ndarray]) -> StepResult:
    return StepResult(loss=loss, policy_loss=loss, kl=0.0, entropy_bonus=0.0, aux_loss=0.0,
                      expert_load=np.zeros((0, 1), np.int64), computed_tokens=1, expanded_tokens=1,
                      loss_tokens=1.0, microbatches=1, seconds=0.0, logprobs=logprobs)


def test_grad_rel_errors_floor_and_raw():
    ref = {"a": torch.tensor([1.0, -2.0], dtype=torch.float64), "b": torch.tensor([1e-6, 0.0], dtype=torch.float64)}
    got = {"a": torch.tensor([1.0, -2.0 + 2**-10]), "b": torch.tensor([3e-6, 0.0])}
    floored, raw, top = grad_rel_errors(ref, got)
    assert top == 2.0
    assert floored["a"] == pytest.approx(2**-10 / 2.0, rel=1e-12)
    # b is below the floor (1% of the largest |g| = 0.02): its error is measured against the floor
    b_err = float(torch.tensor(3e-6, dtype=torch.float32).double()) - 1e-6
    assert floored["b"] == pytest.approx(b_err / 0.02, rel=1e-9)
    assert raw["b"] == pytest.approx(b_err / 1e-6, rel=1e-9)


def test_f64_reference_report_values():
    g64 = {"w": torch.tensor([1.0, 1.0], dtype=torch.float64), "A_log": torch.tensor([0.5, 0.0], dtype=torch.float64)}
    g_exp = {"w": torch.tensor([1.0, 1.0]), "A_log": torch.tensor([0.5 + 2**-8, 0.0])}
    g_tree = {"w": torch.tensor([1.0 + 2**-12, 1.0]), "A_log": torch.tensor([0.5, 0.0])}
    lp64 = {"t": np.array([-1.0, np.nan, -2.0])}
    rep = f64_reference_report(
        _result(1.0, lp64), g64,
        {"tree": (_result(1.25, {"t": np.array([-1.0, np.nan, -2.5])}), g_tree),
         "expanded": (_result(1.0, {"t": np.array([-1.125, np.nan, -2.0])}), g_exp)},
    )
    assert rep["grad_rel_err_tree"] == 2**-12 and rep["worst_param_tree"] == "w"
    assert rep["grad_rel_err_expanded"] == 2**-8 / 0.5 and rep["worst_param_expanded"] == "A_log"
    assert rep["logprob_max_abs_err_tree"] == 0.5 and rep["logprob_max_abs_err_expanded"] == 0.125
    assert rep["loss_err_tree"] == 0.25 and rep["loss_err_expanded"] == 0.0
    # tree and expanded differ most on A_log, where the expanded run (not the tree) is off
    assert rep["diff_param"] == "A_log" and rep["diff_param_err_tree"] == 0.0
    assert rep["diff_param_err_expanded"] == rep["grad_rel_err_expanded"]
    assert rep["at_worst_params"] == {"w": {"tree": 2**-12, "expanded": 0.0, "tree_vs_expanded": 2**-12},
                                      "A_log": {"tree": 0.0, "expanded": 2**-7, "tree_vs_expanded": 2**-8 / (0.5 + 2**-8)}}
    json.dumps(rep)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    trajs = _trajs()
    rng = np.random.default_rng(0)
    doc = {"batch_id": "f64", "vocab_size": 256, "trajectories": [
        {"id": f"t{i}", "tokens": t, "advantage": float(rng.normal()), "loss_mask": [0] * 9 + [1] * (len(t) - 9)}
        for i, t in enumerate(trajs)]}
    path = tmp_path_factory.mktemp("f64") / "batch.json"
    path.write_text(json.dumps(doc))
    return path


def test_verify_f64_reference(batch, capsys):
    assert main(["verify", str(batch), "--model", "tiny", "--chunk-size", "8", "--microbatch-tokens", "64", "--f64-reference"]) == 0
    rep = json.loads(capsys.readouterr().out)
    f64 = rep["f64_reference"]
    assert {"grad_rel_err_tree", "grad_rel_err_expanded", "worst_param_tree", "worst_param_expanded",
            "logprob_max_abs_err_tree", "logprob_max_abs_err_expanded", "diff_param"} <= f64.keys()
    assert rep["targets_met"] is True  # unchanged definition: tree vs expanded only
    for run in ("tree", "expanded"):
        assert 0 < f64[f"grad_rel_err_{run}"] < 1e-4 and np.isfinite(f64[f"grad_rel_err_{run}"])
        assert 0 < f64[f"logprob_max_abs_err_{run}"] < 1e-4
        assert f64[f"worst_param_{run}"] in rep["grad_rel_diff"]
    # the tree-vs-expanded difference is explained by the two runs' own errors (triangle inequality;
    # the two measures scale by fp32 and float64 gradient maxima, equal to ~1e-6)
    assert f64["diff_param"] == max(rep["grad_rel_diff"], key=rep["grad_rel_diff"].get)
    assert f64["diff_param_rel_diff"] == rep["grad_rel_diff_max"]
    assert rep["grad_rel_diff_max"] <= (f64["diff_param_err_tree"] + f64["diff_param_err_expanded"]) * 1.001
