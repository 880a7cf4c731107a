"""Placement: kernels against their plain-Python oracles, part capacities, rank forests,
the makespan on few large trees, the lower bound in the plan stats, and the memory estimate
bounding the exact live stack."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks import placement_table
from benchmarks.suite_config import SuiteConfig
from planner_service.errors import PlanningError
from planner_service.planner import PlanConfig, level1, partition_ref, placement, placement_ref, plan_step
from planner_service.planner.cost_model import CostModel
from planner_service.planner.partition import _KERNELS, partition_with_report
from planner_service.planner.placement_search import unit_costs
from plan.memory_model import RowSizes
from plan.microbatch import decode_microbatch
from plan.validator import PlanValidationError, validate_plan
from plan.window_exports import ATTN, CONV, KERNEL, export_needs
from tests.planner_service.test_partition import make_forest, random_forest, random_trajs


def _units(f, chunk=8):
    return level1.build_units(f.seg_parent, f.seg_length, f.seg_depth, chunk)


def _costs(f, chunk=8, cost_model=CostModel(), world=4):
    cfg = PlanConfig(world_size=world, microbatch_tokens=64, chunk_size=chunk, cost_model=cost_model)
    units = _units(f, chunk)
    return units, unit_costs(_KERNELS["numba"], f, cfg, *units), cfg


@pytest.mark.parametrize("seed", range(4))
def test_placement_kernels_match_reference(seed):
    f = random_forest(seed, n_trees=3, per_tree=8, max_len=60)
    cm = CostModel(row=1.0, attention=0.01, logprob_row=0.5)
    (seg, off, ulen, udepth, parent), uc, cfg = _costs(f, cost_model=cm)
    ref_uc = unit_costs(_KERNELS["ref"], f, cfg, seg, off, ulen, udepth, parent)
    np.testing.assert_array_equal(uc.ctx, ref_uc.ctx)
    np.testing.assert_array_equal(uc.w, ref_uc.w)
    args = (f.traj_offset, f.traj_seg, f.seg_parent, f.seg_offset, f.seg_depth, f.seg_length, f.loss_mask)
    for all_pos in (False, True):
        np.testing.assert_array_equal(placement.lp_row_flags(*args, all_pos, f.unique_tokens),
                                      placement_ref.lp_row_flags(*args, all_pos, f.unique_tokens))
    np.testing.assert_array_equal(placement.subtree_sums(parent, uc.w), placement_ref.subtree_sums(parent, uc.w))
    np.testing.assert_array_equal(placement.subtree_sizes(parent), placement_ref.subtree_sizes(parent))
    total = float(uc.w.sum())
    rng = np.random.default_rng(seed)
    for cap in (total, total / 3, float((uc.ctx + uc.w).max()) * 1.2):
        got = placement.cut_parts(parent, uc.w, uc.ctx, uc.rc, cap)
        want = placement_ref.cut_parts(parent, uc.w, uc.ctx, uc.rc, cap)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(level1.piece_roots(parent, got[0]), partition_ref.piece_roots(parent, got[0]))
    W = 4
    unit_rank = rng.integers(0, W, size=parent.shape[0]).astype(np.int64)
    ru = placement.rank_closure(parent, unit_rank, W)
    for a, b in zip(ru, placement_ref.rank_closure(parent, unit_rank, W)):
        np.testing.assert_array_equal(a, b)
    cost, dup = placement.closure_costs(*ru, uc.w, uc.w_dup, uc.rc, W)
    np.testing.assert_array_equal(cost, placement_ref.closure_costs(*ru, uc.w, uc.w_dup, uc.rc, W)[0])
    for a, b in zip(placement.placement_costs(parent, unit_rank, uc.w, uc.w_dup, uc.rc, W), (cost, dup)):
        np.testing.assert_array_equal(a, b)
    part = level1.piece_roots(parent, placement.cut_parts(parent, uc.w, uc.ctx, uc.rc, total / 3)[0])
    roots = np.flatnonzero(part == np.arange(parent.shape[0]))
    for fit in (-1.0, 0.6 * total, 1.1 * total / W):  # plain LPT, packing (always fits, sometimes)
        for a, b in zip(placement.lpt_parts(parent, part, roots[::-1], uc.w[roots[::-1]], uc.w_dup, uc.ctx, W, fit),
                        placement_ref.lpt_parts(parent, part, roots[::-1], uc.w[roots[::-1]], uc.w_dup, uc.ctx, W, fit)):
            np.testing.assert_array_equal(a, b)
    U = parent.shape[0]
    scratch = (np.full(U, -1, np.int64), np.zeros(U, np.int64), np.empty(U, np.int64))
    for r in range(W):
        one = placement.rank_cost(parent, unit_rank, r, uc.w, uc.w_dup, uc.rc, *scratch)
        assert one == placement_ref.rank_cost(parent, unit_rank, r, uc.w, uc.w_dup, uc.rc)
        assert one == pytest.approx(cost[r], rel=1e-12)
    a, b = unit_rank.copy(), unit_rank.copy()
    got = placement.refine(parent, a, uc.w, uc.w_dup, uc.rc, W, 8, 4, 0.0)
    want = placement_ref.refine(parent, b, uc.w, uc.w_dup, uc.rc, W, 8, 4, 0.0)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[1] == want[1] and got[1] > 0
    assert got[0].max() < cost.max()  # every move lowers the busiest rank's cost


def test_cut_parts_fit_their_capacity_with_the_duplicated_prefix():
    f = random_forest(3, n_trees=2, per_tree=10, max_len=80)
    (_, _, _, _, parent), uc, _ = _costs(f)
    sub = placement.subtree_sums(parent, uc.w)
    cut, resid, bad = placement.cut_parts(parent, uc.w, uc.ctx, uc.rc, float(sub.max()) * 2)
    assert bad == -1 and not cut.any(), "a forest that fits the capacity was cut"
    cap = float((uc.ctx + uc.w).max()) * 1.1
    cut, resid, bad = placement.cut_parts(parent, uc.w, uc.ctx, uc.rc, cap)
    assert bad == -1 and cut.any()
    roots = np.flatnonzero(level1.piece_roots(parent, cut) == np.arange(parent.shape[0]))
    assert (resid[roots] + uc.ctx[roots] <= cap).all()
    assert placement.cut_parts(parent, uc.w, uc.ctx, uc.rc, float((uc.ctx + uc.w).max()) * 0.9)[2] >= 0


def test_rank_forest_is_the_kept_units_and_their_ancestors():
    f = random_forest(5, n_trees=2, per_tree=8, max_len=50)
    parent = _units(f)[4]
    rng = np.random.default_rng(0)
    unit_rank = rng.integers(0, 3, size=parent.shape[0]).astype(np.int64)
    ru_unit, ru_rank, ru_dup, ru_parent = placement.rank_closure(parent, unit_rank, 3)
    for r in range(3):
        want = set()
        for u in np.flatnonzero(unit_rank == r).tolist():
            while u >= 0:
                want.add(u)
                u = int(parent[u])
        sel = ru_rank == r
        assert sorted(want) == ru_unit[sel].tolist()
        np.testing.assert_array_equal(ru_dup[sel], unit_rank[ru_unit[sel]] != r)
    ok = ru_parent >= 0
    np.testing.assert_array_equal(ru_unit[ru_parent[ok]], parent[ru_unit[ok]])
    assert (ru_rank[ru_parent[ok]] == ru_rank[ok]).all()


def _few_large_trees(n_trees=2, branches=12, prompt=40, branch=(60, 140), seed=0):
    rng = np.random.default_rng(seed)
    trajs, trees = [], []
    for t in range(n_trees):
        head = rng.integers(0, 50, size=prompt).tolist()
        for b in range(branches):
            trajs.append(head + [50 + b] + rng.integers(0, 50, size=int(rng.integers(*branch))).tolist())
            trees.append(f"task{t}")
    return make_forest(trajs, trees)


@pytest.mark.parametrize("world,target", [(4, 1.05), (8, 1.25), (16, 1.25)])
def test_few_large_trees_are_split_across_ranks_near_the_lower_bound(world, target):
    # 2 trees of ~1.2k rows on 4-16 ranks: a window group per rank would leave most ranks idle
    # (makespan ratio >= world / 2); placement splits each tree below its prompt, duplicating the
    # 40-token prefix on the other ranks (the placement table's target: 1.25 with fewer than 2 trees per rank).
    f = _few_large_trees()
    cfg = PlanConfig(world_size=world, microbatch_tokens=256, chunk_size=8)
    plan = plan_step(f, cfg)
    validate_plan(plan, f)
    st = plan.header.stats
    costs = np.array(st.rank_costs)
    assert (costs > 0).sum() >= min(world, 24)
    assert st.makespan_ratio <= target, (st.makespan, st.makespan_lower_bound)
    assert st.duplicated_tokens > 0
    assert st.duplicated_tokens <= 40 * world  # one prompt per rank at most
    longest = float(f.traj_length().max())
    assert st.makespan_lower_bound == pytest.approx(max(costs.sum() / world, longest))


def test_many_small_trees_are_placed_whole_and_balanced():
    rng = np.random.default_rng(7)
    f = make_forest(*random_trajs(rng, 40, 4, 30))
    cfg = PlanConfig(world_size=4, microbatch_tokens=512, chunk_size=8)
    part, report = partition_with_report(f, cfg)
    assert not any(len(spec.dup_ranges) for spec in part.microbatches), "a tree that fits was split"
    plan = plan_step(f, cfg)
    assert plan.header.stats.makespan_ratio <= 1.05
    assert plan.header.stats.duplicated_tokens == 0


def test_makespan_slack_trades_balance_for_duplication():
    f = _few_large_trees(n_trees=3, seed=1)
    tight = plan_step(f, PlanConfig(world_size=8, microbatch_tokens=256, chunk_size=8, makespan_slack=1.0)).header.stats
    loose = plan_step(f, PlanConfig(world_size=8, microbatch_tokens=256, chunk_size=8, makespan_slack=1.3)).header.stats
    assert tight.makespan <= loose.makespan
    assert loose.makespan_ratio <= 1.3 + 1e-9
    assert loose.duplicated_tokens < tight.duplicated_tokens


def test_cost_model_balances_attention_heavy_ranks():
    # With an attention coefficient the deep trajectory weighs more than its rows: placement
    # balances the modelled cost, and the plan's costs are those of the cost model.
    f = make_forest([list(range(400))] + [[1000 + i] + list(range(2000 + 50 * i, 2000 + 50 * i + 50)) for i in range(8)],
                    ["deep"] + [f"s{i}" for i in range(8)], vocab=3000)
    cm = CostModel(row=1.0, attention=0.01, linear_call=3.0, logprob_row=0.5)
    plan = plan_step(f, PlanConfig(world_size=2, microbatch_tokens=512, chunk_size=8, cost_model=cm))
    validate_plan(plan, f)
    assert plan.header.params.cost_model.attention == 0.01
    mb = plan.ranks[0].microbatches[0]
    assert mb.cost > mb.num_rows + mb.replay_tokens
    st = plan.header.stats
    assert st.makespan_lower_bound == pytest.approx(max(sum(st.rank_costs) / 2, 400 + 0.01 * 400 * 401 / 2 + 3.0))


def test_validator_rejects_inconsistent_makespan_stats():
    f = _few_large_trees(n_trees=1, branches=6)
    plan = plan_step(f, PlanConfig(world_size=4, microbatch_tokens=256, chunk_size=8))
    validate_plan(plan, f)
    for name, delta in (("makespan", 1.0), ("makespan_ratio", 0.01), ("makespan_lower_bound", -1e6)):
        bad = type(plan)()
        bad.CopyFrom(plan)
        setattr(bad.header.stats, name, getattr(bad.header.stats, name) + delta)
        with pytest.raises(PlanValidationError, match=f"header.stats.{name}"):
            validate_plan(bad, f)


def _exact_exports(plan):
    """Bytes each recomputed microbatch keeps as an open window, from export_needs."""
    sizes = RowSizes.from_proto(plan.header.params.memory)
    out = {}
    for rank in plan.ranks:
        mbs = {mb.id: decode_microbatch(mb, plan.header.params) for mb in rank.microbatches}
        order = [rank.microbatches[s.microbatch].id for s in rank.steps if s.kind == 0]
        for m, nd in export_needs(mbs, order).items():
            c = nd.local_counts(mbs[m].num_rows)
            out[m] = (sizes.export_bytes(c[ATTN], c[CONV], c[KERNEL], int(nd.states.shape[0])), c, int(nd.states.shape[0]))
    return out


@pytest.mark.parametrize("seed", range(10))
def test_memory_estimate_bounds_the_exact_exports_and_plans_always_validate(seed):
    # Distinct sizes per kind, tight budgets: the partitioner's export estimate of every window
    # is an upper bound of what the trainer keeps, so a plan is either valid or refused clearly.
    f = random_forest(seed, n_trees=3, per_tree=8, max_len=90)
    sizes = RowSizes(activation_row_bytes=1000, attn_row_bytes=3, conv_row_bytes=5, kernel_row_bytes=7, state_bytes=11)
    rng = np.random.default_rng(seed)
    for B, W in ((16, 1), (32, 2), (24, 3)):
        C = int(rng.choice([4, 8]))
        cfg = PlanConfig(world_size=W, microbatch_tokens=B, chunk_size=C, memory_tokens=B + int(rng.integers(0, B)),
                         row_sizes=sizes, replay=bool(rng.random() < 0.8))
        try:
            part, report = partition_with_report(f, cfg)
        except PlanningError as exc:
            assert "memory_tokens: microbatch" in str(exc)
            continue
        plan = plan_step(f, cfg)
        validate_plan(plan, f)
        exact = _exact_exports(plan)
        for m, (nbytes, _, _) in exact.items():
            assert nbytes <= report.exports[m], (m, nbytes, report.exports[m])
        assert plan.header.stats.peak_live_bytes <= report.peak_live <= cfg.memory_bytes


def test_full_length_style_chain_with_small_microbatches_plans_within_memory():
    # A 6,000-token trajectory chained through B = 256 windows (24 deep) used to need
    # the whole path live (old accounting: exported rows as full rows); with the byte model the
    # recomputed windows keep only their K/V, conv and replay inputs and states.
    rng = np.random.default_rng(0)
    spine = rng.integers(0, 50, size=6000).tolist()
    f = make_forest([spine[:n] + [60 + i] * 30 for i, n in enumerate((1500, 3000, 4500, 6000))])
    cfg = PlanConfig(world_size=2, microbatch_tokens=256, chunk_size=64)
    plan = plan_step(f, cfg)
    validate_plan(plan, f)
    st = plan.header.stats
    assert st.peak_live_tokens <= cfg.memory_tokens < 6000
    assert any(mb.recompute for r in plan.ranks for mb in r.microbatches)


def test_bench_placement_table_on_tiny_workloads():
    result = placement_table.run_placement(SuiteConfig(quick=True, trainer=False))
    rows = result["rows"]
    assert len(rows) == 3 * 2 * 2 and {r["world_size"] for r in rows} == {2, 4}
    assert all(r["makespan_ratio"] >= 1.0 - 1e-9 and 0 < r["compression_vs_ideal"] <= 1.0 for r in rows)
    # no placement beats the bound at its own makespan
    assert all(r["compression_vs_ideal"] <= r["bound_at_makespan"] + 1e-12 for r in rows)
    table = placement_table.placement_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| makespan ratio |" in table


@pytest.mark.parametrize("impl", [placement, placement_ref], ids=["numba", "ref"])
def test_lpt_packs_parts_of_a_tree_under_the_target(impl):
    """A root unit (cost 10) with four children (8 each) as five parts on four ranks: plain LPT
    puts each child on its own rank (three copies of the root duplicated); packing under a step
    length of 50 keeps the children together where the root path is already held."""
    parent = np.array([-1, 0, 0, 0, 0], np.int64)
    w = np.array([10.0, 8, 8, 8, 8])
    ctx = placement.context_costs(parent, w)
    part, order = np.arange(5, dtype=np.int64), np.array([1, 2, 3, 4, 0], np.int64)
    spread, load = impl.lpt_parts(parent, part, order, w[order], w, ctx, 4, -1.0)
    assert sorted(spread[:4].tolist()) == [0, 1, 2, 3] and max(load) == 28
    packed, load = impl.lpt_parts(parent, part, order, w[order], w, ctx, 4, 50.0)
    assert packed.tolist() == [0, 0, 0, 0, 1] and max(load) == 42
