"""Lock-step plans (planner_service/planner/lockstep.py, PlanConfig.lockstep): the alignment of
every rank's steps into one sequence of phases, against its twin and the free plan's work."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from plan.phases import PHASE_BACKWARD, PHASE_FORWARD, PHASE_RECOMPUTE, step_cost
from plan.seal import slice_plan
from plan.slice_check import check_slice
from plan.validator import validate_plan
from planner_service.errors import PlanningError
from planner_service.planner import PlanConfig, plan_step
from planner_service.planner import lockstep
from planner_service.planner.build import build_plan
from planner_service.planner.partition import partition
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from tests.builder_helpers import aligned_by_both, forest_from_trajectories, random_trajectories, random_window_forest


@pytest.mark.parametrize("seed", range(12))
def test_align_phases_matches_reference_and_keeps_window_rules(seed):
    rng = np.random.default_rng(seed)
    W = int(rng.integers(1, 6))
    M = int(rng.integers(1, 40))
    mb_rank, wparent, cost, forced, full, win, exports, budget, priority = random_window_forest(rng, M, W)
    for power, rec_open, small_fill in itertools.product(lockstep.WEIGHT_POWERS, (False, True), (False, True)):
        args = (mb_rank, wparent, cost, priority, forced, full, win, exports, budget, W, power,
                lockstep.VOLUNTARY_SLACK, rec_open, small_fill)
        phases, step_phase, step_mb, voluntary, makespan = aligned_by_both(args)
        assert sorted(step_mb.tolist()) == sorted(list(range(M)) * 2), "every microbatch F once and B once"
        assert not (voluntary & forced).any()
        rec = forced | voluntary
        # per rank: one step per phase at most, a depth-first stack, kinds matching the phases
        assert np.unique(np.stack([mb_rank[step_mb], step_phase]), axis=1).shape[1] == step_mb.shape[0]
        stacks: dict[int, list[int]] = {}
        done = np.zeros(M, np.bool_)
        slowest = np.zeros(phases.shape[0])
        for p, m in zip(step_phase.tolist(), step_mb.tolist()):
            st = stacks.setdefault(int(mb_rank[m]), [])
            if m not in st and not done[m]:
                assert phases[p] == PHASE_FORWARD
                assert wparent[m] < 0 or wparent[m] in st, "a window child opens while its parent is open"
                st.append(m)
                slowest[p] = max(slowest[p], step_cost(PHASE_FORWARD, cost[m]))
            else:
                assert st[-1] == m, "windows close depth-first"
                assert phases[p] == (PHASE_RECOMPUTE if rec[m] else PHASE_BACKWARD)
                assert not (wparent == m)[~done].any(), "a window closes after its dependents"
                st.pop()
                done[m] = True
                slowest[p] = max(slowest[p], step_cost(int(phases[p]), cost[m]))
        assert makespan == pytest.approx(slowest.sum())


def _forest(seed: int, chunk: int = 8):
    rng = np.random.default_rng(seed)
    trajs, tree_of = random_trajectories(rng, n=int(rng.integers(4, 24)), max_len=12 * chunk, vocab=6,
                                         trees=int(rng.integers(1, 5)), chunk=chunk)
    return forest_from_trajectories(trajs, tree_of=tree_of, seed=seed)


CASES = [
    dict(world_size=1, microbatch_tokens=64), dict(world_size=2, microbatch_tokens=32),
    dict(world_size=3, microbatch_tokens=48, memory_tokens=96), dict(world_size=4, microbatch_tokens=64),
    dict(world_size=2, microbatch_tokens=96, windows=False), dict(world_size=3, microbatch_tokens=32, replay=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_lockstep_plans_validate_and_run_the_free_work(case):
    for seed in range(4):
        f = _forest(seed)
        cfg = PlanConfig(chunk_size=8, lockstep=True, cross_rank_windows=False, **case)  # windows across ranks: test_cross_edges.py
        try:
            part = partition(f, cfg)
        except PlanningError:  # a budget this forest cannot meet (the free plan raises the same)
            with pytest.raises(PlanningError):
                partition(f, dataclasses.replace(cfg, lockstep=False))
            continue
        plan = build_plan(f, cfg, part)
        validate_plan(plan, f)
        phases = unpack(plan.header.lockstep_phases, "uint8")
        st = plan.header.stats
        assert st.lockstep_phases == phases.shape[0] == len(part.rank_steps[0])
        assert st.lockstep_phases == st.lockstep_forward_phases + st.lockstep_backward_phases + st.lockstep_recompute_phases
        assert st.lockstep_makespan >= st.makespan * (1 - 1e-12) and st.lockstep_ratio >= 1 - 1e-12
        for r, rank in enumerate(plan.ranks):
            assert len(rank.steps) == phases.shape[0]
            real = [(s.kind, rank.microbatches[s.microbatch].id) for s in rank.steps if s.microbatch >= 0]
            ids = [mb.id for mb in rank.microbatches]
            assert sorted(real) == sorted((k, m) for m in ids for k in (plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD))
            decoded = check_slice(slice_plan(plan, r))
            assert decoded.phases.tolist() == phases.tolist() and len(decoded.standins) == len(decoded.steps)
        # the alignment neither loses nor adds work: the same partition built as a free plan
        # (its real steps in the same order) has byte-identical microbatches
        free_part = dataclasses.replace(part, phases=None, rank_steps=[[s for s in rs if s[1] >= 0] for rs in part.rank_steps])
        free = build_plan(f, dataclasses.replace(cfg, lockstep=False), free_part)
        validate_plan(free, f)
        for a, b in zip(plan.ranks, free.ranks):
            assert [mb.SerializeToString(deterministic=True) for mb in a.microbatches] == [
                mb.SerializeToString(deterministic=True) for mb in b.microbatches]
            assert [(s.kind, s.microbatch) for s in a.steps if s.microbatch >= 0] == [(s.kind, s.microbatch) for s in b.steps]
        assert free.header.stats.makespan == st.makespan and free.header.stats.peak_live_bytes == st.peak_live_bytes
        # the Numba kernels and their plain-Python twins give byte-identical lock-step plans
        ref = plan_step(f, cfg, impl="ref")
        ref.header.stats.plan_seconds = 0.0
        numba = plan_step(f, cfg)
        numba.header.stats.plan_seconds = 0.0
        assert ref.SerializeToString(deterministic=True) == numba.SerializeToString(deterministic=True)


def test_free_plans_carry_no_phases():
    f = _forest(1)
    plan = plan_step(f, PlanConfig(chunk_size=8, microbatch_tokens=32, world_size=2))
    st = plan.header.stats
    assert not plan.header.params.lockstep and not plan.header.lockstep_phases
    assert (st.lockstep_phases, st.lockstep_makespan, st.lockstep_ratio) == (0, 0.0, 0.0)
    assert all(s.microbatch >= 0 and s.standin == 0 for r in plan.ranks for s in r.steps)


def test_stand_ins_pair_forward_and_backward_on_their_rank():
    f = _forest(2)
    plan = plan_step(f, PlanConfig(chunk_size=8, microbatch_tokens=32, world_size=4, lockstep=True))
    phases = unpack(plan.header.lockstep_phases, "uint8").tolist()
    paired = 0
    for rank in plan.ranks:
        opened: dict[int, int] = {}
        for i, (s, ph) in enumerate(zip(rank.steps, phases)):
            if s.microbatch >= 0:
                continue
            if ph == PHASE_FORWARD and s.standin:
                opened[s.standin] = i
            elif ph == PHASE_BACKWARD:
                assert opened.pop(s.standin) < i
                paired += 1
            else:
                assert s.standin == 0
        assert not opened
    assert paired, "the forest gives ranks different window shapes: some rank pads a backward phase"


def test_equal_count_caps_finds_the_smallest_capacity_per_rank():
    sizes = [np.array([100, 60, 30]), np.array([10, 10])]  # rank r's microbatch count at cap c

    def counts(caps):
        return np.array([sum(-(-int(x) // int(c)) for x in s) for s, c in zip(sizes, caps)])

    caps = lockstep.equal_count_caps(counts, 2, 128, 4, n=5)
    assert (counts(caps) <= 5).all()
    assert (counts(caps - np.maximum(4, caps // 64)) > 5).all() or (caps - np.maximum(4, caps // 64) < 8).any()


def test_builder_rejects_inconsistent_lockstep_partitions():
    f = _forest(3)
    cfg = PlanConfig(chunk_size=8, microbatch_tokens=32, world_size=2, lockstep=True, cross_rank_windows=False)
    part = partition(f, cfg)
    with pytest.raises(PlanningError, match="expected the phases of a lock-step plan"):
        build_plan(f, cfg, dataclasses.replace(part, phases=None))
    with pytest.raises(PlanningError, match="expected no stand-ins"):
        build_plan(f, dataclasses.replace(cfg, lockstep=False), part)
    with pytest.raises(PlanningError, match="expected none in a free plan"):
        real = [[s for s in rs if s[1] >= 0] for rs in part.rank_steps]
        build_plan(f, dataclasses.replace(cfg, lockstep=False), dataclasses.replace(part, rank_steps=real))
    steps = [list(rs) for rs in part.rank_steps]
    steps[1] = steps[1][:-1]
    with pytest.raises(PlanningError, match=r"rank_steps\[1\]"):
        build_plan(f, cfg, dataclasses.replace(part, rank_steps=steps))
    # a BACKWARD stand-in with no FORWARD stand-in before it
    phases = np.array([PHASE_BACKWARD] + part.phases.tolist(), np.uint8)
    steps = [[("B", -1)] + list(rs) for rs in part.rank_steps]
    with pytest.raises(PlanningError, match="without an earlier FORWARD stand-in"):
        build_plan(f, cfg, dataclasses.replace(part, phases=phases, rank_steps=steps))
