"""Executor on the planner's plans: tree (windows=False) vs trajectory-expanded (sharing=False).

The same shapes as tests/trainer/test_executor.py, planned by `planner_service.planner.plan_step` from
`planner_service.ingest.forest_from_json` and validated by `plan.validator` before running.
"""
from __future__ import annotations

import numpy as np
import pytest

from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from tests.trainer.test_executor import CASES, C, _case, _executor
from trainer.models import build_model
from trainer.objectives import ObjectiveConfig
from trainer.verify import compare_runs, run_and_capture



@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=1)


def _doc(trajs, kw, seed=0):
    rng = np.random.default_rng(seed)
    tree_of = kw.get("tree_of") or [""] * len(trajs)
    out = []
    for i, t in enumerate(trajs):
        item = {"id": f"t{i}", "tree_id": tree_of[i], "tokens": t, "advantage": float(rng.normal()),
                "old_logprobs": (rng.normal(size=len(t)) - 5.5).tolist(), "ref_logprobs": (rng.normal(size=len(t)) - 5.5).tolist()}
        if "loss_masks" in kw:
            item["loss_mask"] = kw["loss_masks"][i]
        out.append(item)
    return {"batch_id": "test", "vocab_size": 256, "trajectories": out}


@pytest.mark.parametrize("case", CASES)
def test_planner_tree_plan_matches_expanded(model, case):
    trajs, kw = _case(case)
    forest = forest_from_json(_doc(trajs, kw))
    budget = 48 if "groups" in kw else 4096
    expanded = plan_step(forest, PlanConfig(chunk_size=C, microbatch_tokens=4096, sharing=False, windows=False, all_positions=True))
    tree = plan_step(forest, PlanConfig(chunk_size=C, microbatch_tokens=budget, windows=False, all_positions=True))
    if "groups" in kw:
        assert len(tree.ranks[0].microbatches) > 1 and tree.header.stats.duplicated_tokens > 0
    ex = _executor(model, objective=ObjectiveConfig(kl_coef=0.05, entropy_coef=0.01, aggregation="seq-mean-token-sum"))
    ex.cfg.validate = "full"
    ref, g_ref = run_and_capture(ex, expanded)
    got, g_got = run_and_capture(ex, tree)
    rep = compare_runs(ref, g_ref, got, g_got)
    assert rep["grad_max_abs"] > 0 and abs(ref.loss) > 0
    assert rep["logprob_positions"] == sum(len(t) - 1 for t in trajs)
    assert rep["logprob_max_abs_diff"] <= 1e-5, rep
    assert rep["linear_outputs_bitwise_equal"], rep
    assert rep["expert_load_equal"], rep
    assert rep["loss_diff"] <= 1e-6 * max(1.0, abs(ref.loss)), rep
    assert rep["grad_rel_diff_max"] <= 1e-5, {k: v for k, v in rep["grad_rel_diff"].items() if v > 1e-5}


def test_planner_no_replay_differs_on_unaligned_branch(model):
    trajs, kw = _case("unaligned-branch")
    forest = forest_from_json(_doc(trajs, kw))
    ex = _executor(model)
    ref, g_ref = run_and_capture(ex, plan_step(forest, PlanConfig(chunk_size=C, sharing=False, windows=False, all_positions=True)))
    got, g_got = run_and_capture(ex, plan_step(forest, PlanConfig(chunk_size=C, replay=False, windows=False, all_positions=True)))
    rep = compare_runs(ref, g_ref, got, g_got)
    assert not rep["linear_outputs_bitwise_equal"] and rep["linear_outputs_max_abs_diff"] > 0
    assert rep["logprob_max_abs_diff"] <= 1e-4
