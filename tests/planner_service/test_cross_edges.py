"""Windows across ranks in the planner (docs/design/cross-rank.md): crossing partitions, the aligner with dependents
on other ranks, the CrossEdges the builder writes, and plan_step's choice between the plans."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from plan.cross_edges import decode_edges
from plan.memory_model import RowSizes
from plan.phases import PHASE_FORWARD
from plan.seal import slice_plan
from plan.validator import validate_plan, validate_slice
from planner_service.planner import PlanConfig, crossing_partitions, lockstep, plan_step, step
from planner_service.planner.build import build_plan
from planner_service.planner.cost_model import DEFAULT_TRANSFER_ROWS_PER_BYTE, CostModel
from planner_service.planner.crossing import import_duplicates
from planner_service.planner.edge_modes import SHORT_PREFIX_FRACTION
from planner_service.planner.spec import MicrobatchSpec, Partition
from planner_service.planner.step import CROSS_EQUAL_MAKESPAN
from proto.arrays import unpack
from tests.builder_helpers import aligned_by_both, forest_from_trajectories, random_trajectories, random_window_forest

#: memory-model sizes at which moving a row's exports costs a few percent of computing it (the
#: default model's sizes make crossing pointless on forests of a few hundred rows)
SIZES = RowSizes(activation_row_bytes=100, attn_row_bytes=4, conv_row_bytes=2, kernel_row_bytes=8, state_bytes=20)


def _forest(seed: int, chunk: int = 8):
    rng = np.random.default_rng(seed)
    trajs, tree_of = random_trajectories(rng, n=int(rng.integers(6, 24)), max_len=12 * chunk, vocab=6,
                                         trees=int(rng.integers(1, 3)), chunk=chunk)
    return forest_from_trajectories(trajs, tree_of=tree_of, seed=seed)


def _cfg(world_size: int, **kw) -> PlanConfig:
    kw = {"lockstep": True, "microbatch_tokens": 32, "memory_tokens": 200} | kw
    return PlanConfig(chunk_size=8, world_size=world_size, row_sizes=SIZES, **kw)


def _identities(mb) -> np.ndarray:
    """int64 [R] (forest segment << 32 | offset) of every local row."""
    start, length = unpack(mb.seg_start, "int32"), unpack(mb.seg_length, "int32")
    seg, off = unpack(mb.seg_forest, "int32").astype(np.int64), unpack(mb.seg_forest_offset, "int32").astype(np.int64)
    row_seg = np.repeat(np.arange(start.shape[0]), length)
    return (seg[row_seg] << 32) | (off[row_seg] + np.arange(row_seg.shape[0]) - start[row_seg])


def _crossing_plans():
    """Every crossing candidate's plan on random forests with more ranks than trees."""
    for seed, W in itertools.product(range(6), (3, 5)):
        f = _forest(seed)
        cfg = _cfg(W)
        for _, part, _ in crossing_partitions(f, cfg):
            yield f, cfg, build_plan(f, cfg, part)


def test_crossing_plans_validate_and_import_their_prefix_instead_of_computing_it():
    edges = 0
    for f, cfg, plan in _crossing_plans():
        validate_plan(plan, f)
        for r in range(cfg.world_size):
            validate_slice(slice_plan(plan, r))
        st = plan.header.stats
        assert plan.header.params.cross_rank_windows and plan.header.params.cost_model.transfer_byte > 0
        by_id = {mb.id: (r, mb) for r, rp in enumerate(plan.ranks) for mb in rp.microbatches}
        phase = {}
        for r, rp in enumerate(plan.ranks):
            for i, s in enumerate(rp.steps):
                if s.microbatch >= 0:
                    phase[s.kind, rp.microbatches[s.microbatch].id] = i
        P = st.lockstep_phases
        moved = 0
        for rp in plan.ranks:
            for e in decode_edges(rp):
                if rp.rank != e.importer_rank:
                    continue
                edges += 1
                moved += 2 * e.bytes
                assert by_id[e.exporter][0] == e.exporter_rank and by_id[e.importer][0] == e.importer_rank
                # the planner sends just before the importer forwards, returns right after it closes
                assert e.send_phase == phase[0, e.importer] - 1 and e.grad_phase == phase[1, e.importer]
                # what the importer reads of the exporter's own rows is not recomputed on its rank, but
                # by a microbatch whose edge duplicates a short prefix (level 2: shorter than a chunk,
                # or than SHORT_PREFIX_FRACTION of its kept rows)
                _, x = by_id[e.exporter]
                rows = np.union1d(np.union1d(e.rows["attn"], e.rows["conv"]), e.rows["kernel"])
                imported = _identities(x)[rows[rows < x.num_rows]]
                for mb in plan.ranks[e.importer_rank].microbatches:
                    hit = np.isin(_identities(mb), imported)
                    if hit.any():
                        dup = np.repeat(unpack(mb.seg_duplicated, "uint8"), unpack(mb.seg_length, "int32"))
                        kept = mb.num_rows - mb.duplicated_tokens
                        assert dup[hit].all() and not len(mb.import_row), "an imported prefix row is recomputed"
                        assert mb.duplicated_tokens < max(cfg.chunk_size, SHORT_PREFIX_FRACTION * kept)
        assert st.exchanged_bytes == moved and st.cross_edges == sum(len(rp.cross_edges) for rp in plan.ranks) // 2
    assert edges > 20, "the forests give windows across ranks"


def test_a_shared_prompt_is_computed_once_across_ranks():
    # two trees, each a 20-token prompt with six 60-token branches, on six ranks: the crossing plan
    # imports each prompt from the rank that computes it, nothing is duplicated
    rng = np.random.default_rng(0)
    trajs, tree_of = [], []
    for t in range(2):
        prompt = rng.integers(0, 50, 20).tolist()
        for b in range(6):
            trajs.append(prompt + [100 + b] + rng.integers(0, 50, 59).tolist())
            tree_of.append(f"t{t}")
    f = forest_from_trajectories(trajs, tree_of=tree_of, seed=0)
    cfg = _cfg(6, microbatch_tokens=128, memory_tokens=1024)
    plans = [build_plan(f, cfg, part) for _, part, _ in crossing_partitions(f, cfg)]
    full = [p for p in plans if p.header.stats.cross_edges and p.header.stats.duplicated_tokens == 0]
    assert full, "a candidate imports every shared prompt"
    for plan in full:
        validate_plan(plan, f)
        st = plan.header.stats
        assert st.computed_tokens == st.unique_tokens + st.replay_tokens  # every distinct token computed once
    base = plan_step(f, dataclasses.replace(cfg, cross_rank_windows=False)).header.stats
    assert base.duplicated_tokens > 0  # without windows across ranks every rank recomputes its prompt


@pytest.mark.parametrize("seed", range(12))
def test_align_phases_with_dependents_on_other_ranks_matches_reference(seed):
    rng = np.random.default_rng(seed)
    W = int(rng.integers(2, 6))
    M = int(rng.integers(2, 40))
    mb_rank, wparent, cost, forced, full, win, exports, budget, priority = random_window_forest(rng, M, W, crossing=True)
    finished = 0
    for power, rec_open, small_fill in itertools.product(lockstep.WEIGHT_POWERS, (False, True), (False, True)):
        args = (mb_rank, wparent, cost, priority, forced, full, win, exports, budget, W, power,
                lockstep.VOLUNTARY_SLACK, rec_open, small_fill)
        phases, step_phase, step_mb, voluntary, _ = aligned_by_both(args)
        if step_mb.shape[0] < 2 * M:  # stalled: every rank waits for another
            assert lockstep.schedule(lockstep.align_phases, *args[:10], power, rec_open, small_fill) is None
            continue
        finished += 1
        fwd = {m: p for p, m in zip(step_phase.tolist(), step_mb.tolist()) if phases[p] == PHASE_FORWARD}
        bwd = {m: p for p, m in zip(step_phase.tolist(), step_mb.tolist()) if phases[p] != PHASE_FORWARD}
        for m in range(M):
            p = int(wparent[m])
            if p >= 0:  # a dependent forwards after its parent's phase and closes before the parent's
                assert fwd[p] < fwd[m] and bwd[m] < bwd[p]
        stacks: dict[int, list[int]] = {}
        for p, m in zip(step_phase.tolist(), step_mb.tolist()):
            st = stacks.setdefault(int(mb_rank[m]), [])
            if phases[p] == PHASE_FORWARD:
                st.append(m)
            else:
                assert st.pop() == m, "windows close depth-first on every rank"
    assert finished, "some order finishes"


def test_plan_step_keeps_windows_across_ranks_only_where_they_pay():
    chosen = 0
    for seed, W in itertools.product(range(6), (3, 5)):
        f = _forest(seed)
        cfg = _cfg(W)
        plan = plan_step(f, cfg)
        validate_plan(plan, f)
        st = plan.header.stats
        x, b = st.with_cross_edges, st.without_cross_edges
        assert b.lockstep_makespan > 0 and b.cross_edges == 0
        if st.cross_edges:
            chosen += 1
            assert x.cross_edges == st.cross_edges and x.lockstep_makespan == st.lockstep_makespan
            assert x.lockstep_makespan < b.lockstep_makespan or (
                x.lockstep_makespan <= (1 + CROSS_EQUAL_MAKESPAN) * b.lockstep_makespan and x.duplicated_tokens < b.duplicated_tokens)
        else:
            assert st.lockstep_makespan == b.lockstep_makespan and st.duplicated_tokens == b.duplicated_tokens
        # the Numba kernels and their plain-Python twins give byte-identical plans
        ref = plan_step(f, cfg, impl="ref")
        for p in (plan, ref):
            p.header.stats.plan_seconds = 0.0
        assert ref.SerializeToString(deterministic=True) == plan.SerializeToString(deterministic=True)
    assert chosen, "some forest gets a plan with windows across ranks"


def test_windows_stay_on_their_rank_in_free_plans_and_without_cross_rank_windows():
    f = _forest(1)
    for cfg in (_cfg(3, lockstep=False), _cfg(3, cross_rank_windows=False)):
        plan = plan_step(f, cfg)
        p, st = plan.header.params, plan.header.stats
        assert not p.cross_rank_windows and p.cost_model.transfer_byte == 0.0
        assert not any(rp.cross_edges for rp in plan.ranks) and st.cross_edges == 0
        assert not st.HasField("with_cross_edges") and not st.rank_transfer_costs


def test_cost_model_transfer_byte():
    cm = CostModel(row=2.0)
    assert cm.transfer_byte == pytest.approx(2.0 * DEFAULT_TRANSFER_ROWS_PER_BYTE)
    assert CostModel.from_json(CostModel(row=1.0, transfer_byte=3e-9, source="x").to_json()).transfer_byte == 3e-9
    assert CostModel.from_dict({"format": "harts.cost_model.v1", "coefficients": {"row": 4.0}}).transfer_byte == pytest.approx(
        4.0 * DEFAULT_TRANSFER_ROWS_PER_BYTE)
    with pytest.raises(ValueError, match="transfer_byte: expected a finite cost >= 0 per byte, got -1"):
        CostModel(transfer_byte=-1.0)


def _enclosed_partition(enclosed: bool):
    """Rank 0 keeps a 7-token prompt and a branch; rank 1 keeps another branch and duplicates the
    prompt. With `enclosed`, rank 1's window opens after rank 0's and closes before it."""
    prefix = list(range(1, 8))
    f = forest_from_trajectories([prefix + [101, 102, 103], prefix + [101, 102, 201], prefix + [301, 302]])
    ranges = np.array([[s, 0, f.seg_length[s]] for s in range(f.num_segments)], np.int64)
    r1 = [("F", -1), ("F", 1), ("B", 1), ("B", -1)] if enclosed else [("F", 1), ("F", -1), ("B", -1), ("B", 1)]
    part = Partition(microbatches=[MicrobatchSpec(ranges=ranges[:4], rank=0),
                                   MicrobatchSpec(ranges=ranges[4:], dup_ranges=ranges[:1], rank=1)],
                     rank_steps=[[("F", 0), ("F", -1), ("B", -1), ("B", 0)], r1], phases=np.array([0, 0, 1, 1], np.uint8))
    return f, part


def test_import_duplicates_keeps_the_schedule_and_imports_the_enclosed_prompt():
    f, part = _enclosed_partition(enclosed=True)
    cfg = PlanConfig(chunk_size=8, microbatch_tokens=64, world_size=2, lockstep=True, row_sizes=SIZES, memory_tokens=64)
    base = build_plan(f, cfg, part)
    validate_plan(base, f)
    conv = import_duplicates(f, part)
    assert conv is not None and conv.rank_steps == part.rank_steps and conv.phases is part.phases
    assert (conv.microbatches[1].parent, conv.microbatches[1].shared, conv.microbatches[1].dup_ranges.shape[0]) == (0, True, 0)
    plan = build_plan(f, cfg, conv)
    validate_plan(plan, f)
    b, x = base.header.stats, plan.header.stats
    assert (b.duplicated_tokens, x.duplicated_tokens, x.cross_edges) == (7, 0, 1)
    assert [(s.kind, s.microbatch, s.standin) for r in plan.ranks for s in r.steps] == [
        (s.kind, s.microbatch, s.standin) for r in base.ranks for s in r.steps]
    moved = plan.header.params.cost_model.transfer_byte * x.exchanged_bytes
    assert x.lockstep_makespan <= b.lockstep_makespan + moved  # no phase got longer but by its transfers
    f, part = _enclosed_partition(enclosed=False)  # rank 1 opens with rank 0: nothing to import from yet
    assert import_duplicates(f, part) is None


def test_equal_candidates_have_one_digest_and_any_decision_changes_it():
    """plan_step builds each distinct crossing candidate once (Partition.digest)."""
    forest, cfg = _forest(3), _cfg(2, cross_rank_windows=True)
    parts = [part for _, part, _ in crossing_partitions(forest, cfg)]
    part = parts[0]
    assert dataclasses.replace(part, microbatches=[dataclasses.replace(m) for m in part.microbatches]).digest() == part.digest()
    changed = [
        dataclasses.replace(part, microbatches=[dataclasses.replace(part.microbatches[0], recompute=not part.microbatches[0].recompute),
                                                *part.microbatches[1:]]),
        dataclasses.replace(part, microbatches=[dataclasses.replace(part.microbatches[0], rank=1 - part.microbatches[0].rank),
                                                *part.microbatches[1:]]),
        dataclasses.replace(part, rank_steps=[list(reversed(s)) for s in part.rank_steps]),
    ]
    assert len({p.digest() for p in changed} | {part.digest()}) == 4


def test_plan_step_builds_each_distinct_candidate_once(monkeypatch):
    forest, cfg = _forest(1), _cfg(2, cross_rank_windows=True)
    distinct = {part.digest() for _, part, _ in crossing_partitions(forest, cfg)}
    assert len(distinct) == 1  # this forest's six candidates coincide
    built = []
    real = step.build_plan
    monkeypatch.setattr(step, "build_plan", lambda *a, **kw: built.append(a[2].digest()) or real(*a, **kw))
    plan_step(forest, cfg)
    candidates = built[1:]  # built[0] is the plan without crossing windows
    assert len(candidates) == len(set(candidates)) and distinct <= set(candidates)
