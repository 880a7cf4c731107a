"""build_plan (planner_service/planner/build.py): rows, ancestry, schedule, windows, log-prob map."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from plan.memory_model import ModelDims, RowSizes
from plan.microbatch import decode_microbatch
from plan.validator import validate_plan
from planner_service.errors import PlanningError
from planner_service.planner import serialise
from planner_service.planner.build import build_plan
from planner_service.planner.config import PlanConfig
from planner_service.planner.level1 import group_by
from planner_service.planner.logprob_map import loss_per_trajectory, lp_entries, lp_entries_ref
from planner_service.planner.min_calls import min_calls, min_calls_chunk_tree_ref
from planner_service.planner.spec import MicrobatchSpec, Partition
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from tests.builder_helpers import forest_from_trajectories, random_partition, random_trajectories


def _whole(forest) -> Partition:
    ranges = np.array([[s, 0, forest.seg_length[s]] for s in range(forest.num_segments)], np.int64)
    return Partition(microbatches=[MicrobatchSpec(ranges=ranges)])


def _nested_forest():
    prefix = list(range(1, 8))
    return forest_from_trajectories([prefix + [101, 102, 103], prefix + [101, 102, 201], prefix + [301]],
                                    loss_masks=[[0] * 7 + [1, 1, 1], [0] * 7 + [1, 1, 1], [0] * 7 + [1]])


def _mbs(plan):
    return {mb.id: mb for r in plan.ranks for mb in r.microbatches}


def _seqs(mb):
    return [(ci, unpack(s.replay_rows, "int32").tolist(), s.row_start, s.row_end, s.start_depth,
             s.init_state.kind, [(e.state, e.depth) for e in s.exports])
            for ci, c in enumerate(mb.linear_calls) for s in c.sequences]


def test_whole_forest_microbatch_worked_nested_case():
    f = _nested_forest()
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64), _whole(f))
    validate_plan(plan, f)
    mb = plan.ranks[0].microbatches[0]
    # Depth-first, continuing child first: X (f = 2) before Y; inside X, 103 continues.
    assert unpack(mb.tokens, "int32").tolist() == [1, 2, 3, 4, 5, 6, 7, 101, 102, 103, 201, 301]
    assert _seqs(mb) == [
        (0, [], 0, 10, 0, plan_pb2.StateSource.ZERO, [(0, 8)]),
        (0, [0, 1, 2, 3, 4, 5, 6], 11, 12, 0, plan_pb2.StateSource.ZERO, []),
        (1, [8], 10, 11, 8, plan_pb2.StateSource.LOCAL, []),
    ]
    st = plan.header.stats
    assert (st.linear_attention_calls, st.replay_tokens, st.unique_tokens, st.expanded_tokens) == (2, 8, 12, 28)
    assert unpack(mb.occurrence, "int32").tolist() == [3] * 7 + [2, 2, 1, 1, 1]
    # log-prob entries: loss positions >= 1, row = kept row of token i-1, label = token i
    assert len(unpack(mb.lp_row, "int32")) == 3 + 3 + 1
    conv = unpack(mb.conv_ancestors, "int32", width=3)
    assert conv[10].tolist() == [6, 7, 8] and conv[11].tolist() == [4, 5, 6] and conv[0].tolist() == [-1, -1, -1]
    offs, rg = unpack(mb.attn_offsets, "int32"), unpack(mb.attn_ranges, "int32", width=2)
    assert [rg[offs[s]:offs[s + 1]].tolist() for s in range(len(offs) - 1)] == [[], [[0, 7]], [[0, 9]], [[0, 9]], [[0, 7]]]


@pytest.mark.parametrize("shared", [True, False], ids=["window", "duplicated"])
def test_parent_child_split(shared):
    f = _nested_forest()
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    part = Partition(microbatches=[MicrobatchSpec(ranges=ranges[:2]),
                                   MicrobatchSpec(ranges=ranges[2:], parent=0, shared=shared)])
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64), part)
    validate_plan(plan, f)
    parent, child = _mbs(plan)[0], _mbs(plan)[1]
    if shared:
        assert unpack(child.tokens, "int32").tolist() == [103, 201, 301]
        assert unpack(child.import_row, "int32").tolist() == list(range(9))
        assert unpack(parent.export_rows, "int32").tolist() == list(range(9))
        assert unpack(parent.export_states, "int32").tolist() == [0]
        assert [(s.microbatch, s.state) for s in child.state_imports] == [(0, 0)]
        # Both 103 and 201 restart at depth 8 from the imported state, replaying 102; 301 replays 7.
        assert [(s[1], s[4], s[5]) for s in _seqs(child)] == [
            ([11], 8, plan_pb2.StateSource.IMPORTED), ([11], 8, plan_pb2.StateSource.IMPORTED),
            ([3, 4, 5, 6, 7, 8, 9], 0, plan_pb2.StateSource.ZERO)]
        assert plan.header.stats.windows == 1 and plan.header.stats.duplicated_tokens == 0
    else:
        assert unpack(child.tokens, "int32").tolist() == [1, 2, 3, 4, 5, 6, 7, 101, 102, 103, 201, 301]
        assert unpack(child.seg_duplicated, "uint8").tolist() == [1, 1, 0, 0, 0]
        assert unpack(child.occurrence, "int32").tolist() == [0] * 9 + [1, 1, 1]
        assert len(child.import_row) == 0 and plan.header.stats.duplicated_tokens == 9
        # lp entries of duplicated rows stay with the parent (which keeps them)
        assert set(unpack(child.lp_row, "int32").tolist()) <= {9, 10, 11}




def test_nested_windows_reexport_rows_and_import_states_from_owner():
    # One long path split at aligned depths 8 and 16 plus branches at unaligned depths.
    base = list(range(1, 25))
    trajs = [base, base[:11] + [90, 91, 92, 93, 94, 95, 96], base[:19] + [80, 81]]
    f = forest_from_trajectories(trajs)
    # seg 0: [0,11), seg 1: [11,19) (base), seg 2: [19,24) (base), seg 3: 80.., seg 4: 90..
    segs = {(int(f.seg_depth[s]), int(f.tokens[f.seg_offset[s]])): s for s in range(f.num_segments)}
    s0, s1, s2, s3, s4 = segs[(0, 1)], segs[(11, 12)], segs[(19, 20)], segs[(19, 80)], segs[(11, 90)]
    part = Partition(microbatches=[
        MicrobatchSpec(ranges=np.array([[s0, 0, 11], [s4, 0, 7]])),
        MicrobatchSpec(ranges=np.array([[s1, 0, 8]]), parent=0, shared=True),
        MicrobatchSpec(ranges=np.array([[s2, 0, 5], [s3, 0, 2]]), parent=1, shared=True),
    ])
    cfg = PlanConfig(chunk_size=8, microbatch_tokens=64)
    plan = build_plan(f, cfg, part)
    validate_plan(plan, f)
    mbs = _mbs(plan)
    # The grandchild imports all 19 ancestor rows from the middle microbatch, which re-exports the
    # 11 rows it imported from the root microbatch.
    assert len(unpack(mbs[2].import_row, "int32")) == 19
    assert set(unpack(mbs[1].export_rows, "int32").tolist()) >= set(range(8, 8 + 11))
    # Grandchild pieces start at depth 19 -> state at 16, computed by the middle microbatch.
    assert {(s.microbatch) for s in mbs[2].state_imports} == {1}
    assert {(s.microbatch) for s in mbs[1].state_imports} == {0}


def _recomputed_middle_window(sizes):
    base = list(range(1, 25))
    f = forest_from_trajectories([base, base[:11] + [90, 91, 92, 93, 94, 95, 96], base[:19] + [80, 81]])
    segs = {(int(f.seg_depth[s]), int(f.tokens[f.seg_offset[s]])): s for s in range(f.num_segments)}
    s0, s1, s2, s3, s4 = segs[(0, 1)], segs[(11, 12)], segs[(19, 20)], segs[(19, 80)], segs[(11, 90)]
    part = Partition(microbatches=[
        MicrobatchSpec(ranges=np.array([[s0, 0, 11], [s4, 0, 7]])),
        MicrobatchSpec(ranges=np.array([[s1, 0, 8]]), parent=0, shared=True, recompute=True),
        MicrobatchSpec(ranges=np.array([[s2, 0, 5], [s3, 0, 2]]), parent=1, shared=True),
    ])
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, row_sizes=sizes), part)
    return f, plan, _mbs(plan)


def test_recomputed_window_counts_only_the_exported_rows_it_keeps():
    # As above, with the middle window recomputed: while the grandchild runs, the middle window
    # holds its 8 own exported rows; the 11 it imported and re-exports are live in the root window.
    # Row-counting sizes: a computed row and an exported ATTN row are one unit each.
    f, plan, mbs = _recomputed_middle_window(RowSizes.rows())
    exports = unpack(mbs[1].export_rows, "int32")
    assert len(exports) == 19 and int((exports < mbs[1].num_rows).sum()) == 8
    computed = {m: mb.num_rows + mb.replay_tokens for m, mb in mbs.items()}
    peak = computed[2] + computed[0] + 8
    assert plan.header.stats.peak_live_bytes == plan.header.stats.peak_live_tokens == peak
    validate_plan(plan, f)
    plan.header.params.memory_tokens = peak - 1
    plan.header.params.memory.memory_bytes = peak - 1
    with pytest.raises(ValueError, match=f"live window stack {peak} bytes .* exceeds memory_bytes {peak - 1}"):
        validate_plan(plan, f)


def test_recomputed_window_keeps_each_kind_of_export_at_its_own_size():
    # The grandchild's pieces start at depth 19 below the middle window's rows at depths 11..18
    # (C = 8, K = 4): it attends to all 8 (ATTN), its conv reads depths 16..18 (CONV), its
    # sequences replay depths 16..18 (KERNEL) from the state at depth 16 (one state): all owned by
    # the middle window, which therefore keeps 8 a + 3 c + 3 k + 1 s bytes while recomputed.
    sizes = RowSizes(activation_row_bytes=1_000_000, attn_row_bytes=1, conv_row_bytes=10, kernel_row_bytes=100,
                     state_bytes=10_000)
    f, plan, mbs = _recomputed_middle_window(sizes)
    computed = {m: mb.num_rows + mb.replay_tokens for m, mb in mbs.items()}
    middle = 8 * 1 + 3 * 10 + 3 * 100 + 1 * 10_000
    assert plan.header.stats.peak_live_bytes == (computed[2] + computed[0]) * 1_000_000 + middle
    assert plan.header.stats.peak_live_tokens == computed[2] + computed[0] + 1
    assert plan.header.params.memory.activation_row_bytes == 1_000_000
    validate_plan(plan, f)


def test_default_memory_model_sizes_windows_from_the_model_config():
    # Without a model config: Qwen3-Next-80B-A3B in fp32; a named config changes every size.
    f, plan, mbs = _recomputed_middle_window(None)
    mm = plan.header.params.memory
    assert mm.model.startswith("default") and mm.dtype == "float32"
    dims = ModelDims.default()
    assert mm.attn_row_bytes == 12 * 2 * 2 * 256 * 4 and mm.state_bytes == 36 * 32 * 128 * 128 * 4
    assert mm.activation_row_bytes == RowSizes.of(dims, "float32", 8).activation_row_bytes
    assert mm.memory_bytes == plan.header.params.memory_tokens * mm.activation_row_bytes
    validate_plan(plan, f)


CASES = [
    dict(chunk_size=1, conv_kernel=4), dict(chunk_size=2, conv_kernel=2), dict(chunk_size=4, conv_kernel=4),
    dict(chunk_size=8, conv_kernel=1), dict(chunk_size=8, conv_kernel=4, replay=False),
    dict(chunk_size=4, conv_kernel=3, all_positions=True), dict(chunk_size=8, conv_kernel=4, windows=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_random_forests_and_partitions_validate(case):
    rng = np.random.default_rng(sum(ord(ch) for ch in str(case)))
    C = case["chunk_size"]
    for it in range(6):
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(2, 14)), max_len=5 * C + 6, vocab=4, trees=2, chunk=C)
        f = forest_from_trajectories(trajs, tree_of=tree_of, seed=it)
        world = int(rng.integers(1, 4))
        cfg = PlanConfig(world_size=world, microbatch_tokens=4096, **case)
        part = random_partition(f, rng, chunk=C, world_size=world, windows=cfg.windows)
        plan = build_plan(f, cfg, part)
        validate_plan(plan, f)
        mbs = _mbs(plan)
        # every trajectory passes once through each kept row of its path
        kept_occ = sum(int(unpack(mb.occurrence, "int32").sum()) for mb in mbs.values())
        assert kept_occ == f.expanded_tokens
        n_lp = sum(len(unpack(mb.lp_row, "int32")) for mb in mbs.values())
        if cfg.all_positions:
            assert n_lp == f.expanded_tokens - f.num_trajectories
        st = plan.header.stats
        assert st.computed_tokens == st.unique_tokens + st.replay_tokens + st.duplicated_tokens
        assert st.windows == sum(1 for sp in part.microbatches if sp.parent >= 0 and sp.shared)
        if cfg.replay:  # every microbatch's schedule is optimal for its local forest
            for mb in mbs.values():
                start, par = unpack(mb.seg_start, "int32"), unpack(mb.seg_parent, "int32")
                local = (par, unpack(mb.depth, "int32")[start], unpack(mb.seg_length, "int32"), C)
                assert len(mb.linear_calls) == min_calls(*local) == min_calls_chunk_tree_ref(*local)
        # the Numba kernels and their plain-Python twins give byte-identical plans
        ref = build_plan(f, cfg, part, impl="ref")
        assert ref.SerializeToString(deterministic=True) == plan.SerializeToString(deterministic=True)


def test_whole_forest_calls_equal_min_calls():
    rng = np.random.default_rng(5)
    for C in (2, 4, 8):
        trajs, tree_of = random_trajectories(rng, n=20, max_len=6 * C, vocab=3, trees=2, chunk=C)
        f = forest_from_trajectories(trajs, tree_of=tree_of)
        plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=4096), _whole(f))
        assert plan.header.stats.linear_attention_calls == min_calls(f.seg_parent, f.seg_depth, f.seg_length, C)


def test_header_normalizers_and_steps():
    f = _nested_forest()
    part = _whole(f)
    plan = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, world_size=2), part)
    h = plan.header
    assert h.version == "harts.plan.v1" and h.params.chunk_size == 8 and h.params.world_size == 2
    assert list(h.trajectory_ids) == ["t0", "t1", "t2"]
    assert unpack(h.trajectory_lengths, "int32").tolist() == [10, 10, 8]
    assert h.normalizers.total_loss_tokens == 7 and unpack(h.normalizers.traj_loss_tokens, "float32").tolist() == [3, 3, 1]
    assert [(s.kind, s.microbatch) for s in plan.ranks[0].steps] == [(plan_pb2.ExecStep.FORWARD, 0), (plan_pb2.ExecStep.BACKWARD, 0)]
    assert len(plan.ranks[1].microbatches) == 0
    assert list(h.stats.rank_costs) == [20.0, 0.0] and h.stats.imbalance == 2.0


def test_bad_partitions_are_rejected():
    f = _nested_forest()
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    cfg = PlanConfig(chunk_size=8, microbatch_tokens=64)
    with pytest.raises(PlanningError, match="in no microbatch"):
        build_plan(f, cfg, Partition(microbatches=[MicrobatchSpec(ranges=ranges[:-1])]))
    with pytest.raises(PlanningError, match="kept once"):
        build_plan(f, cfg, Partition(microbatches=[MicrobatchSpec(ranges=ranges), MicrobatchSpec(ranges=ranges[:1])]))
    with pytest.raises(PlanningError, match="expected a parent"):
        build_plan(f, cfg, Partition(microbatches=[MicrobatchSpec(ranges=ranges[:1]), MicrobatchSpec(ranges=ranges[1:])]))
    with pytest.raises(PlanningError, match="rank"):
        build_plan(f, cfg, Partition(microbatches=[MicrobatchSpec(ranges=ranges, rank=3)]))
    two = PlanConfig(chunk_size=8, microbatch_tokens=64, world_size=2)
    with pytest.raises(PlanningError, match="stays on its parent's rank"):
        build_plan(f, two, Partition(microbatches=[MicrobatchSpec(ranges=ranges[:2]),
                                                   MicrobatchSpec(ranges=ranges[2:], parent=0, shared=True, rank=1)]))


@pytest.mark.parametrize("all_positions", [False, True], ids=["loss", "all"])
def test_logprob_map_kernels_match_references(all_positions):
    rng = np.random.default_rng(17)
    for it in range(5):
        trajs, tree_of = random_trajectories(rng, n=int(rng.integers(1, 25)), max_len=40, vocab=3, trees=3)
        f = forest_from_trajectories(trajs, tree_of=tree_of, seed=it)
        got = lp_entries(f.traj_offset, f.traj_seg, f.seg_parent, f.seg_offset, f.seg_depth, f.seg_length,
                         f.loss_mask, all_positions)
        for a, b in zip(got, lp_entries_ref(f, all_positions)):
            np.testing.assert_array_equal(a, b)
        g, traj, pos, prev_tok, tok = got
        for t in range(f.num_trajectories):  # labels are the trajectory's own tokens
            sel = traj == t
            np.testing.assert_array_equal(f.tokens[tok[sel]], np.asarray(trajs[t])[pos[sel]])
            np.testing.assert_array_equal(f.tokens[prev_tok[sel]], np.asarray(trajs[t])[pos[sel] - 1])
        # loss terms: positions 1..L-1 (position 0 has no log-prob, whatever its mask bit)
        np.testing.assert_array_equal(loss_per_trajectory(f.traj_offset, f.loss_mask),
                                      [int(f.loss_mask[a + 1:b].sum()) for a, b in zip(f.traj_offset[:-1], f.traj_offset[1:])])
        keys = rng.integers(0, 7, 50)
        order, bounds = group_by(keys, 7)
        np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
        np.testing.assert_array_equal(bounds, np.searchsorted(np.sort(keys), np.arange(8)))


@pytest.mark.parametrize("case", range(4))
def test_builder_arrays_equal_the_decoded_plan(case, monkeypatch):
    # The memory model runs on the builder's own MicrobatchArrays (no decoding pass): they must
    # be what decode_microbatch reads back from the serialised microbatch.

    seen = {}
    real = serialise._arrays

    def spy(msg, *args, **kw):
        out = real(msg, *args, **kw)
        seen[out.id] = (msg, out)
        return out

    monkeypatch.setattr(serialise, "_arrays", spy)
    rng = np.random.default_rng(100 + case)
    C = [2, 4, 8, 8][case]
    trajs, tree_of = random_trajectories(rng, n=12, max_len=5 * C + 7, vocab=4, trees=2, chunk=C)
    f = forest_from_trajectories(trajs, tree_of=tree_of, seed=case)
    cfg = PlanConfig(chunk_size=C, microbatch_tokens=1024, replay=case != 3, world_size=2)
    plan = build_plan(f, cfg, random_partition(f, rng, chunk=C, world_size=2))
    assert seen
    for m, (msg, got) in seen.items():
        want = decode_microbatch(msg, plan.header.params)
        for fld in dataclasses.fields(want):
            a, b = getattr(got, fld.name), getattr(want, fld.name)
            if fld.name == "linear_calls":
                assert len(a) == len(b)
                for ca, cb in zip(a, b):
                    for cf in dataclasses.fields(cb):
                        np.testing.assert_array_equal(getattr(ca, cf.name), getattr(cb, cf.name), err_msg=f"{m}.{cf.name}")
            elif isinstance(b, np.ndarray):
                np.testing.assert_array_equal(np.asarray(a).reshape(b.shape), b, err_msg=f"{m}.{fld.name}")
            else:
                assert a == b, (m, fld.name, a, b)
