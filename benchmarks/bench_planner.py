"""Planner benchmark: partitioner and whole-`plan_step` speed against the plain-Python reference
(`impl="ref"`: same input, same plan), plan quality and the plan validator's time.

Run: `.venv/bin/python -m benchmarks.bench_planner [--quick]`, or `--ingest-only [--batch FILE]` for
ingest, planning and validation at step scale (progress on stderr, one JSON object on stdout).

The synthesised forests, `partition_overhead`, the step-scale figures and `BEFORE`:
benchmarks/README.md ("Planner speed and plan quality", "Ingest and validation at step scale").
Legend: S segments, T trajectories, N_u distinct tokens, N_e expanded tokens.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile

import numpy as np

from harts_client.synthetic import WorkloadConfig, generate_workload
from harts_client.timing import repeat, timed
from planner_service import ingest
from planner_service.forest import Forest
from planner_service.planner import plan_step
from planner_service.planner import warmup as planner_warmup
from planner_service.planner.config import PlanConfig
from planner_service.planner.expand import expand_forest
from planner_service.planner.partition import partition_with_report
from plan import slice_kernels
from plan.seal import slice_plan
from plan.slice_check import check_slice
from plan.validator import validate_plan

log = logging.getLogger("bench_planner")


def synth_forest(
    *, n_trees: int, segments_per_tree: int, seed: int = 0, vocab: int = 50_000, segment_median: float = 12.0,
    prompt_median: float = 450.0, chain: float = 0.55,
) -> Forest:
    """Random branching forest in DFS preorder (benchmarks/README.md, "Planner speed and plan quality"); segment and prompt lengths
    are log-normal around the given medians."""
    rng = np.random.default_rng(seed)
    parents: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    trees: list[np.ndarray] = []
    base = 0
    for tree in range(n_trees):
        n = max(2, int(rng.poisson(segments_per_tree)))
        is_chain = rng.random(n) < chain
        anyp = (rng.random(n) * np.arange(n)).astype(np.int64)
        par = np.where(is_chain, np.arange(n) - 1, anyp)
        par[0] = -1
        kids: list[list[int]] = [[] for _ in range(n)]
        for u in range(1, n):
            kids[par[u]].append(u)
        order, stack = [], [0]
        while stack:  # preorder, children in index order
            u = stack.pop()
            order.append(u)
            stack.extend(reversed(kids[u]))
        new_id = np.empty(n, np.int64)
        new_id[order] = np.arange(n)
        p = np.where(par[order] >= 0, new_id[np.maximum(par[order], 0)], -1)
        ln = np.clip(rng.lognormal(np.log(segment_median), 0.9, size=n), 1, 40 * segment_median).astype(np.int64)
        ln[0] = int(np.clip(rng.lognormal(np.log(prompt_median), 0.5), prompt_median / 4, 4 * prompt_median))
        parents.append(np.where(p >= 0, p + base, -1))
        lengths.append(ln)
        trees.append(np.full(n, tree, np.int32))
        base += n
    seg_parent = np.concatenate(parents).astype(np.int32)
    seg_length = np.concatenate(lengths).astype(np.int32)
    S = seg_parent.shape[0]
    seg_depth = np.zeros(S, np.int64)
    for s in np.flatnonzero(seg_parent >= 0).tolist():  # parents precede children
        p = seg_parent[s]
        seg_depth[s] = seg_depth[p] + seg_length[p]
    has_kid = np.zeros(S, np.bool_)
    has_kid[seg_parent[seg_parent >= 0]] = True
    traj_seg = np.flatnonzero(~has_kid).astype(np.int32)
    traj_len = seg_depth[traj_seg] + seg_length[traj_seg]
    traj_offset = np.r_[0, np.cumsum(traj_len)].astype(np.int64)
    n_u = int(seg_length.sum())
    n_e = int(traj_offset[-1])
    T = traj_seg.shape[0]
    return Forest(
        batch_id=f"bench-{seed}",
        vocab_size=vocab,
        tokens=rng.integers(0, vocab, size=n_u, dtype=np.int32),
        seg_parent=seg_parent,
        seg_offset=(np.cumsum(seg_length, dtype=np.int64) - seg_length),
        seg_length=seg_length,
        seg_depth=seg_depth.astype(np.int32),
        seg_tree=np.concatenate(trees),
        tree_ids=[f"task-{i}" for i in range(n_trees)],
        traj_ids=[f"r{t}" for t in range(T)],
        traj_seg=traj_seg,
        traj_offset=traj_offset,
        loss_mask=(rng.random(n_e) < 0.5).astype(np.uint8),
        advantages=rng.standard_normal(n_e).astype(np.float32),
        old_logprobs=None,
        reward=np.zeros(T, np.float32),
        weight=np.ones(T, np.float32),
        group_ids=[""] * T,
    )


def intrinsic_replay(forest: Forest, chunk: int) -> int:
    """Replay rows of the forest planned whole (every tree in one microbatch): each extra child of
    a branch at depth e re-runs e % C rows. Any plan computes at least this under bounded replay."""
    kids = np.bincount(forest.seg_parent[forest.seg_parent >= 0], minlength=forest.num_segments)
    end = forest.seg_depth.astype(np.int64) + forest.seg_length
    return int((np.maximum(kids - 1, 0) * (end % chunk)).sum())


def _time(fn, runs: int = 3) -> tuple[float, object]:
    """(fastest wall seconds of `runs` calls, the last result)."""
    r = repeat(fn, runs)
    return r.fastest().wall, r.result


def _subforest(forest: Forest, n_trees: int) -> Forest:
    """The first `n_trees` trees of a synthetic forest (their segments are a prefix)."""
    S = int(np.searchsorted(forest.seg_tree, n_trees))
    T = int(np.searchsorted(forest.traj_seg, S))
    n_u = int(forest.seg_offset[S - 1] + forest.seg_length[S - 1])
    n_e = int(forest.traj_offset[T])
    return Forest(
        batch_id=forest.batch_id, vocab_size=forest.vocab_size, tokens=forest.tokens[:n_u],
        seg_parent=forest.seg_parent[:S], seg_offset=forest.seg_offset[:S], seg_length=forest.seg_length[:S],
        seg_depth=forest.seg_depth[:S], seg_tree=forest.seg_tree[:S], tree_ids=forest.tree_ids[:n_trees],
        traj_ids=forest.traj_ids[:T], traj_seg=forest.traj_seg[:T], traj_offset=forest.traj_offset[: T + 1],
        loss_mask=forest.loss_mask[:n_e], advantages=forest.advantages[:n_e], old_logprobs=None,
        reward=forest.reward[:T], weight=forest.weight[:T], group_ids=forest.group_ids[:T],
    )


def _quality(forest: Forest, cfg: PlanConfig, report) -> dict:
    computed = int(report.rows.sum())
    ideal = forest.expanded_tokens / forest.unique_tokens
    achieved = forest.expanded_tokens / computed
    floor = forest.unique_tokens + (intrinsic_replay(forest, cfg.chunk_size) if cfg.replay else 0)
    return {
        "microbatches": int(report.rows.shape[0]),
        "microbatches_per_rank": report.rows.shape[0] / cfg.world_size,
        "computed_tokens": computed,
        "compression_ideal": round(ideal, 4),
        "compression_achieved": round(achieved, 4),
        "achieved_over_ideal": round(achieved / ideal, 4),
        "intrinsic_replay_tokens": floor - forest.unique_tokens,
        "partition_overhead": round(computed / floor - 1, 5),
        "imbalance": round(report.imbalance, 4),
        "peak_live_tokens": report.peak_live,
    }


def run(quick: bool = False) -> dict:
    """Synthesise the forest, time the partitioner (Numba vs reference) and plan_step, report quality."""
    n_trees = 60 if quick else 650
    forest, seconds = timed(synth_forest, n_trees=n_trees, segments_per_tree=80, seed=0)
    largest = int(np.bincount(forest.seg_tree, weights=forest.seg_length).max())
    log.info(
        "forest: %d trees, %d segments, %d trajectories, %d distinct / %d expanded tokens, largest tree %d (%.1fs)",
        n_trees, forest.num_segments, forest.num_trajectories, forest.unique_tokens, forest.expanded_tokens,
        largest, seconds,
    )
    out: dict = {"forest": forest.stats() | {"largest_tree": largest}, "configs": {}}
    W = 8
    # B >= 4x the largest tree, sized for >= 8 microbatches per rank
    b_pack = max(4 * largest, 64 * ((forest.unique_tokens // (8 * W)) // 64))
    configs = {
        "pack": PlanConfig(world_size=W, microbatch_tokens=b_pack, chunk_size=64),
        "pack_noreplay": PlanConfig(world_size=W, microbatch_tokens=b_pack, chunk_size=64, replay=False),
        "windows": PlanConfig(world_size=W, microbatch_tokens=2048, chunk_size=64),
        "no_windows": PlanConfig(world_size=W, microbatch_tokens=4096, chunk_size=64, windows=False),
    }
    _time_partitions(forest, configs, n_trees, out)
    expanded, t_expand = timed(expand_forest, forest)
    base_cfg = PlanConfig(world_size=W, microbatch_tokens=b_pack, chunk_size=64, sharing=False)
    secs, (part, report) = _time(lambda: partition_with_report(expanded, base_cfg), runs=1)
    out["expanded_baseline"] = {
        "expand_seconds": round(t_expand, 3), "partition_seconds": round(secs, 3),
        "microbatches": len(part.microbatches), "imbalance": round(report.imbalance, 4),
    }
    log.info("expanded baseline: %s", out["expanded_baseline"])
    out["turns_forest"] = _turns_forest(n_trees, W)
    log.info("long-turn forest: %s", out["turns_forest"])
    _time_plan_steps(forest, configs, out)
    out["slice_check_scaling"] = slice_check_scaling(quick)
    return out


def _time_partitions(forest: Forest, configs: dict[str, PlanConfig], n_trees: int, out: dict) -> None:
    """The partitioner per config (out["configs"]) and against its reference (out["reference"])."""
    partition_with_report(_subforest(forest, 3), configs["pack"])  # compile / load the Numba cache
    for name, cfg in configs.items():
        secs, (part, report) = _time(lambda: partition_with_report(forest, cfg))
        row = {"B": cfg.microbatch_tokens, "partition_seconds": round(secs, 4)} | _quality(forest, cfg, report)
        out["configs"][name] = row
        log.info("%s: %s", name, row)
    cfg = configs["windows"]
    ref_trees = n_trees  # the partitioner alone against its reference, on the whole forest
    sub = _subforest(forest, ref_trees)
    t_numba, _ = _time(lambda: partition_with_report(sub, cfg))
    t_ref, _ = _time(lambda: partition_with_report(sub, cfg, impl="ref"), runs=1)
    out["reference"] = {
        "trees": ref_trees, "unique_tokens": sub.unique_tokens, "segments": sub.num_segments,
        "numba_seconds": round(t_numba, 4), "ref_seconds": round(t_ref, 3), "speedup": round(t_ref / t_numba, 1),
    }
    log.info("reference on %d trees: %s", ref_trees, out["reference"])


def _turns_forest(n_trees: int, W: int) -> dict:
    """Long turns (agentic trees branching at turn boundaries): few, long segments, so bounded
    replay (< C rows per extra branch) is a small fraction of the distinct tokens."""
    turns = synth_forest(n_trees=max(8, n_trees // 2), segments_per_tree=6, seed=1, segment_median=1000.0,
                         prompt_median=2000.0, chain=0.0)
    t_largest = int(np.bincount(turns.seg_tree, weights=turns.seg_length).max())
    b_turns = max(4 * t_largest, 64 * ((turns.unique_tokens // (8 * W)) // 64))
    cfg = PlanConfig(world_size=W, microbatch_tokens=b_turns, chunk_size=64)
    secs, (part, report) = _time(lambda: partition_with_report(turns, cfg))
    return (turns.stats() | {"largest_tree": t_largest, "B": b_turns, "partition_seconds": round(secs, 4)}
            | _quality(turns, cfg, report))


def _time_plan_steps(forest: Forest, configs: dict[str, PlanConfig], out: dict) -> None:
    """plan_step per config, against its plain-Python reference (the partitioner's and the
    builder's twins, the reference timed once), the validator, and the same step lock-step."""
    for name in ("pack", "windows"):
        cfg = configs[name]
        plan_step(_subforest(forest, 3), cfg)
        secs, plan = _time(lambda: plan_step(forest, cfg), runs=2)
        st = plan.header.stats
        out["configs"][name]["plan_step_seconds"] = round(secs, 3)
        out["configs"][name]["plan_stats"] = {
            "computed_tokens": st.computed_tokens, "replay_tokens": st.replay_tokens,
            "duplicated_tokens": st.duplicated_tokens, "compression_achieved": round(st.compression_achieved, 4),
            "imbalance": round(st.imbalance, 4), "linear_attention_calls": st.linear_attention_calls,
        }
        log.info("plan_step %s: %.3fs %s", name, secs, out["configs"][name]["plan_stats"])
    cfg = configs["windows"]
    t_numba, plan = _time(lambda: plan_step(forest, cfg), runs=3)
    t_ref, plan_ref = _time(lambda: plan_step(forest, cfg, impl="ref"), runs=1)
    plan.header.stats.plan_seconds = plan_ref.header.stats.plan_seconds = 0.0
    same = plan.SerializeToString(deterministic=True) == plan_ref.SerializeToString(deterministic=True)
    _, t_validate = timed(validate_plan, plan, forest)
    out["plan_step_reference"] = {
        "config": "windows", "unique_tokens": forest.unique_tokens, "expanded_tokens": forest.expanded_tokens,
        "segments": forest.num_segments, "numba_seconds": round(t_numba, 3), "ref_seconds": round(t_ref, 3),
        "speedup": round(t_ref / t_numba, 1), "identical_plans": same, "validate_seconds": round(t_validate, 3),
    }
    log.info("plan_step reference: %s", out["plan_step_reference"])
    # the same step as a lock-step plan (docs/design/lockstep.md): its extra planning time and its phases
    lock_cfg = PlanConfig(world_size=cfg.world_size, microbatch_tokens=cfg.microbatch_tokens, chunk_size=64, lockstep=True)
    t_lock, lock = _time(lambda: plan_step(forest, lock_cfg), runs=2)
    st = lock.header.stats
    out["lockstep"] = {
        "config": "windows", "plan_step_seconds": round(t_lock, 3), "over_free": round(t_lock / t_numba, 2),
        "lockstep_phases": st.lockstep_phases, "lockstep_ratio": round(st.lockstep_ratio, 4),
        "microbatches": st.microbatches,
    }
    log.info("plan_step lock-step: %s", out["lockstep"])


def slice_check_scaling(quick: bool = False, factor: int = 8) -> dict:
    """The fast slice check's time against the size of the slice: one-rank plans (C = 16, B = 1,024)
    of n and `factor` x n trajectories under one 300-token prompt; CPU seconds of the fastest of 3
    checks per plan, per computed row. `per_row_ratio` = (large s/row) / (small s/row): about 1 is
    linear, `factor` would be quadratic (this was the wall-clock test "8x the slice in well under
    16x the time", which failed under load)."""
    def slice_of(n: int):
        rng = np.random.default_rng(5)
        prompt = rng.integers(0, 50, 300).tolist()
        trajs = [{"id": f"t{i}", "tree_id": "task", "tokens": prompt + rng.integers(0, 50, int(rng.integers(50, 400))).tolist()}
                 for i in range(n)]
        forest = ingest.forest_from_json(json.dumps({"batch_id": f"scaling-{n}", "vocab_size": 50, "trajectories": trajs}))
        return slice_plan(plan_step(forest, PlanConfig(chunk_size=16, microbatch_tokens=1024)), 0)

    slice_kernels.warmup()
    out = {}
    for name, n in (("small", 10 if quick else 20), ("large", (10 if quick else 20) * factor)):
        sl = slice_of(n)
        rows = sum(m.num_rows + m.replay_tokens for m in sl.rank.microbatches)
        cpu = repeat(lambda: check_slice(sl), 3, warmup=1).fastest("cpu").cpu
        out[name] = {"trajectories": n, "rows": rows, "cpu_seconds": round(cpu, 6), "us_per_row": round(1e6 * cpu / rows, 4)}
    out["per_row_ratio"] = round(out["large"]["us_per_row"] / out["small"]["us_per_row"], 3)
    log.info("slice check scaling: %s", out)
    return out


#: The measurements before the current JSON ingest and plan validation (16-task percall batch of
#: `harts gen`, seed 1): the README's "before" column.
BEFORE = {
    "json_mb_per_s": "17-24", "proto_mb_per_s": "374-440", "json_peak_rss": "1.8 GB for a 200 MB body",
    "validate_plan_seconds": "2-36 (up to 10x planning)",
    "percall16_default_limits": "refused: 50.03M expanded tokens > max_tokens 50M",
}

# peak RSS from /proc (VmHWM is per process image; getrusage's ru_maxrss survives fork + exec)
_PEAK_CHILD = """
import sys, time
from planner_service.ingest import forest_from_json, warmup

def hwm():
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmHWM:"))

warmup()
base = hwm()
t0, c0 = time.perf_counter(), time.process_time()
with open(sys.argv[1], "rb") as fh:
    body = fh.read()
forest = forest_from_json(body)
print(len(body), base, hwm(), time.perf_counter() - t0, time.process_time() - c0, forest.expanded_tokens)
"""


def _cpu_and_wall(fn, runs: int = 1) -> tuple[float, float, object]:
    """(CPU s, wall s, result) of the fastest of `runs` calls by CPU seconds (the machine is shared)."""
    r = repeat(fn, runs)
    best = r.fastest("cpu")
    return best.cpu, best.wall, r.result


def ingest_and_validation(batch: str | None = None, quick: bool = False) -> dict:
    """JSON / protobuf ingest MB/s, peak memory of a JSON ingest, plan vs validate_plan vs check_slice."""
    ingest.warmup()
    planner_warmup()
    slice_kernels.warmup()
    tmp = None
    if batch is None:
        cfg = WorkloadConfig(scheme="percall", tasks=1 if quick else 2, seed=1, scale=0.05 if quick else 0.25)
        fd, tmp = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as fh:
            generate_workload(cfg).write_json(fh, progress=False)
        batch = tmp
    try:
        with open(batch, "rb") as fh:
            body = fh.read()
        mb = len(body) / 1e6
        cpu, wall, forest = _cpu_and_wall(lambda: ingest.forest_from_json(body))
        out: dict = {"batch": batch if tmp is None else "generated", "json_mb": round(mb, 1)} | forest.stats()
        out["json"] = {"cpu_seconds": round(cpu, 3), "wall_seconds": round(wall, 3),
                       "mb_per_cpu_s": round(mb / cpu, 1), "mb_per_wall_s": round(mb / wall, 1)}
        log.info("JSON ingest: %.1f MB, %s", mb, out["json"])
        pb = ingest.json_to_proto(body).SerializeToString()
        del body
        cpu, wall, _ = _cpu_and_wall(lambda: ingest.forest_from_proto(pb))
        pmb = len(pb) / 1e6
        out["proto"] = {"mb": round(pmb, 1), "cpu_seconds": round(cpu, 3), "wall_seconds": round(wall, 3),
                        "mb_per_cpu_s": round(pmb / cpu, 1), "mb_per_wall_s": round(pmb / wall, 1)}
        log.info("protobuf ingest: %s", out["proto"])
        del pb
        child = subprocess.run([sys.executable, "-c", _PEAK_CHILD, batch], capture_output=True, text=True, check=True,
                               env=os.environ | {"OMP_NUM_THREADS": "1"})
        size, base, peak, cwall, ccpu, _ = child.stdout.split()
        size, base, peak = int(size), int(base), int(peak)
        out["json_peak_memory"] = {
            "body_bytes": size, "baseline_rss_bytes": base, "peak_rss_bytes": peak,
            "peak_over_baseline_bytes": peak - base, "peak_over_baseline_per_body_byte": round((peak - base) / size, 2),
            "child_wall_seconds": round(float(cwall), 3), "child_cpu_seconds": round(float(ccpu), 3),
        }
        log.info("JSON ingest peak memory: %s", out["json_peak_memory"])
        pcfg = PlanConfig(world_size=8, microbatch_tokens=65536, chunk_size=64)
        cpu, wall, plan = _cpu_and_wall(lambda: plan_step(forest, pcfg), runs=3)
        out["plan"] = {"config": "W=8 B=65536 C=64 windows", "cpu_seconds": round(cpu, 3), "wall_seconds": round(wall, 3),
                       "microbatches": plan.header.stats.microbatches, "windows": plan.header.stats.windows}
        cpu, wall, _ = _cpu_and_wall(lambda: validate_plan(plan, forest))
        out["validate_plan"] = {"cpu_seconds": round(cpu, 3), "wall_seconds": round(wall, 3),
                                "over_planning_cpu": round(cpu / out["plan"]["cpu_seconds"], 3)}
        slices = [slice_plan(plan, r) for r in range(pcfg.world_size)]
        per_rank = [_cpu_and_wall(lambda sl=sl: check_slice(sl), runs=3)[:2] for sl in slices]
        rows = [sum(m.num_rows + m.replay_tokens for m in sl.rank.microbatches) for sl in slices]
        total_rows = max(sum(rows), 1)
        share = [out["plan"]["cpu_seconds"] * r / total_rows for r in rows]  # planning cost of each slice
        out["check_slice"] = {
            "cpu_seconds_all_ranks": round(sum(c for c, _ in per_rank), 4),
            "wall_seconds_all_ranks": round(sum(w for _, w in per_rank), 4),
            "cpu_seconds_max_rank": round(max(c for c, _ in per_rank), 4),
            "over_planning_cpu": round(sum(c for c, _ in per_rank) / out["plan"]["cpu_seconds"], 4),
            "max_over_slice_planning_share": round(max((c / s for (c, _), s, r in zip(per_rank, share, rows) if r), default=0.0), 4),
        }
        log.info("plan %s; validate_plan %s; check_slice %s", out["plan"], out["validate_plan"], out["check_slice"])
        out["before"] = BEFORE
        return out
    finally:
        if tmp is not None:
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small forest (CI smoke run)")
    parser.add_argument("--batch", help="JSON rollout batch for the ingest and validation figures "
                        "(e.g. harts gen --scheme percall --tasks 16 --seed 1 -o /tmp/percall16.json)")
    parser.add_argument("--ingest-only", action="store_true", help="only the ingest and validation figures")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    out = {} if args.ingest_only else run(quick=args.quick)
    out["ingest_and_validation"] = ingest_and_validation(args.batch, quick=args.quick)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
