"""plan/cross_edges.py and the validator's rules of windows across ranks (plan.proto CrossEdge):
a hand-built two-rank lock-step plan whose window crosses ranks, accepted, then broken field by
field."""
from __future__ import annotations

import numpy as np
import pytest

from plan.cross_edges import CrossEdgeArrays, decode_edges, edge_bytes, held_bytes, transfer_bytes
from plan.memory_model import RowSizes, rank_live_bytes
from plan.microbatch import decode_microbatch
from plan.phases import step_cost
from plan.seal import slice_plan
from plan.validator import PlanValidationError, validate_plan, validate_slice
from plan.window_exports import ATTN, CONV, KERNEL, ExportNeeds
from planner_service.planner.build import build_plan
from planner_service.planner.config import PlanConfig
from planner_service.planner.spec import MicrobatchSpec, Partition
from proto.arrays import pack, unpack
from tests.builder_helpers import forest_from_trajectories

SIZES = RowSizes(activation_row_bytes=100, attn_row_bytes=4, conv_row_bytes=2, kernel_row_bytes=8, state_bytes=20)


def _forest():
    prefix = list(range(1, 8))
    return forest_from_trajectories([prefix + [101, 102, 103], prefix + [101, 102, 201], prefix + [301]],
                                    loss_masks=[[0] * 7 + [1, 1, 1], [0] * 7 + [1, 1, 1], [0] * 7 + [1]])


def _crossing_plan():
    """Microbatch 0 (the prefix and one branch) on rank 0 exports to microbatch 1 on rank 1.

    Phases F F B B: rank 0 runs F(0), a stand-in pair, B(0); rank 1 a stand-in pair around F(1), B(1).
    """
    f = _forest()
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    part = Partition(
        microbatches=[MicrobatchSpec(ranges=ranges[:2], rank=0), MicrobatchSpec(ranges=ranges[2:], parent=0, shared=True, rank=1)],
        rank_steps=[[("F", 0), ("F", -1), ("B", -1), ("B", 0)], [("F", -1), ("F", 1), ("B", 1), ("B", -1)]],
        phases=np.array([0, 0, 1, 1], np.uint8))
    cfg = PlanConfig(chunk_size=8, microbatch_tokens=64, world_size=2, lockstep=True, row_sizes=SIZES, memory_tokens=64)
    return f, build_plan(f, cfg, part)


def _edit(plan, fn, ranks=(0, 1)):
    for r in ranks:
        fn(plan.ranks[r].cross_edges[0])
    return plan


def test_accepts_a_window_across_ranks_and_its_slices():
    f, plan = _crossing_plan()
    validate_plan(plan, f)
    for r in range(2):
        validate_slice(slice_plan(plan, r))
    (e,) = decode_edges(plan.ranks[1])
    assert (e.exporter, e.exporter_rank, e.importer, e.importer_rank, e.send_phase, e.grad_phase) == (0, 0, 1, 1, 0, 2)
    assert plan.ranks[0].cross_edges[0] == plan.ranks[1].cross_edges[0]
    imports = unpack(plan.ranks[1].microbatches[0].import_row, "int32")
    assert e.rows[ATTN].tolist() == sorted(imports.tolist())  # every imported row is an attention ancestor
    # the conv inputs of the K-1 = 3 rows above each of its two attach points (102 for 103 and 201, 7 for 301)
    assert e.rows[CONV].shape[0] == 5 and e.bytes == edge_bytes(SIZES, e.needs) > 0
    st = plan.header.stats
    assert (st.cross_edges, st.exchanged_bytes, st.max_rank_exchanged_bytes) == (1, 2 * e.bytes, 2 * e.bytes)
    tb = plan.header.params.cost_model.transfer_byte
    assert list(st.rank_transfer_costs) == [pytest.approx(2 * e.bytes * tb)] * 2
    steps = sum(max(step_cost(ph, rp.microbatches[s.microbatch].cost) if s.microbatch >= 0 else 0.0 for rp in plan.ranks
                    for s in [rp.steps[i]]) for i, ph in enumerate([0, 0, 1, 1]))
    assert st.lockstep_makespan == pytest.approx(steps + 2 * e.bytes * tb)  # sent in phase 0, gradients in phase 2
    # a slice keeps its own rank's transfer cost only
    assert list(slice_plan(plan, 1).header.stats.rank_transfer_costs) == [st.rank_transfer_costs[1]]


def _rejects(plan, match, f=None):
    with pytest.raises(PlanValidationError, match=match):
        validate_plan(plan, f)


def test_rejects_rows_the_importer_does_not_read_exactly():
    f, plan = _crossing_plan()

    def drop(e):
        rows = unpack(e.attn_rows, "int32")[:-1]
        e.attn_rows = pack(rows, "int32")
        e.bytes -= SIZES.attn_row_bytes

    _rejects(_edit(plan, drop), r"rank 1.cross_edges\[0\].attn_rows: expected the \d+ rows of microbatch 0 that microbatch 1 "
                                r"and its importers read, got \d+ rows \(row \d+ is missing\)")
    f, plan = _crossing_plan()

    def no_state(e):
        e.states = pack(np.zeros(0, np.int32), "int32")
        e.bytes -= SIZES.state_bytes

    if len(unpack(plan.ranks[1].cross_edges[0].states, "int32")):
        _rejects(_edit(plan, no_state), r"cross_edges\[0\].states: expected every state")


def test_rejects_phases_out_of_order():
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "send_phase", 1)),
             r"rank 1.cross_edges\[0\].send_phase: expected < 1 \(the importer's FORWARD phase\), got 1")
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "grad_phase", 1)),
             r"rank 1.cross_edges\[0\].grad_phase: expected >= 2 \(the importer's BACKWARD phase\), got 1")
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "grad_phase", 3)),
             r"rank 0.cross_edges\[0\].grad_phase: expected < 3 \(the exporter's BACKWARD phase\), got 3")
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "send_phase", 2)), r"expected 0 <= send_phase < grad_phase < 4")


def test_rejects_wrong_bytes_ranks_and_ids():
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "bytes", e.bytes + 1)), r"cross_edges\[0\].bytes: expected \d+ \(the memory model of its rows and states")
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "importer_rank", 0)), r"importer_rank: expected two different ranks, a rank other than the exporter's")
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "id", 1), ranks=(1,)), r"cross edge 0: expected it on its exporter's and its importer's rank, got one rank only")
    f, plan = _crossing_plan()
    del plan.ranks[0].cross_edges[0]
    _rejects(plan, r"cross edge 0: expected it on its exporter's and its importer's rank, got one rank only")
    f, plan = _crossing_plan()
    for r in range(2):
        del plan.ranks[r].cross_edges[0]
    _rejects(plan, r"rank 1.steps\[1\]: microbatch 1 imports from 0, which is not an open window here")
    f, plan = _crossing_plan()
    _rejects(_edit(plan, lambda e: setattr(e, "exporter", 5)), r"rank 0.cross_edges\[0\].exporter: expected a "
                                                               r"microbatch of rank 0, got 5")


def test_rejects_wrong_statistics():
    f, plan = _crossing_plan()
    plan.header.stats.exchanged_bytes += 1
    _rejects(plan, r"header.stats.cross_edges: expected \(cross_edges, exchanged_bytes, max_rank_exchanged_bytes\)")
    f, plan = _crossing_plan()
    plan.header.stats.rank_transfer_costs[0] *= 2
    _rejects(plan, r"header.stats.rank_transfer_costs: expected transfer_byte x each rank's exchanged bytes")
    f, plan = _crossing_plan()
    plan.header.stats.lockstep_makespan -= 2 * plan.ranks[0].cross_edges[0].bytes * plan.header.params.cost_model.transfer_byte
    _rejects(plan, r"header.stats.lockstep_makespan: expected the sum over phases of the slowest rank's step cost \(with its transfers\)")


def test_rejects_windows_across_ranks_in_a_free_plan():
    f, plan = _crossing_plan()
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    part = Partition(microbatches=[MicrobatchSpec(ranges=ranges[:2]), MicrobatchSpec(ranges=ranges[2:], parent=0, shared=True)])
    free = build_plan(f, PlanConfig(chunk_size=8, microbatch_tokens=64, world_size=2, row_sizes=SIZES, memory_tokens=64), part)
    validate_plan(free, f)
    free.ranks[0].cross_edges.add().CopyFrom(plan.ranks[0].cross_edges[0])
    _rejects(free, r"rank 0.cross_edges: expected none in a free plan \(windows cross ranks only in lock-step plans\), got 1")


def test_memory_counts_what_an_importer_holds_and_what_an_exporter_keeps():
    edge = CrossEdgeArrays(id=0, exporter=0, exporter_rank=0, importer=1, importer_rank=1,
                           rows={ATTN: np.arange(5), CONV: np.arange(2, 5), KERNEL: np.zeros(0, np.int64)},
                           states=np.zeros(1, np.int64), send_phase=1, grad_phase=4, bytes=7)
    np.testing.assert_array_equal(held_bytes([edge], 1, 6), [0, 0, 7, 7, 7, 0])  # phases send_phase < p <= grad_phase
    np.testing.assert_array_equal(held_bytes([edge], 0, 6), np.zeros(6))
    np.testing.assert_array_equal(transfer_bytes([edge], 0, 6), [0, 7, 0, 0, 7, 0])
    np.testing.assert_array_equal(transfer_bytes([edge], 1, 6), transfer_bytes([edge], 0, 6))
    assert edge_bytes(SIZES, edge.needs) == 5 * 4 + 3 * 2 + 20
    # the exporter rank of the hand-built plan: a recomputed exporter keeps what the remote importer reads
    f, plan = _crossing_plan()

    mb0 = decode_microbatch(plan.ranks[0].microbatches[0], plan.header.params)
    mb0.recompute = True
    (e,) = decode_edges(plan.ranks[0])
    steps = [(True, 0), (False, 0)]
    alone = rank_live_bytes(SIZES, {0: mb0}, steps)[1]
    assert rank_live_bytes(SIZES, {0: mb0}, steps, sent={0: [e.needs]})[1] == alone  # nothing opens above it
    live, _ = rank_live_bytes(SIZES, {0: mb0}, steps, held=[3, 5])
    assert live == [alone + 3, alone + 5]
    # the importer's rank: its import from the other rank is the edge's (remote), what it received is held
    mb1 = decode_microbatch(plan.ranks[1].microbatches[0], plan.header.params)
    steps = [(True, mb1.id), (False, mb1.id)]
    with pytest.raises(ValueError, match="imported from but not in the forward order"):
        rank_live_bytes(SIZES, {mb1.id: mb1}, steps)  # without the edge the exporter is missing
    live, _ = rank_live_bytes(SIZES, {mb1.id: mb1}, steps, remote={(e.exporter, mb1.id)}, held=[e.bytes] * 2)
    assert live == [SIZES.full_bytes(mb1.num_rows + mb1.replay_tokens) + e.bytes] * 2
    assert ExportNeeds().local_counts(0) == {ATTN: 0, CONV: 0, KERNEL: 0}
