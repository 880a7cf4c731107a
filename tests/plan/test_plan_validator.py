"""plan/validator.py: accepts builder plans, rejects each kind of corruption precisely."""
from __future__ import annotations

import numpy as np
import pytest

from planner_service.planner.build import build_plan
from planner_service.planner.config import PlanConfig
from planner_service.planner.spec import MicrobatchSpec, Partition
from proto.arrays import pack, unpack
from proto.harts.v1 import plan_pb2
from plan.seal import slice_plan
from plan.validator import PlanValidationError, validate_plan, validate_slice
from tests.builder_helpers import forest_from_trajectories, random_partition, random_trajectories


def _forest():
    prefix = list(range(1, 8))
    return forest_from_trajectories([prefix + [101, 102, 103], prefix + [101, 102, 201], prefix + [301]],
                                    loss_masks=[[0] * 7 + [1, 1, 1], [0] * 7 + [1, 1, 1], [0] * 7 + [1]])


def _whole_plan():
    f = _forest()
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    return f, build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64), Partition(microbatches=[MicrobatchSpec(ranges=ranges)]))


def _window_plan(shared=True, world_size=1):
    f = _forest()
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    part = Partition(microbatches=[MicrobatchSpec(ranges=ranges[:2]),
                                   MicrobatchSpec(ranges=ranges[2:], parent=0, shared=shared, rank=0)])
    return f, build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, world_size=world_size), part)


def _mb(plan, m):
    return next(mb for r in plan.ranks for mb in r.microbatches if mb.id == m)


def _arr(mb, name, dtype, width=1):
    return unpack(getattr(mb, name), dtype, width=width).copy()


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no_replay"])
def test_accepts_builder_plans_and_their_slices(replay):
    rng = np.random.default_rng(11 if replay else 12)
    for it in range(8):
        C = [2, 4, 8][it % 3]
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(2, 12)), max_len=4 * C + 5, vocab=4, trees=2, chunk=C)
        f = forest_from_trajectories(trajs, tree_of=tree_of, seed=it)
        cfg = PlanConfig(world_size=2, chunk_size=C, microbatch_tokens=4096, replay=replay, all_positions=bool(it % 2))
        plan = build_plan(f, cfg, random_partition(f, rng, chunk=C, world_size=2))
        validate_plan(plan, f)
        validate_plan(plan)  # without the forest: chain consistency only
        for r in range(2):
            validate_slice(slice_plan(plan, r))


def _rejects(plan, match, forest=None):
    with pytest.raises(PlanValidationError, match=match):
        validate_plan(plan, forest)


def test_rejects_duplicate_logprob_entry():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    for name, dt in [("lp_row", "int32"), ("lp_label", "int32"), ("lp_traj", "int32"), ("lp_pos", "int32"),
                     ("lp_loss_mask", "uint8"), ("lp_old_logprob", "float32"), ("lp_advantage", "float32")]:
        a = _arr(mb, name, dt)
        setattr(mb, name, pack(np.append(a, a[0]), dt))
    _rejects(plan, "more than one log-prob entry", f)


def test_rejects_missing_logprob_entry():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    for name, dt in [("lp_row", "int32"), ("lp_label", "int32"), ("lp_traj", "int32"), ("lp_pos", "int32"),
                     ("lp_loss_mask", "uint8"), ("lp_old_logprob", "float32"), ("lp_advantage", "float32")]:
        setattr(mb, name, pack(_arr(mb, name, dt)[:-1], dt))
    _rejects(plan, "log-prob entries", f)


def test_rejects_wrong_label():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    lab = _arr(mb, "lp_label", "int32")
    lab[0] = (lab[0] + 1) % 1000
    mb.lp_label = pack(lab, "int32")
    _rejects(plan, "expected label", f)
    _rejects(plan, "does not chain")  # without the forest, consecutive entries disagree


def test_rejects_row_at_wrong_depth():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    rows, traj, pos = _arr(mb, "lp_row", "int32"), _arr(mb, "lp_traj", "int32"), _arr(mb, "lp_pos", "int32")
    k = int(np.flatnonzero((traj == 2) & (pos == 7))[0])  # label 301 reads row 6 (depth 6)
    rows[k] = 7
    mb.lp_row = pack(rows, "int32")
    _rejects(plan, r"expected a row at depth 6", f)


def test_rejects_row_chain_mismatch_with_forest():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    traj, pos = _arr(mb, "lp_traj", "int32"), _arr(mb, "lp_pos", "int32")
    rows = _arr(mb, "lp_row", "int32")
    depth = _arr(mb, "depth", "int32")
    # trajectory 0's position 8 entry reads row 7 (token 101, depth 7); row 11 (301) has the same depth
    i = int(np.flatnonzero((traj == 0) & (pos == 8))[0])
    assert depth[rows[i]] == 7 and depth[11] == 7
    rows[i] = 11
    mb.lp_row = pack(rows, "int32")
    _rejects(plan, "token chain does not reproduce", f)


def test_rejects_token_kept_twice():
    f, plan = _window_plan(shared=False)
    child = _mb(plan, 1)
    dup = _arr(child, "seg_duplicated", "uint8")
    dup[:] = 0
    child.seg_duplicated = pack(dup, "uint8")
    occ = _arr(child, "occurrence", "int32")
    occ[occ == 0] = 1
    child.occurrence = pack(occ, "int32")
    child.duplicated_tokens = 0
    _rejects(plan, "kept in more than one microbatch", f)


def test_rejects_occurrence_on_duplicated_rows():
    f, plan = _window_plan(shared=False)
    child = _mb(plan, 1)
    occ = _arr(child, "occurrence", "int32")
    occ[0] = 2
    child.occurrence = pack(occ, "int32")
    _rejects(plan, "expected 0 on duplicated rows", f)


def test_rejects_unaligned_sequence_start():
    f, plan = _whole_plan()
    seq = _mb(plan, 0).linear_calls[1].sequences[0]  # replay [8] then row 10, start depth 8
    seq.replay_rows = b""
    seq.start_depth = 9
    _rejects(plan, "expected a multiple of C = 8", f)


def test_rejects_replay_longer_than_chunk():
    f, plan = _whole_plan()
    seq = _mb(plan, 0).linear_calls[1].sequences[0]
    seq.replay_rows = pack(list(range(0, 9)), "int32")  # rows of depths 0..8 on the path
    seq.start_depth = 0
    _rejects(plan, r"expected <= C-1 = 7 rows", f)


def test_rejects_replay_rows_off_path():
    f, plan = _whole_plan()
    seq = _mb(plan, 0).linear_calls[0].sequences[1]  # replays rows 0..6 before row 11
    seq.replay_rows = pack([0, 1, 2, 3, 4, 6, 5], "int32")
    _rejects(plan, "consecutive rows of one path", f)


def test_rejects_state_read_before_it_exists():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    late = plan_pb2.LinearSequence()
    late.CopyFrom(mb.linear_calls[1].sequences[0])
    del mb.linear_calls[1]
    mb.linear_calls[0].sequences.append(late)
    _rejects(plan, "reads local state 0 produced in call 0", f)


def test_rejects_state_of_another_path():
    p = [1, 2, 3, 4, 5]
    a, b = p + list(range(100, 115)), p + list(range(200, 215))
    f = forest_from_trajectories([a, a[:17] + [7, 7], b, b[:17] + [8, 8]])
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=256), Partition(microbatches=[MicrobatchSpec(ranges=ranges)]))
    validate_plan(plan, f)
    late = _mb(plan, 0).linear_calls[1].sequences
    assert len(late) == 2 and late[0].init_state.state != late[1].init_state.state
    late[0].init_state.state, late[1].init_state.state = late[1].init_state.state, late[0].init_state.state
    _rejects(plan, "of another path", f)


def test_rejects_unexported_imported_state():
    f, plan = _window_plan()
    _mb(plan, 0).export_states = b""
    _rejects(plan, "not in microbatch 0's export_states", f)


def test_rejects_import_of_unexported_row():
    f, plan = _window_plan()
    _mb(plan, 0).export_rows = pack(list(range(8)), "int32")
    _rejects(plan, "not listed in microbatch 0's export_rows", f)


def test_rejects_rows_outside_sequences():
    f, plan = _whole_plan()
    _mb(plan, 0).linear_calls[0].sequences[0].row_end = 9
    _rejects(plan, "exactly one sequence range", f)


def test_rejects_wrong_conv_ancestry():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    conv = _arr(mb, "conv_ancestors", "int32", width=3)
    conv[10, 2] = 9  # 201's predecessor is row 8 (102), not row 9 (103)
    mb.conv_ancestors = pack(conv, "int32")
    _rejects(plan, r"conv_ancestors\[10, 2\]: expected 8, got 9", f)


def test_rejects_wrong_attention_ranges():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    rg = _arr(mb, "attn_ranges", "int32", width=2)
    rg[-1] = [0, 8]  # Y attends to rows 0..6 only
    mb.attn_ranges = pack(rg, "int32")
    _rejects(plan, "attn_ranges", f)


def test_rejects_microbatch_over_budget():
    f, plan = _whole_plan()
    plan.header.params.microbatch_tokens = 19
    _rejects(plan, "computed rows 20 exceed microbatch_tokens 19", f)


def test_rejects_live_stack_over_memory():
    f, plan = _window_plan()
    mm, st = plan.header.params.memory, plan.header.stats
    plan.header.params.memory_tokens = st.peak_live_tokens - 1
    mm.memory_bytes = plan.header.params.memory_tokens * mm.activation_row_bytes
    _rejects(plan, f"live window stack {st.peak_live_bytes} bytes \\({st.peak_live_tokens} row-equivalents\\) "
             f"exceeds memory_bytes {mm.memory_bytes}", f)
    mm.memory_bytes += 1
    _rejects(plan, r"header.params.memory.memory_bytes: expected memory_tokens x \(activation_row_bytes \+ "
                   r"recompute_row_bytes\)", f)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_plans_count_the_recompute_of_the_running_microbatch(mode):
    """A plan sized for activation checkpointing: the running microbatch holds kept + recompute
    bytes per row, the open parent window its kept bytes only; the validator reads the two from
    MemoryModel and agrees with the builder's peak; the budget is memory_tokens x both."""
    f = _forest()
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    part = Partition(microbatches=[MicrobatchSpec(ranges=ranges[:2]),
                                   MicrobatchSpec(ranges=ranges[2:], parent=0, shared=True, rank=0)])
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, activation_checkpointing=mode, head="chunked"), part)
    mm, st = plan.header.params.memory, plan.header.stats
    assert (mm.activation_checkpointing, mm.head) == (mode, "chunked") and mm.recompute_row_bytes > 0
    assert mm.memory_bytes == plan.header.params.memory_tokens * (mm.activation_row_bytes + mm.recompute_row_bytes)
    rows = {mb.id: mb.num_rows + mb.replay_tokens for mb in plan.ranks[0].microbatches}
    row = mm.activation_row_bytes + mm.recompute_row_bytes
    assert st.peak_live_bytes == rows[0] * mm.activation_row_bytes + rows[1] * row > rows[0] * row  # the child on top
    assert validate_plan(plan, f) is None
    plan.header.params.memory_tokens = st.peak_live_tokens - 1
    mm.memory_bytes = plan.header.params.memory_tokens * row
    _rejects(plan, f"live window stack {st.peak_live_bytes} bytes", f)
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, activation_checkpointing=mode), part)
    plan.header.params.memory.activation_checkpointing = "some"
    _rejects(plan, "header.params.memory.activation_checkpointing: expected empty or one of none, full, selective, got 'some'", f)


def test_rejects_microbatch_placed_twice():
    f, plan = _window_plan(shared=False, world_size=2)
    extra = plan.ranks[1].microbatches.add()
    extra.CopyFrom(_mb(plan, 1))
    plan.ranks[1].steps.add(kind=plan_pb2.ExecStep.FORWARD, microbatch=0)
    plan.ranks[1].steps.add(kind=plan_pb2.ExecStep.BACKWARD, microbatch=0)
    _rejects(plan, "placed on more than one rank", f)


def test_rejects_backward_before_forward_and_non_nested_steps():
    f, plan = _window_plan()
    steps = plan.ranks[0].steps
    assert [(s.kind, s.microbatch) for s in steps] == [(0, 0), (0, 1), (1, 1), (1, 0)]
    steps[2].microbatch, steps[3].microbatch = 0, 1
    _rejects(plan, "not depth-first", f)
    steps[0].kind = plan_pb2.ExecStep.BACKWARD
    _rejects(plan, "without one prior forward", f)


def test_rejects_import_from_closed_window():
    f, plan = _window_plan()
    steps = plan.ranks[0].steps
    order = [(0, 0), (1, 0), (0, 1), (1, 1)]
    for s, (k, m) in zip(steps, order):
        s.kind, s.microbatch = k, m
    _rejects(plan, "not an open window", f)


def test_rejects_inconsistent_array_lengths():
    f, plan = _whole_plan()
    mb = _mb(plan, 0)
    mb.depth = mb.depth[:-4]
    _rejects(plan, r"microbatch 0.depth: expected 12 entries, got 11", f)


def test_rejects_bad_header_and_normalizers():
    f, plan = _whole_plan()
    plan.header.version = "harts.plan.v0"
    _rejects(plan, "header.version", f)
    f, plan = _whole_plan()
    plan.header.normalizers.total_loss_tokens = 8
    _rejects(plan, "total_loss_tokens", f)


def test_rejects_wrong_stats():
    f, plan = _whole_plan()
    plan.header.stats.linear_attention_calls = 1
    _rejects(plan, "linear_attention_calls: expected 2, got 1", f)


def test_slice_detects_local_corruption():
    f, plan = _window_plan()
    sl = slice_plan(plan, 0)
    validate_slice(sl)
    sl.rank.microbatches[1].linear_calls[0].sequences[0].start_depth = 9
    with pytest.raises(PlanValidationError, match="start_depth"):
        validate_slice(sl)


def test_rejects_duplicated_copy_with_other_token():
    f, plan = _window_plan(shared=False)
    child = _mb(plan, 1)
    toks = _arr(child, "tokens", "int32")
    toks[3] = 999  # a duplicated context row that no longer matches the kept copy
    child.tokens = pack(toks, "int32")
    _rejects(plan, "disagree on token id or depth")


def test_rejects_wrong_peak_and_windows_stats():
    f, plan = _window_plan()
    plan.header.stats.peak_live_tokens += 1
    _rejects(plan, "peak_live_tokens: expected 21", f)
    f, plan = _window_plan()
    plan.header.stats.windows = 0
    _rejects(plan, "windows: expected 1", f)
