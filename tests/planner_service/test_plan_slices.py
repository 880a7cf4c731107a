"""Plan slices carry only their own rank's data: a slice's size does not grow with the
world size, its local tables map back to the step's, and a trainer runs it as before."""
from __future__ import annotations

import numpy as np
import pytest

from planner_service.planner import PlanConfig, plan_step
from proto.arrays import unpack
from plan.seal import open_sealed, seal, slice_plan
from plan.validator import PlanValidationError, validate_plan, validate_slice
from tests.planner_service.test_partition import make_forest


def _per_rank_forest(world: int, per_rank: int = 3):
    """`world` x `per_rank` equal trees: every rank gets the same work whatever the world size."""
    trajs, trees = [], []
    for t in range(world * per_rank):
        head = [(t * 7 + i) % 50 for i in range(20)]
        for b in range(2):
            trajs.append(head + [60 + b] * 30)
            trees.append(f"task{t:05d}")
    return make_forest(trajs, trees, vocab=256)


def test_slice_size_does_not_grow_with_the_world_size():
    sizes = {}
    for world in (2, 16, 128):
        f = _per_rank_forest(world)
        plan = plan_step(f, PlanConfig(world_size=world, microbatch_tokens=512, chunk_size=8))
        validate_plan(plan, f)
        sl = [slice_plan(plan, r) for r in (0, world - 1)]
        for s in sl:
            validate_slice(s)
            assert len(s.header.stats.rank_costs) == 1 and len(s.header.trajectory_ids) == 6
        sizes[world] = max(len(seal(s)) for s in sl)
    # the ranks' own work differs a little with the token ids; the step's tables would add O(W)
    assert sizes[128] <= 1.05 * sizes[2] and sizes[16] <= 1.05 * sizes[2], sizes


def test_one_token_batch_for_4096_ranks_stores_kilobytes_not_megabytes():
    f = make_forest([[5]], vocab=64)
    plan = plan_step(f, PlanConfig(world_size=4096, microbatch_tokens=64, chunk_size=8))
    total = sum(len(seal(slice_plan(plan, r))) for r in range(4096))
    assert total < 4096 * 600, total  # was 135 MB: every slice repeated all 4,096 rank costs


def test_local_tables_map_back_to_the_step():
    f = _per_rank_forest(4, per_rank=2)
    plan = plan_step(f, PlanConfig(world_size=4, microbatch_tokens=512, chunk_size=8))
    h = plan.header
    seen = set()
    for r in range(4):
        s = open_sealed(seal(slice_plan(plan, r)))
        assert s.header.local_tables
        index = unpack(s.header.trajectory_index, "int32")
        assert list(s.header.trajectory_ids) == [h.trajectory_ids[i] for i in index]
        np.testing.assert_array_equal(unpack(s.header.normalizers.traj_loss_tokens, "float32"),
                                      unpack(h.normalizers.traj_loss_tokens, "float32")[index])
        assert s.header.normalizers.num_trajectories == h.normalizers.num_trajectories
        tree_index = unpack(s.header.tree_index, "int32")
        for mb, whole in zip(s.rank.microbatches, plan.ranks[r].microbatches):
            np.testing.assert_array_equal(index[unpack(mb.lp_traj, "int32")], unpack(whole.lp_traj, "int32"))
            np.testing.assert_array_equal(tree_index[unpack(mb.seg_tree, "int32")], unpack(whole.seg_tree, "int32"))
        seen.update(index.tolist())
    assert seen == set(range(len(h.trajectory_ids)))


def test_validator_rejects_broken_local_tables():
    f = _per_rank_forest(2)
    plan = plan_step(f, PlanConfig(world_size=2, microbatch_tokens=512, chunk_size=8))
    good = slice_plan(plan, 0)
    validate_slice(good)
    bad = type(good)()
    bad.CopyFrom(good)
    bad.header.trajectory_index = np.array([3, 1, 2, 0, 4, 5], "<i4").tobytes()
    with pytest.raises(PlanValidationError, match="header.trajectory_index"):
        validate_slice(bad)
    bad.CopyFrom(good)
    bad.rank.microbatches[0].lp_traj = np.full(len(bad.rank.microbatches[0].lp_traj) // 4, 6, "<i4").tobytes()
    with pytest.raises(PlanValidationError, match="lp_traj"):
        validate_slice(bad)
    whole = type(plan)()
    whole.CopyFrom(plan)
    whole.header.local_tables = True
    with pytest.raises(PlanValidationError, match="header.local_tables"):
        validate_plan(whole)


def test_trainer_runs_slices_with_local_tables_like_the_whole_plan():
    # optional: the trainer extra (the planner's tests need no torch otherwise)
    import torch

    from trainer.executor import Executor, ExecutorConfig
    from trainer.models import build_model

    f = _per_rank_forest(2, per_rank=2)
    plan = plan_step(f, PlanConfig(world_size=2, microbatch_tokens=256, chunk_size=8, windows=False))
    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    ex = Executor(model, ExecutorConfig(chunk_size=8, want_logprobs=True))
    whole = ex.run_step(plan, backward=False)
    parts = [ex.run_step(slice_plan(plan, r), backward=False) for r in range(2)]
    got = {k: v for p in parts for k, v in p.logprobs.items()}
    assert got.keys() == whole.logprobs.keys()
    for k, v in whole.logprobs.items():
        np.testing.assert_array_equal(got[k], v)
    assert sum(p.loss for p in parts) == pytest.approx(whole.loss, rel=1e-6)
