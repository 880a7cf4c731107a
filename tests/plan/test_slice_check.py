"""plan.slice_check.check_slice: accepts every slice of builder plans, returns the arrays
decode_microbatch gives, and rejects the structural corruptions that the independent validator
(the oracle) also rejects."""
from __future__ import annotations

import re

import numpy as np
import pytest

from planner_service.planner.build import build_plan
from planner_service.planner.config import PlanConfig
from proto.arrays import pack
from proto.harts.v1 import plan_pb2
from plan.microbatch import PlanValidationError, decode_microbatch
from plan.seal import slice_plan
from plan.validator import validate_slice
from plan.slice_check import check_slice
from tests.builder_helpers import forest_from_trajectories, random_partition, random_trajectories
from tests.plan.test_plan_validator import _arr, _mb, _whole_plan, _window_plan


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no_replay"])
def test_accepts_every_slice_of_builder_plans(replay):
    rng = np.random.default_rng(21 if replay else 22)
    for it in range(8):
        C = [2, 4, 8][it % 3]
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(2, 12)), max_len=4 * C + 5, vocab=4, trees=2, chunk=C)
        f = forest_from_trajectories(trajs, tree_of=tree_of, seed=it)
        cfg = PlanConfig(world_size=2, chunk_size=C, microbatch_tokens=4096, replay=replay, all_positions=bool(it % 2))
        plan = build_plan(f, cfg, random_partition(f, rng, chunk=C, world_size=2))
        for r in range(2):
            sl = slice_plan(plan, r)
            validate_slice(sl)
            decoded = check_slice(sl)
            assert [a.id for a in decoded.microbatches] == [mb.id for mb in sl.rank.microbatches]
            assert decoded.steps == [(s.kind, s.microbatch) for s in sl.rank.steps]
            for a, mb in zip(decoded.microbatches, sl.rank.microbatches):
                b = decode_microbatch(mb, sl.header.params)
                assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.conv_ancestors, b.conv_ancestors)


def _drop_call(plan):
    mb = _mb(plan, 0)
    late = plan_pb2.LinearSequence()
    late.CopyFrom(mb.linear_calls[1].sequences[0])
    del mb.linear_calls[1]
    mb.linear_calls[0].sequences.append(late)


def _set(name, dtype, i, value, m=0, width=1):
    def mutate(plan):
        mb = _mb(plan, m)
        a = _arr(mb, name, dtype, width)
        a[i] = value
        setattr(mb, name, pack(a, dtype))
    return mutate


def _seq(m, c, q):
    return lambda plan: _mb(plan, m).linear_calls[c].sequences[q]


def _mutate_seq(m, c, q, **fields):
    def mutate(plan):
        seq = _seq(m, c, q)(plan)
        for k, v in fields.items():
            setattr(seq, k, pack(v, "int32") if isinstance(v, list) else v)
    return mutate


def _export_twice(plan):
    _seq(0, 0, 1)(plan).exports.add(state=0, depth=8)


def _off_boundary_export(plan):
    _seq(0, 0, 0)(plan).exports[0].depth = 9


def _extra_state(plan):
    _mb(plan, 0).num_states += 1


def _swap_backwards(plan):
    steps = plan.ranks[0].steps
    steps[2].microbatch, steps[3].microbatch = 0, 1


def _backward_first(plan):
    plan.ranks[0].steps[0].kind = plan_pb2.ExecStep.BACKWARD


def _import_after_close(plan):
    for s, (k, m) in zip(plan.ranks[0].steps, [(0, 0), (1, 0), (0, 1), (1, 1)]):
        s.kind, s.microbatch = k, m


def _unexport_rows(plan):
    _mb(plan, 0).export_rows = pack(list(range(8)), "int32")


def _unexport_states(plan):
    _mb(plan, 0).export_states = b""


def _budget(plan):
    plan.header.params.microbatch_tokens = 19


def _version(plan):
    plan.header.version = "harts.plan.v0"


def _tiling(plan):
    mb = _mb(plan, 0)
    st = _arr(mb, "seg_start", "int32")
    st[1] += 1
    mb.seg_start = pack(st, "int32")


def _depth_gap(plan):
    mb = _mb(plan, 0)
    d = _arr(mb, "depth", "int32")
    d[3] += 1
    mb.depth = pack(d, "int32")


def _dup_count(plan):
    _mb(plan, 1).duplicated_tokens += 1


CORRUPTIONS = [
    # (id, plan maker, mutation, check_slice message fragment)
    ("state-read-before-export", _whole_plan, _drop_call, "no earlier call exported"),
    ("rows-outside-sequences", _whole_plan, _mutate_seq(0, 0, 0, row_end=9), "exactly one sequence range"),
    ("unaligned-start", _whole_plan, _mutate_seq(0, 1, 0, replay_rows=b"", start_depth=9), "multiple of C = 8"),
    ("replay-too-long", _whole_plan, _mutate_seq(0, 1, 0, replay_rows=list(range(9)), start_depth=0), "C-1 = 7"),
    ("start-depth", _whole_plan, _mutate_seq(0, 0, 0, start_depth=8), "expected 0 (depth of its first row), got 8"),
    ("zero-state-deep", _whole_plan, lambda p: setattr(_seq(0, 1, 0)(p).init_state, "kind", 0), "zero state at depth 8"),
    ("export-off-boundary", _whole_plan, _off_boundary_export, "linear_calls[0].sequences[0].exports: expected state depths"),
    ("exported-twice", _whole_plan, _export_twice, "state id exported twice"),
    ("state-never-exported", _whole_plan, _extra_state, "state 1 of num_states 2 is never exported"),
    ("over-budget", _whole_plan, _budget, "exceed microbatch_tokens 19"),
    ("header-version", _whole_plan, _version, "header.version"),
    ("segments-do-not-tile", _whole_plan, _tiling, "tile rows"),
    ("depth-gap", _whole_plan, _depth_gap, "consecutive depths"),
    ("lp-row-depth", _whole_plan, _set("lp_row", "int32", 0, 5), "expected a row at depth"),
    ("occurrence-on-duplicate", lambda: _window_plan(shared=False), _set("occurrence", "int32", 0, 2, m=1), "occurrence"),
    ("duplicated-count", lambda: _window_plan(shared=False), _dup_count, "duplicated_tokens"),
    ("not-depth-first", _window_plan, _swap_backwards, "not depth-first"),
    ("backward-before-forward", _window_plan, _backward_first, "without one prior forward"),
    ("import-from-closed-window", _window_plan, _import_after_close, "not an open window"),
    ("import-of-unexported-row", _window_plan, _unexport_rows, "not listed in microbatch 0's export_rows"),
    ("import-of-unexported-state", _window_plan, _unexport_states, "export_states"),
    ("array-length", _whole_plan, lambda p: setattr(_mb(p, 0), "depth", _mb(p, 0).depth[:-4]), "expected 12 entries, got 11"),
]


@pytest.mark.parametrize("make,mutate,fragment", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_rejects_what_the_validator_rejects(make, mutate, fragment):
    _, plan = make()
    check_slice(slice_plan(plan, 0))
    mutate(plan)
    sl = slice_plan(plan, 0)
    with pytest.raises(PlanValidationError):
        validate_slice(sl)  # the oracle agrees that the slice is broken
    with pytest.raises(PlanValidationError, match=re.escape(fragment)):
        check_slice(sl)
