"""plan_step end to end: partition + builder on random forests, checked by the independent validator.

The partitioner's own row estimates must equal what the builder lays out (so that every
microbatch fits B and every window stack fits M for real), for every edge mode.
"""
from __future__ import annotations

import numpy as np
import pytest

from planner_service.errors import PlanningError
from planner_service.planner import PlanConfig, expand_forest, partition_with_report, plan_step, warmup
from proto.arrays import unpack
from plan.validator import validate_plan
from tests.planner_service.test_partition import make_forest, random_forest, random_trajs

CASES = {
    "windows": dict(world_size=2, microbatch_tokens=32, chunk_size=8),
    "windows-tight-memory": dict(world_size=1, microbatch_tokens=32, chunk_size=8, memory_tokens=48),
    "no-windows": dict(world_size=3, microbatch_tokens=48, chunk_size=8, windows=False),
    "no-replay": dict(world_size=2, microbatch_tokens=24, chunk_size=4, replay=False),
    "whole-trees": dict(world_size=4, microbatch_tokens=512, chunk_size=16),
    "expanded": dict(world_size=2, microbatch_tokens=64, chunk_size=8, sharing=False),
    "expanded-chain": dict(world_size=2, microbatch_tokens=16, chunk_size=8, sharing=False),
}


def _mb_rows(plan) -> dict[int, int]:
    return {mb.id: mb.num_rows + mb.replay_tokens for rank in plan.ranks for mb in rank.microbatches}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", list(CASES))
def test_plan_step_output_passes_the_validator(name, seed):
    forest = random_forest(seed, n_trees=3, per_tree=6, max_len=40)
    cfg = PlanConfig(**CASES[name])
    try:
        plan = plan_step(forest, cfg)
    except PlanningError as exc:
        assert "memory_tokens" in str(exc) or "microbatch_tokens" in str(exc)
        return
    source = forest if cfg.sharing else expand_forest(forest)
    validate_plan(plan, source)
    st = plan.header.stats
    assert st.plan_seconds > 0
    assert st.unique_tokens == (forest.unique_tokens if cfg.sharing else forest.expanded_tokens)
    assert st.expanded_tokens == forest.expanded_tokens
    assert st.microbatches == sum(len(r.microbatches) for r in plan.ranks)
    rows = _mb_rows(plan)
    assert max(rows.values()) <= cfg.microbatch_tokens
    # the partitioner's estimates are what the builder computes
    _, report = partition_with_report(source, cfg)
    assert [rows[m] for m in range(len(rows))] == report.rows.tolist()
    assert st.peak_live_tokens <= cfg.memory_tokens
    assert st.computed_tokens == report.rows.sum()


def test_plan_step_numba_and_reference_give_identical_plans():
    forest = random_forest(9, n_trees=3, per_tree=8, max_len=40)
    cfg = PlanConfig(world_size=2, microbatch_tokens=32, chunk_size=8)
    a = plan_step(forest, cfg)
    b = plan_step(forest, cfg, impl="ref")
    a.header.stats.plan_seconds = b.header.stats.plan_seconds = 0
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def test_expanded_baseline_computes_every_trajectory_token():
    rng = np.random.default_rng(2)
    forest = make_forest(*random_trajs(rng, 4, 6, 30))
    plan = plan_step(forest, PlanConfig(world_size=2, microbatch_tokens=128, chunk_size=8, sharing=False))
    validate_plan(plan, expand_forest(forest))
    st = plan.header.stats
    assert st.computed_tokens == forest.expanded_tokens
    assert st.compression_achieved == pytest.approx(1.0)
    assert st.replay_tokens == 0 and st.duplicated_tokens == 0
    for rank in plan.ranks:
        for mb in rank.microbatches:
            assert mb.num_rows <= 128
            assert (unpack(mb.seg_parent, "int32") == -1).all()  # packed sequences, no branching


def test_sharing_compresses_and_replay_is_bounded():
    # 8 branches after a 37-token prompt, C = 8: each extra branch replays 37 % 8 = 5 rows
    trajs = [list(range(37)) + [100 + b] * 10 for b in range(8)]
    forest = make_forest(trajs)
    plan = plan_step(forest, PlanConfig(world_size=1, microbatch_tokens=256, chunk_size=8))
    st = plan.header.stats
    assert st.unique_tokens == 37 + 80 and st.expanded_tokens == 8 * 47
    assert st.replay_tokens == 7 * 5
    assert st.computed_tokens == 37 + 80 + 35
    assert st.microbatches == 1


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(microbatch_tokens=32, chunk_size=8, windows=False), r"microbatch_tokens: trajectory 't0' has 100 tokens"),
        # M = B: the exports of any open window above a full microbatch exceed it
        (dict(microbatch_tokens=32, chunk_size=8, memory_tokens=32),
         r"memory_tokens: microbatch \d+ holds \d+ bytes \(\d+ row-equivalents\) while it runs, expected <= \d+ "
         r"\(32 x \d+ bytes per row\): its own activations .* every one recomputed"),
        (dict(microbatch_tokens=32, chunk_size=8, windows=False, sharing=False), r"trajectory 't0' has 100 tokens"),
    ],
    ids=["path-over-B-without-windows", "stack-over-M", "expanded-over-B"],
)
def test_impossible_settings_fail_with_a_clear_message(kw, match):
    forest = make_forest([list(range(100))])
    with pytest.raises(PlanningError, match=match):
        plan_step(forest, PlanConfig(**kw))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(microbatch_tokens=16, chunk_size=64), r"microbatch_tokens: expected >= chunk_size"),
        (dict(chunk_size=48), r"chunk_size: expected a power of two"),
        (dict(microbatch_tokens=64, memory_tokens=32), r"memory_tokens: expected >= microbatch_tokens"),
        (dict(world_size=0), r"world_size: expected >= 1"),
    ],
)
def test_invalid_config_is_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        PlanConfig(**kw)


def test_warmup_runs():
    assert warmup() >= 0


@pytest.mark.parametrize("seed", range(24))
def test_random_settings_end_to_end(seed):
    """Random forests and settings: either a clear PlanningError or a valid plan within budgets."""
    rng = np.random.default_rng(100 + seed)
    forest = random_forest(seed + 50, n_trees=int(rng.integers(1, 5)), per_tree=int(rng.integers(1, 9)),
                           max_len=int(rng.integers(5, 70)))
    C = int(rng.choice([1, 2, 4, 8, 16]))
    B = int(rng.integers(max(C, 8), 96))
    cfg = PlanConfig(
        world_size=int(rng.integers(1, 5)), microbatch_tokens=B, chunk_size=C,
        memory_tokens=int(B * rng.choice([1, 1.5, 3, 8])), windows=bool(rng.random() < 0.75),
        sharing=bool(rng.random() < 0.8), replay=bool(rng.random() < 0.8), all_positions=bool(rng.random() < 0.3),
    )
    try:
        plan = plan_step(forest, cfg)
    except PlanningError as exc:
        assert str(exc).startswith(("memory_tokens:", "microbatch_tokens:")), exc
        return
    source = forest if cfg.sharing else expand_forest(forest)
    validate_plan(plan, source)
    _, report = partition_with_report(source, cfg)
    rows = _mb_rows(plan)
    assert [rows[m] for m in range(len(rows))] == report.rows.tolist()
    assert plan.header.stats.peak_live_tokens <= cfg.memory_tokens
