"""Sharing windows in the executor (docs/design/windows.md): windowed tree plans vs trajectory-expanded plans.

Windowed plans come from the plan builder with hand-made partitions (nested windows, several
children of one parent, a child that is itself a parent, cut edges inside a chunk, one trajectory
across four microbatches, recomputation) and with random partitions; the reference is the
trajectory-expanded plan of the same batch. Targets (fp32, CPU): linear-attention outputs bitwise
equal, log-prob max abs diff <= 1e-6, relative gradient diff <= 1e-5, expert loads equal.
"""
from __future__ import annotations

import numpy as np
import pytest

from planner_service.planner import PlanConfig, plan_step
from planner_service.planner.build import build_plan
from planner_service.planner.spec import MicrobatchSpec, Partition
from plan.validator import validate_plan
from tests.builder_helpers import forest_from_trajectories, random_partition, random_trajectories
from trainer import executor as executor_mod
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.objectives import ObjectiveConfig
from trainer.verify import compare_runs, run_and_capture

C = 8
OBJECTIVE = ObjectiveConfig(kl_coef=0.05, entropy_coef=0.01, aggregation="seq-mean-token-mean")


@pytest.fixture(scope="module")
def models():
    return {"moe": build_model("tiny", seed=4), "dense": build_model("tiny-dense", seed=4)}


def _executor(model, **kw):
    return Executor(model, ExecutorConfig(chunk_size=C, want_logprobs=True, capture_linear=True, objective=OBJECTIVE,
                                          check_recompute=True, **kw))


def _check(model, forest, plan, *, windows_at_least=1, recomputed_at_least=0, **kw):
    """Run `plan` and the expanded plan of `forest`; assert Invariant E and return the tree result."""
    validate_plan(plan, forest)
    expanded = plan_step(forest, PlanConfig(chunk_size=C, microbatch_tokens=4096, sharing=False, windows=False,
                                            all_positions=True))
    ex = _executor(model, **kw)
    ref, g_ref = run_and_capture(ex, expanded)
    got, g_got = run_and_capture(ex, plan)
    assert got.windows >= windows_at_least, got.summary()
    assert got.recomputed_microbatches >= recomputed_at_least, got.summary()
    rep = compare_runs(ref, g_ref, got, g_got)
    assert rep["logprob_positions"] == int(forest.expanded_tokens) - forest.num_trajectories
    assert rep["logprob_max_abs_diff"] <= 1e-6, rep
    assert rep["linear_outputs_bitwise_equal"], rep
    assert rep["expert_load_equal"], rep
    assert rep["loss_diff"] <= 1e-6 * max(1.0, abs(ref.loss)), rep
    assert rep["grad_rel_diff_max"] <= 1e-5, {k: v for k, v in rep["grad_rel_diff"].items() if v > 1e-5}
    return got, rep


def _forest(trajs, **kw):
    """forest_from_trajectories with reference log-probs too (the objective uses a KL term)."""
    f = forest_from_trajectories(trajs, vocab_size=256, **kw)
    f.ref_logprobs = (f.old_logprobs - 0.25).astype(np.float32)
    return f


def _segs(f):
    return {(int(f.seg_depth[s]), int(f.tokens[f.seg_offset[s]])): s for s in range(f.num_segments)}


def _chain_forest():
    """One 64-token path with branches: at depth 11 (unaligned) and 19 (unaligned), 40 (aligned)."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 200, 64).tolist()
    trajs = [base, base[:11] + [201, 202, 203, 204, 205, 206, 207], base[:19] + [210, 211, 212],
             base[:40] + [220, 221, 222, 223, 224, 225, 226, 227, 228, 229], base[:40] + [230]]
    f = _forest(trajs)
    return f, _segs(f), base


def _chain_partition(f, segs, base, *, recompute=False):
    """The 64-token path across four microbatches in a chain of windows three deep:
    m0 = depths [0, 16) + the depth-11 branch; m1 = [16, 24) + the depth-19 branch (cut edge at 19:
    its piece starts inside chunk 2, so its replay rows 16..18 are m1's own rows); m2 = [24, 40);
    m3 = [40, 64) + both depth-40 branches (imports states and all 40 ancestor rows)."""
    s_root = segs[(0, base[0])]      # depths 0..10
    s_mid = segs[(11, base[11])]     # depths 11..18
    s_b11 = segs[(11, 201)]
    s_19 = segs[(19, base[19])]      # depths 19..39
    s_b19 = segs[(19, 210)]
    s_40 = segs[(40, base[40])]      # depths 40..63
    s_b40a, s_b40b = segs[(40, 220)], segs[(40, 230)]
    return Partition(microbatches=[
        MicrobatchSpec(ranges=np.array([[s_root, 0, 11], [s_mid, 0, 5], [s_b11, 0, 7]])),
        MicrobatchSpec(ranges=np.array([[s_mid, 5, 8], [s_19, 0, 5], [s_b19, 0, 3]]), parent=0, shared=True, recompute=recompute),
        MicrobatchSpec(ranges=np.array([[s_19, 5, 21]]), parent=1, shared=True, recompute=recompute),
        MicrobatchSpec(ranges=np.array([[s_40, 0, 24], [s_b40a, 0, 10], [s_b40b, 0, 1]]), parent=2, shared=True),
    ])


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_chain_of_windows_three_deep(models, kind):
    f, segs, base = _chain_forest()
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True), _chain_partition(f, segs, base))
    mbs = plan.ranks[0].microbatches
    assert [len(mb.import_row) // 4 for mb in mbs] == [0, 16, 24, 40]
    assert any(len(mb.state_imports) for mb in mbs[1:])
    got, _ = _check(models[kind], f, plan, windows_at_least=3)
    assert got.microbatches == 4


def test_chain_with_recomputation(models):
    f, segs, base = _chain_forest()
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True),
                      _chain_partition(f, segs, base, recompute=True))
    got, _ = _check(models["moe"], f, plan, windows_at_least=3, recomputed_at_least=2)
    assert got.recomputed_microbatches == 2


def test_cut_edge_inside_a_chunk_imports_replay_rows(models):
    """Children whose pieces start at unaligned depths below the parent's rows replay the parent's
    rows of that chunk: imported kernel inputs (and a child that is itself a parent)."""
    rng = np.random.default_rng(1)
    p = rng.integers(0, 200, 21).tolist()
    trajs = [p + rng.integers(0, 200, n).tolist() for n in (14, 9, 5)] + [p[:13] + [240, 241, 242]]
    f = _forest(trajs)
    segs = _segs(f)
    s_p = segs[(0, p[0])]
    s_p2 = segs[(13, p[13])]
    kids = [s for (d, _), s in segs.items() if d == 21]
    s_b13 = segs[(13, 240)]
    part = Partition(microbatches=[
        MicrobatchSpec(ranges=np.array([[s_p, 0, 13], [s_p2, 0, 8]])),
        MicrobatchSpec(ranges=np.array([[kids[0], 0, int(f.seg_length[kids[0]])], [s_b13, 0, 3]]), parent=0, shared=True),
        MicrobatchSpec(ranges=np.array([[k, 0, int(f.seg_length[k])] for k in kids[1:]]), parent=0, shared=True),
    ])
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True), part)
    kernel_imports = [seq for mb in plan.ranks[0].microbatches[1:] for call in mb.linear_calls for seq in call.sequences
                      if len(seq.replay_rows)]
    assert kernel_imports, "expected replay rows imported from the parent"
    _check(models["moe"], f, plan, windows_at_least=2)


@pytest.mark.parametrize("seed", range(6))
def test_random_windowed_partitions(models, seed):
    rng = np.random.default_rng(100 + seed)
    trajs, tree_of = random_trajectories(rng, n=10, max_len=40, vocab=200, trees=2, chunk=C)
    f = _forest(trajs, tree_of=tree_of, seed=seed)
    world = 1 + seed % 2
    part = random_partition(f, rng, chunk=C, world_size=world, windows=True, cut_prob=0.4)
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=4096, memory_tokens=1 << 20, world_size=world,
                                    all_positions=True), part)
    if not any(mb.import_row or mb.state_imports for r in plan.ranks for mb in r.microbatches):
        pytest.skip("this random partition opened no window")
    _check(models["moe" if seed % 3 else "dense"], f, plan)


def test_planner_windows_with_small_memory_recompute(models):
    """plan_step with windows and a small M: the planner marks recomputation; results stay exact."""
    rng = np.random.default_rng(7)
    p = rng.integers(0, 200, 90).tolist()
    trajs = [p + rng.integers(0, 200, n).tolist() for n in (30, 25, 20)]
    f = _forest(trajs)
    plan = plan_step(f, PlanConfig(chunk_size=C, microbatch_tokens=40, memory_tokens=150, all_positions=True))
    assert plan.header.stats.windows > 0
    _check(models["moe"], f, plan)


def test_removing_gradient_handback_breaks_exactness(models, monkeypatch):
    """The exactness checks above fail when importers' gradients are not handed to their exporters."""
    f, segs, base = _chain_forest()
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True), _chain_partition(f, segs, base))
    monkeypatch.setattr(executor_mod.StepRun, "_hand_back", lambda self, st: None)
    with pytest.raises(AssertionError, match=r"assert .* <= 1e-05"):
        _check(models["moe"], f, plan)


def test_forward_only_windowed_logprobs(models):
    f, segs, base = _chain_forest()
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True), _chain_partition(f, segs, base))
    expanded = plan_step(f, PlanConfig(chunk_size=C, microbatch_tokens=4096, sharing=False, windows=False, all_positions=True))
    ex = _executor(models["moe"])
    a, b = ex.run_step(plan, backward=False), ex.run_step(expanded, backward=False)
    for tid, lp in b.logprobs.items():
        np.testing.assert_allclose(a.logprobs[tid], lp, rtol=0, atol=1e-6)


def test_every_microbatch_layout_moves_to_another_device(models, monkeypatch):
    """What `RowLayout.to` does for a GPU run, checked on the CPU with "meta" as the other device: every
    index tensor of every layout of a windowed plan (tree attention's, the window boundary's, the
    log-prob map's) moves, and `to_device` is handed tensors only (the first GPU run failed there)."""
    import copy
    from dataclasses import fields, is_dataclass

    import torch

    from kernels import devices, row_adds
    from kernels.tree_attention import layout as tree_layout
    from trainer import layout as row_layout
    from trainer import step_walk

    def tensors_only(t, device):
        assert isinstance(t, torch.Tensor), type(t)
        return devices.to_device(t, device)

    for module in (row_layout, tree_layout, row_adds):
        monkeypatch.setattr(module, "to_device", tensors_only)

    def left_behind(obj, path="layout", seen=None):
        """Paths of the tensors under obj not on "meta" (host-side numpy arrays are meant to stay)."""
        seen = set() if seen is None else seen
        if id(obj) in seen:
            return []
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            return [] if obj.device.type == "meta" else [path]
        if isinstance(obj, dict):
            return [p for k, v in obj.items() for p in left_behind(v, f"{path}[{k!r}]", seen)]
        if isinstance(obj, (list, tuple)):
            return [p for i, v in enumerate(obj) for p in left_behind(v, f"{path}[{i}]", seen)]
        if is_dataclass(obj):
            return [p for f in fields(obj) for p in left_behind(getattr(obj, f.name), f"{path}.{f.name}", seen)]
        return []

    moved = []
    build = step_walk.layout_from_arrays

    def build_and_move(*args, **kwargs):
        layout = build(*args, **kwargs)
        copy_ = copy.deepcopy(layout).to("meta")
        # by design on the host: the linear calls' offsets and exports (the kernel plans its chunks
        # from them) and tree attention's validated segment index (TreeIndex)
        stays = (".cu_seqlens", ".export_seq", ".export_pos", "layout.attention.index.")
        moved.append([p for p in left_behind(copy_) if not any(s in p for s in stays)])
        return layout

    monkeypatch.setattr(step_walk, "layout_from_arrays", build_and_move)
    f, segs, base = _chain_forest()
    plan = build_plan(f, PlanConfig(chunk_size=C, microbatch_tokens=64, all_positions=True), _chain_partition(f, segs, base))
    run_and_capture(_executor(models["moe"]), plan)
    assert len(moved) == 4 and moved == [[]] * 4, moved
