"""Activation checkpointing per decoder block (`executor.activation_checkpointing`): the same bits as
without it on the CPU (log-probs, loss, every gradient), windows and window recomputation included,
and fewer saved bytes."""
from __future__ import annotations

import pytest
import torch

from benchmarks.peer import SavedTensorBytes
from planner_service.planner import PlanConfig
from planner_service.planner.build import build_plan
from tests.trainer.test_windows import C, OBJECTIVE, _chain_forest, _chain_partition
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.verify import run_and_capture


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=4)


def _run(model, plan, mode: str, *, backward: bool = True):
    ex = Executor(model, ExecutorConfig(chunk_size=C, want_logprobs=True, want_entropies=True, objective=OBJECTIVE,
                                        aux_loss_coef=0.01, check_recompute=True, activation_checkpointing=mode))
    return run_and_capture(ex, plan, backward=backward)


@pytest.mark.parametrize("recompute", [False, True], ids=["windows", "windows+recompute"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointing_is_bitwise_equal_to_none(model, mode, recompute):
    f, segs, base = _chain_forest()
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True),
                      _chain_partition(f, segs, base, recompute=recompute))
    ref, g_ref = _run(model, plan, "none")
    got, g_got = _run(model, plan, mode)
    assert got.windows == ref.windows >= 3 and got.recomputed_microbatches == ref.recomputed_microbatches
    assert got.loss == ref.loss and got.aux_loss == ref.aux_loss
    assert (got.expert_load == ref.expert_load).all()
    for tid, lp in ref.logprobs.items():
        assert lp.tobytes() == got.logprobs[tid].tobytes()
    differ = [n for n in g_ref if not torch.equal(g_ref[n], g_got[n])]
    assert not differ, differ


def test_full_checkpointing_keeps_fewer_bytes(model):
    f, segs, base = _chain_forest()
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True), _chain_partition(f, segs, base))
    peaks = {}
    for mode in ("none", "selective", "full"):
        gauge = SavedTensorBytes(model)
        with gauge:
            _run(model, plan, mode)
        peaks[mode] = gauge.peak
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


def test_unknown_mode_is_one_line():
    with pytest.raises(ValueError, match="activation_checkpointing: expected one of"):
        ExecutorConfig(activation_checkpointing="some")
