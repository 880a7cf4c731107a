"""Lock-step rules (plan/phases.py) in the oracle validator and the fast slice check: hand-broken
plans are rejected with the phase (the step) named."""
from __future__ import annotations

import numpy as np
import pytest

from plan.microbatch import PlanValidationError
from plan.phases import PHASE_BACKWARD, PHASE_FORWARD, PHASE_RECOMPUTE, check_rank_phases
from plan.seal import slice_plan
from plan.slice_check import check_slice
from plan.validator import validate_plan, validate_slice
from planner_service.planner import PlanConfig, plan_step
from proto.arrays import pack, unpack
from proto.harts.v1 import plan_pb2
from tests.builder_helpers import forest_from_trajectories, random_trajectories

FORWARD, BACKWARD = plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD


@pytest.fixture(scope="module")
def lockstep_plan():
    """A 3-rank lock-step plan with recomputed windows and paired stand-ins."""
    rng = np.random.default_rng(1)
    trajs, tree_of = random_trajectories(rng, n=int(rng.integers(4, 24)), max_len=96, vocab=6,
                                         trees=int(rng.integers(1, 5)), chunk=8)
    forest = forest_from_trajectories(trajs, tree_of=tree_of, seed=1)
    plan = plan_step(forest, PlanConfig(world_size=3, microbatch_tokens=48, memory_tokens=96, chunk_size=8, lockstep=True))
    validate_plan(plan, forest)
    phases = unpack(plan.header.lockstep_phases, "uint8")
    standins = {(int(ph), s.standin > 0) for r in plan.ranks for s, ph in zip(r.steps, phases) if s.microbatch < 0}
    assert standins == {(PHASE_FORWARD, False), (PHASE_FORWARD, True), (PHASE_BACKWARD, True), (PHASE_RECOMPUTE, False)}
    assert any(s.microbatch >= 0 and ph == PHASE_RECOMPUTE for r in plan.ranks for s, ph in zip(r.steps, phases))
    return plan


def _copy(plan):
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    return out


def _find(plan, want):
    """(rank, step index) of the first step where want(rank plan, step, phase) holds."""
    phases = unpack(plan.header.lockstep_phases, "uint8").tolist()
    for r, rank in enumerate(plan.ranks):
        for i, (s, ph) in enumerate(zip(rank.steps, phases)):
            if want(rank, s, ph):
                return r, i
    raise AssertionError("the fixture plan has no such step")


def _rejected(plan, rank: int, match: str) -> None:
    """The whole-plan oracle and the slice check (and validate_slice) reject it, naming `match`."""
    with pytest.raises(PlanValidationError, match=match):
        validate_plan(plan)
    sl = slice_plan(plan, rank)
    with pytest.raises(PlanValidationError, match=match):
        check_slice(sl)
    with pytest.raises(PlanValidationError, match=match):
        validate_slice(sl)


def test_the_fixture_validates_everywhere(lockstep_plan):
    for r in range(len(lockstep_plan.ranks)):
        decoded = check_slice(slice_plan(lockstep_plan, r))
        assert len(decoded.steps) == lockstep_plan.header.stats.lockstep_phases


def test_a_rank_with_a_step_missing(lockstep_plan):
    plan = _copy(lockstep_plan)
    del plan.ranks[1].steps[-1]
    _rejected(plan, 1, rf"rank 1\.steps: expected {lockstep_plan.header.stats.lockstep_phases} steps, one per phase")


def test_a_forward_where_the_phase_is_backward(lockstep_plan):
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: ph == PHASE_BACKWARD and s.microbatch >= 0)
    plan.ranks[r].steps[i].kind = FORWARD
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected a PHASE_BACKWARD step \(BACKWARD\), got FORWARD")


def test_a_backward_where_the_phase_is_forward(lockstep_plan):
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: ph == PHASE_FORWARD)
    plan.ranks[r].steps[i].kind = BACKWARD
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected a PHASE_FORWARD step \(FORWARD\), got BACKWARD")


def test_recompute_flag_must_match_the_phase(lockstep_plan):
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: ph == PHASE_BACKWARD and s.microbatch >= 0)
    plan.ranks[r].microbatches[plan.ranks[r].steps[i].microbatch].recompute = True
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected a microbatch not marked recompute in a PHASE_BACKWARD phase")
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: ph == PHASE_RECOMPUTE and s.microbatch >= 0)
    plan.ranks[r].microbatches[plan.ranks[r].steps[i].microbatch].recompute = False
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected a microbatch marked recompute in a PHASE_RECOMPUTE phase")


def test_backward_stand_in_needs_its_forward(lockstep_plan):
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: ph == PHASE_BACKWARD and s.microbatch < 0)
    plan.ranks[r].steps[i].standin = 9999
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected a BACKWARD stand-in paired with an earlier FORWARD stand-in")


def test_forward_stand_in_ids_pair_exactly_once(lockstep_plan):
    plan = _copy(lockstep_plan)  # an id > 0 that no BACKWARD closes
    r, i = _find(plan, lambda rank, s, ph: ph == PHASE_FORWARD and s.microbatch < 0 and s.standin == 0)
    plan.ranks[r].steps[i].standin = 9999
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: FORWARD stand-in 9999 has no BACKWARD stand-in later")


def test_stand_in_ids_are_used_by_one_forward_only():
    phases = np.array([PHASE_FORWARD, PHASE_FORWARD, PHASE_BACKWARD, PHASE_BACKWARD], np.uint8)
    ok = [(FORWARD, -1, 1), (FORWARD, -1, 2), (BACKWARD, -1, 2), (BACKWARD, -1, 1)]
    check_rank_phases("rank 0", phases, ok, [])
    twice = [(FORWARD, -1, 1), (FORWARD, -1, 1), (BACKWARD, -1, 1), (BACKWARD, -1, 1)]
    with pytest.raises(PlanValidationError, match=r"rank 0\.steps\[1\]: stand-in id 1 is used twice for a FORWARD"):
        check_rank_phases("rank 0", phases, twice, [])
    reused = [(FORWARD, -1, 1), (BACKWARD, -1, 1), (FORWARD, -1, 1), (BACKWARD, -1, 1)]
    with pytest.raises(PlanValidationError, match=r"rank 0\.steps\[2\]: stand-in id 1 is used twice"):
        check_rank_phases("rank 0", phases[[0, 2, 1, 3]], reused, [])


def test_recompute_stand_ins_and_real_steps_carry_no_id(lockstep_plan):
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: ph == PHASE_RECOMPUTE and s.microbatch < 0)
    plan.ranks[r].steps[i].standin = 5
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected standin 0 for a PHASE_RECOMPUTE stand-in")
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: s.microbatch >= 0)
    plan.ranks[r].steps[i].standin = 3
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected standin 0 on a real step")


def test_microbatch_index_out_of_range(lockstep_plan):
    plan = _copy(lockstep_plan)
    r, i = _find(plan, lambda rank, s, ph: s.microbatch >= 0)
    plan.ranks[r].steps[i].microbatch = 99
    _rejected(plan, r, rf"rank {r}\.steps\[{i}\]: expected a microbatch index < \d+ or -1")


def test_header_phases(lockstep_plan):
    plan = _copy(lockstep_plan)
    phases = unpack(plan.header.lockstep_phases, "uint8").copy()
    phases[2] = 7
    plan.header.lockstep_phases = pack(phases, "uint8")
    _rejected(plan, 0, r"header\.lockstep_phases\[2\]: expected a PhaseKind")
    plan = _copy(lockstep_plan)
    plan.header.params.lockstep = False
    _rejected(plan, 0, r"header\.lockstep_phases: expected none in a free plan")


def test_free_plans_reject_stand_ins(lockstep_plan):
    rng = np.random.default_rng(1)
    trajs, tree_of = random_trajectories(rng, n=10, max_len=40, vocab=6, trees=2, chunk=8)
    plan = plan_step(forest_from_trajectories(trajs, tree_of=tree_of), PlanConfig(world_size=2, microbatch_tokens=32, chunk_size=8))
    plan.ranks[0].steps[0].standin = 2
    _rejected(plan, 0, r"rank 0\.steps\[0\]: expected standin 0 in a free plan")


def test_lockstep_statistics_follow_the_steps(lockstep_plan):
    for name, value, match in (("lockstep_makespan", 1.0, "lockstep_makespan"), ("lockstep_ratio", 9.0, "lockstep_ratio"),
                               ("lockstep_backward_phases", 0, "lockstep_phases"), ("lockstep_phases", 1, "lockstep_phases")):
        plan = _copy(lockstep_plan)
        setattr(plan.header.stats, name, value)
        with pytest.raises(PlanValidationError, match=rf"header\.stats\.{match}"):
            validate_plan(plan)
