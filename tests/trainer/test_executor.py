"""Executor exactness (Invariant E, docs/design/numerics.md): tree plans vs trajectory-expanded plans.

Plans come from `tests/executor_helpers.make_plan`, a small independent plan maker, so these tests
do not depend on the planner (tests/trainer/test_executor_planner.py runs the planner's plans).
Targets (fp32, CPU): linear-attention outputs bitwise equal, log-prob max abs diff <= 1e-5,
relative gradient diff <= 1e-5, expert-load counts equal.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from proto.arrays import pack
from tests.executor_helpers import make_plan
from tests.triton_interpreter import run_under_interpreter
from trainer.executor import Executor, ExecutorConfig, train_step
from trainer.loss import load_balancing_loss
from trainer.layout import layout_from_sequences
from trainer.models import RunOptions, build_model
from trainer.objectives import ObjectiveConfig
from trainer.verify import compare_runs, run_and_capture

C = 8



@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=0)


def _rand(rng, n):
    return rng.integers(0, 256, n).tolist()


def _case(name: str):
    """(trajectories, make_plan kwargs) of a named tree shape."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name == "aligned-branch":
        p = _rand(rng, 16)
        return [p + _rand(rng, n) for n in (12, 20, 3)], {}
    if name == "unaligned-branch":
        p = _rand(rng, 21)
        return [p + _rand(rng, n) for n in (30, 17, 5)], {}
    if name == "nested":
        p = _rand(rng, 7)
        x = p + [101, 102]
        return [x + [103] + _rand(rng, 9), x + [201] + _rand(rng, 14), p + [251] + _rand(rng, 11)], {}
    if name == "short-segments-in-one-chunk":
        p = _rand(rng, 2)
        a = p + [11, 12]
        return [a + [13, 14, 15] + _rand(rng, 10), a + [23], p + [31] + _rand(rng, 12), a + [13, 14, 16, 17]], {}
    if name == "ends-inside-tree":
        base = _rand(rng, 40)
        return [base, base[:10], base[:21], base[:33] + _rand(rng, 4), base[:24]], {}
    if name == "several-trees":
        pa, pb = _rand(rng, 13), _rand(rng, 9)
        trajs = [pa + _rand(rng, 10), pa + _rand(rng, 6), pb + _rand(rng, 20), pb + _rand(rng, 2)]
        return trajs, {"tree_of": ["a", "a", "b", "b"]}
    if name == "duplicated-prefix-across-microbatches":
        p = _rand(rng, 19)
        trajs = [p + _rand(rng, n) for n in (9, 14, 22, 5)]
        return trajs, {"groups": [[0, 1], [2], [3]]}
    if name == "loss-mask-holes":
        p = _rand(rng, 11)
        trajs = [p + _rand(rng, n) for n in (25, 13, 30)]
        masks = [rng.integers(0, 2, len(t)).tolist() for t in trajs]
        old = [(rng.normal(size=len(t)) - 5.5).tolist() for t in trajs]
        ref = [(rng.normal(size=len(t)) - 5.5).tolist() for t in trajs]
        kw = {"loss_masks": masks, "old_logprobs": old, "ref_logprobs": ref, "advantages": [1.0, -0.5, 2.0], "weights": [1.0, 0.5, 2.0]}
        return trajs, kw
    raise KeyError(name)


CASES = ["aligned-branch", "unaligned-branch", "nested", "short-segments-in-one-chunk", "ends-inside-tree",
         "several-trees", "duplicated-prefix-across-microbatches", "loss-mask-holes"]


def _executor(model, **kw):
    obj = kw.pop("objective", ObjectiveConfig())
    return Executor(model, ExecutorConfig(chunk_size=C, want_logprobs=True, capture_linear=True, objective=obj, validate="none", **kw))


@pytest.mark.parametrize("case", CASES)
def test_tree_matches_expanded(model, case):
    trajs, kw = _case(case)
    obj = ObjectiveConfig(kl_coef=0.1, entropy_coef=0.01, aggregation="seq-mean-token-mean") if "ref_logprobs" in kw else ObjectiveConfig()
    ex = _executor(model, objective=obj)
    ref, g_ref = run_and_capture(ex, make_plan(trajs, chunk_size=C, sharing=False, all_positions=True, **{k: v for k, v in kw.items() if k != "groups"}))
    got, g_got = run_and_capture(ex, make_plan(trajs, chunk_size=C, all_positions=True, **kw))
    rep = compare_runs(ref, g_ref, got, g_got)
    assert rep["logprob_positions"] == sum(len(t) - 1 for t in trajs)
    assert rep["logprob_max_abs_diff"] <= 1e-5, rep
    assert rep["linear_outputs_bitwise_equal"], rep
    assert rep["linear_layers_compared"] == [0, 1, 2]
    assert rep["expert_load_equal"] and rep["expert_load_total"] == 2 * 4 * sum(len(t) for t in trajs)
    assert rep["loss_diff"] <= 1e-6 * max(1.0, abs(ref.loss)), rep
    assert rep["grad_rel_diff_max"] <= 1e-5, {k: v for k, v in rep["grad_rel_diff"].items() if v > 1e-5}


@pytest.mark.parametrize("case", ["unaligned-branch", "ends-inside-tree"])
def test_deep_model_linear_layers_after_attention_stay_bitwise(case):
    """tiny-deep has full attention at layers 3 and 7: linear layers 4-6 read attention outputs."""
    model = build_model("tiny-deep", seed=2)
    trajs, kw = _case(case)
    ex = _executor(model)
    ref, g_ref = run_and_capture(ex, make_plan(trajs, chunk_size=C, sharing=False, all_positions=True))
    got, g_got = run_and_capture(ex, make_plan(trajs, chunk_size=C, all_positions=True, **kw))
    rep = compare_runs(ref, g_ref, got, g_got)
    assert rep["linear_layers_compared"] == [0, 1, 2, 4, 5, 6]
    assert rep["linear_outputs_bitwise_equal"] and rep["logprob_max_abs_diff"] == 0.0, rep
    assert rep["grad_rel_diff_max"] <= 1e-5


def test_no_replay_breaks_bitwise_equality_on_unaligned_branches(model):
    trajs, _ = _case("unaligned-branch")
    ex = _executor(model)
    ref, g_ref = run_and_capture(ex, make_plan(trajs, chunk_size=C, sharing=False, all_positions=True))
    got, g_got = run_and_capture(ex, make_plan(trajs, chunk_size=C, replay=False, all_positions=True))
    rep = compare_runs(ref, g_ref, got, g_got)
    assert not rep["linear_outputs_bitwise_equal"]
    assert 0 < rep["linear_outputs_max_abs_diff"] < 1e-4
    assert rep["logprob_max_abs_diff"] <= 1e-4


def test_expanded_plan_equals_direct_model_forward(model):
    trajs, _ = _case("unaligned-branch")
    ex = _executor(model)
    res = ex.run_step(make_plan(trajs, chunk_size=C, sharing=False, all_positions=True), backward=False)
    layout = layout_from_sequences(trajs, conv_kernel=4, chunk_size=C)
    with torch.no_grad():
        logits = model.logits(model(layout, RunOptions(linear_fn=ex.run_options.linear_fn, chunk_size=C)).hidden).float()
    lp = torch.log_softmax(logits, -1)[layout.logprobs.row, layout.logprobs.label].double().numpy()
    got = np.concatenate([res.logprobs[f"t{t}"] for t in range(len(trajs))])
    np.testing.assert_allclose(got, lp, rtol=0, atol=1e-6)


def test_loss_positions_only_and_gradient_accumulation(model):
    """Microbatch split (duplicated prefix) vs one microbatch: same loss and gradients."""
    trajs, kw = _case("loss-mask-holes")
    ex = _executor(model, objective=ObjectiveConfig(kl_coef=0.1, aggregation="token-mean"))
    one, g1 = run_and_capture(ex, make_plan(trajs, chunk_size=C, **kw))
    split, g2 = run_and_capture(ex, make_plan(trajs, chunk_size=C, groups=[[0], [1, 2]], **kw))
    rep = compare_runs(one, g1, split, g2)
    assert split.microbatches == 2 and rep["loss_diff"] <= 1e-6 and rep["grad_rel_diff_max"] <= 1e-5
    n_loss = sum(sum(m[1:]) for m in kw["loss_masks"])
    assert np.sum([np.isfinite(v).sum() for v in one.logprobs.values()]) == n_loss


def test_optimizer_step_updates_weights():
    model = build_model("tiny", seed=3)
    trajs, _ = _case("nested")
    ex = _executor(model)
    before = model.lm_head.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    train_step(ex, make_plan(trajs, chunk_size=C), opt)
    assert not torch.equal(before, model.lm_head.weight)
    assert all(p.grad is None for p in model.parameters())


def test_aux_loss_weights_rows_by_occurrence(model):
    """Tree aux loss (occurrence-weighted) equals the expanded rows' aux loss, and transformers'."""
    transformers_moe = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    trajs, _ = _case("unaligned-branch")
    ex = _executor(model)
    tree = ex.run_step(make_plan(trajs, chunk_size=C), backward=False)
    flat = ex.run_step(make_plan(trajs, chunk_size=C, sharing=False), backward=False)
    assert abs(tree.aux_loss - flat.aux_loss) <= 1e-6
    layout = layout_from_sequences(trajs, conv_kernel=4, chunk_size=C)
    with torch.no_grad():
        cap = model(layout, RunOptions(linear_fn=ex.run_options.linear_fn, chunk_size=C))
    mine = load_balancing_loss(cap.router_probs, cap.router_topk, layout.occurrence, 8, 2)
    theirs = transformers_moe.load_balancing_loss_func(tuple(p.log() for p in cap.router_probs.values()), 8, 2)
    assert abs(float(mine) - float(theirs)) <= 1e-6
    assert abs(float(mine) - flat.aux_loss) <= 1e-6


def test_rejects_plans_for_another_model(model):
    trajs, _ = _case("nested")
    ex = _executor(model)
    with pytest.raises(ValueError, match="chunk_size: expected 8 .*got 16"):
        ex.run_step(make_plan(trajs, chunk_size=16))
    with pytest.raises(ValueError, match="vocab_size: expected 256 .*got 512"):
        ex.run_step(make_plan(trajs, chunk_size=C, vocab_size=512))
    plan = make_plan(trajs, chunk_size=C)
    plan.ranks[0].microbatches[0].import_row = pack([0], "int32")
    with pytest.raises(ValueError, match="import"):
        ex.run_step(plan)


@pytest.mark.slow
def test_the_gpu_code_path_under_the_triton_interpreter():
    """tests/trainer/test_executor_interpreted.py in a subprocess with TRITON_INTERPRET=1 set before
    triton loads: FAST primitives, the chunked head and both Triton kernels, tree vs expanded."""
    run_under_interpreter("trainer/test_executor_interpreted.py")
