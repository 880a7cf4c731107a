"""benchmarks.placement_bound: the duplication lower bound is what the argument gives on a comb,
and no plan of the real planner ever duplicates less than the bound at its own makespan."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.placement_bound import compression_bound, duplication_lower_bound
from planner_service.planner import PlanConfig, plan_step
from tests.builder_helpers import forest_from_trajectories, random_trajectories


def _comb():
    """A 20-token path with a 5-token branch at depth 10 and a 3-token branch at depth 5."""
    spine = list(range(20))
    return forest_from_trajectories([spine, spine[:10] + [100, 101, 102, 103, 104], spine[:5] + [200, 201, 202]])


@pytest.mark.parametrize("capacity,expected", [
    (24, 10),  # room 4 beside the path: the depth-10 branch goes elsewhere, 10 rows
    (25, 5),   # the depth-10 branch fits beside the path; the depth-5 one does not: 5 rows
    (28, 0),   # the whole tree fits one rank
])
def test_comb(capacity, expected):
    f = _comb()
    assert f.unique_tokens == 28
    assert duplication_lower_bound(f, capacity) == expected


def test_no_plan_duplicates_less_than_the_bound():
    C, bounds = 8, []
    for seed in range(12):
        rng = np.random.default_rng(seed)
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(6, 30)), max_len=12 * C,
                                             trees=int(rng.integers(1, 4)), chunk=C)
        f = forest_from_trajectories(trajs, tree_of=tree_of, seed=seed)
        for W in (2, 4, 8):
            for slack in (1.02, 1.25, 2.0):
                cfg = PlanConfig(world_size=W, chunk_size=C, microbatch_tokens=4 * C, makespan_slack=slack)
                st = plan_step(f, cfg).header.stats
                bounds.append(duplication_lower_bound(f, st.makespan))
                assert st.duplicated_tokens >= bounds[-1], (seed, W, slack)
                assert st.compression_achieved / st.compression_ideal <= compression_bound(f, st.makespan) + 1e-12
    assert sum(b > 0 for b in bounds) >= 10, "expected plans that must duplicate"
