"""The benchmark suite: `make bench` / `harts bench [--quick] [--full] [--only NAME ...]`.

Runs the per-workload headline benchmark (this module) and every component benchmark module
`benchmarks/bench_<name>.py` (contract: `run(quick: bool = False) -> dict` and `main()`); a module
that is not there yet is skipped and the results say so. Writes into `benchmarks/results/`
(or `--out DIR`):

- `summary.md`: the headline table, each benchmark's status and seconds, the command, the machine;
- `README-table.md`: the headline table for the top-level README (the lead pastes it);
- `<name>.md` per benchmark, `results.json` (everything), `compression.png`, `planner.png`.

Headline, per synthetic agentic workload (`harts_client/synthetic.py`, fixed seeds): token
compression (expanded / unique tokens), computed / unique tokens of the plan, planner time (Numba
vs the plain-Python reference), sequential linear-attention calls (tree vs expanded plan), and the
update throughput (forward + backward + optimizer step, expanded tokens/s) of tree vs expanded
execution on a small hybrid model, as a ratio and as a fraction of the ideal: the plan's FLOP
compression (`trainer.flops`: FLOPs of the expanded plan / FLOPs of the tree plan, which counts
replay rows and weighs attention by depth).

Modes: default CPU scale (a few minutes on 2 cores); `--quick` (tiny inputs, for tests);
`--full`: planning only, at full scale (tens of millions of expanded tokens per workload), plus
the placement table (issue 12: makespan ratio and compression over W in {8, 32, 64} and
B in {16k, 32k, 64k} for the three schemes, `run_placement`; issue 20: each cell's lockstep_ratio;
issue 24: the lock-step plan with and without windows across ranks, the bytes they exchange per
step and the duplicated activations they save).
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harts_client.synthetic import WorkloadConfig, generate_workload
from harts_client.timing import Stopwatch, timed

log = logging.getLogger("benchmarks.suite")  # also when run as __main__ (harts bench)

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: component benchmarks: name -> (module, what it measures)
MODULES: dict[str, tuple[str, str]] = {
    "forest": ("benchmarks.bench_forest", "ingest: JSON/protobuf -> prefix forest, Numba vs reference"),
    "planner": ("benchmarks.bench_planner", "planner: ~1M distinct tokens, Numba vs reference, plan quality"),
    "trainer": ("benchmarks.bench_trainer", "trainer: sharing windows vs no windows vs expanded vs transformers (throughput, memory)"),
    "service": ("benchmarks.bench_service", "service: concurrent submissions and plan polling on loopback"),
    "kernels": ("benchmarks.bench_kernels", "kernels: chunked gated delta rule"),
    "rl": ("benchmarks.bench_rl", "rl: one harts rl run trained on trees and, on the same rollouts, expanded (curves, wall clock)"),
}
#: every benchmark name `--only` accepts, in run order
NAMES = ("workloads", *MODULES)

#: published update-throughput speedups, for context in the table and the plot
PUBLISHED = (
    ("HARTS (arXiv 2608.28158), SWE-bench trees", 4.77, 10.45),
    ("Tree Training (arXiv 2511.00413)", 6.2, 6.2),
    ("AReaL-DTA (arXiv 2602.00482), tau2-bench", 8.31, 8.31),
)


@dataclass(slots=True, kw_only=True)
class WorkloadSpec:
    """One row of the headline table."""

    name: str
    """Row label."""
    gen: dict
    """WorkloadConfig keyword arguments."""
    microbatch_tokens: int = 2048
    """Planner token budget B (below the CPU-scale trees' sizes: steps run sharing windows)."""
    chunk_size: int = 16
    """Linear-attention chunk size C. CPU scale shrinks every length ~50x, so C = 16 (not the
    kernel default 64) keeps the replay overhead of branches inside a chunk near full scale's."""
    world_size: int = 1
    """Planner ranks (1 at CPU scale: the trainer runs the whole plan in-process)."""
    windows: bool = True
    """Sharing windows (off: the ablation that duplicates prefixes)."""


@dataclass(slots=True, kw_only=True)
class SuiteConfig:
    """What `run_suite` runs and where it writes."""

    out_dir: Path = RESULTS_DIR
    """Directory of the result files (created)."""
    quick: bool = False
    """Tiny inputs everywhere (tests); module benchmarks get run(quick=True)."""
    full: bool = False
    """Planning only at full scale (the headline benchmark only, no trainer, no modules)."""
    only: tuple[str, ...] = ()
    """Benchmark names to run (default: all of NAMES; `--full` implies "workloads")."""
    trainer: bool = True
    """Time tree vs expanded update throughput (CPU and quick modes)."""
    model: str = "small"
    """Named model config the throughput is measured on (trainer.models.NAMED_CONFIGS; quick: tiny)."""
    trainer_warmup: bool = True
    """One untimed step per execution mode before the timed ones."""
    trainer_steps: int | None = None
    """Timed optimizer steps per execution mode after one warm-up step each (None: 5, quick: 1)."""
    trainer_threads: int = 1
    """torch intra-op threads while the trainer is timed (restored afterwards; 0: torch's default).
    The timing counts process CPU seconds; with several threads those include OpenMP workers
    spinning between small operators, which weighs on the tree run (more, smaller operators) and
    is not work; see benchmarks/README.md for what 2 threads measure."""
    reference_planner: bool = True
    """Also time the plain-Python reference planner (skipped above `reference_max_tokens`)."""
    reference_max_tokens: int = 50_000_000
    """Largest distinct-token count the reference planner is timed on (about 10 s per 17M here)."""
    peer_max_tokens: int = 20_000
    """Expanded tokens of the (seeded random) trajectory subset transformers is timed on."""

    def __post_init__(self) -> None:
        bad = [n for n in self.only if n not in NAMES]
        if bad:
            raise ValueError(f"only: expected names from {', '.join(NAMES)}, got {', '.join(bad)}")
        if self.quick and self.full:
            raise ValueError("full: expected either quick or full, got both")
        if self.trainer_steps is not None and self.trainer_steps < 1:
            raise ValueError(f"trainer_steps: expected >= 1, got {self.trainer_steps}")
        if self.trainer_threads < 0:
            raise ValueError(f"trainer_threads: expected >= 0 (0: torch's default), got {self.trainer_threads}")
        self.out_dir = Path(self.out_dir)

    def names(self) -> list[str]:
        if self.full:
            return ["workloads"]
        return [n for n in NAMES if not self.only or n in self.only]


def workload_specs(*, quick: bool = False, full: bool = False) -> list[WorkloadSpec]:
    """The headline workloads. CPU scale (lengths x0.02, fewer turns) sizes each step at a few
    thousand expanded tokens so that the expanded baseline trains in seconds on 2 cores; full scale keeps the published lengths (tens of millions of expanded tokens per
    workload) and plans with sharing windows for 8 ranks and C = 64."""
    if full:
        return [
            WorkloadSpec(name=name, gen=gen, microbatch_tokens=65536, chunk_size=64, world_size=8, windows=True)
            for name, gen in (
                ("group (G=8)", dict(scheme="group", tasks=48, seed=0)),
                ("tree (k=2, 3 levels)", dict(scheme="tree", tasks=40, seed=0)),
                ("tree (k=3, 2 levels)", dict(scheme="tree", tasks=24, seed=0, branching=3, levels=2)),
                ("percall (G=4)", dict(scheme="percall", tasks=4, seed=0)),
            )
        ]
    if quick:
        return [
            WorkloadSpec(name="group (G=4)", gen=dict(scheme="group", tasks=1, seed=0, scale=0.01, group_size=4, turns=(10, 12)), microbatch_tokens=256),
            WorkloadSpec(name="tree (k=2, 2 levels)", gen=dict(scheme="tree", tasks=1, seed=0, scale=0.01, levels=2, turns=(10, 12)), microbatch_tokens=256),
            WorkloadSpec(name="percall (G=1)", gen=dict(scheme="percall", tasks=1, seed=0, scale=0.01, group_size=1, turns=(10, 12)), microbatch_tokens=256),
        ]
    return [
        WorkloadSpec(name="group (G=4)", gen=dict(scheme="group", tasks=2, seed=0, scale=0.02, group_size=4, turns=(10, 30))),
        WorkloadSpec(name="tree (k=2, 3 levels)", gen=dict(scheme="tree", tasks=2, seed=0, scale=0.02, turns=(10, 25))),
        WorkloadSpec(name="tree (k=3, 2 levels)", gen=dict(scheme="tree", tasks=2, seed=0, scale=0.02, branching=3, levels=2, turns=(10, 25))),
        WorkloadSpec(name="percall (G=2)", gen=dict(scheme="percall", tasks=1, seed=0, scale=0.02, group_size=2, turns=(10, 14))),
    ]


def _optional(module: str, attr: str):
    """`module.attr`, or None when the module (or the attribute) has not landed yet."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None
        raise
    return getattr(mod, attr, None)


def _plan_stats(plan) -> dict:
    s = plan.header.stats
    return {
        "unique_tokens": int(s.unique_tokens),
        "expanded_tokens": int(s.expanded_tokens),
        "computed_tokens": int(s.computed_tokens),
        "replay_tokens": int(s.replay_tokens),
        "duplicated_tokens": int(s.duplicated_tokens),
        "compression_achieved": float(s.compression_achieved),
        "microbatches": int(s.microbatches),
        "linear_attention_calls": int(s.linear_attention_calls),
        "imbalance": float(s.imbalance),
        "plan_seconds": float(s.plan_seconds),
    }


def measure_workload(spec: WorkloadSpec, cfg: SuiteConfig, row: dict | None = None) -> dict:
    """Generate, ingest, plan (Numba and reference) and train (tree vs expanded) one workload.

    Fills and returns `row` (a new dict if None), so that a caller sees what was measured before
    a failure.
    """
    row = {"workload": spec.name} if row is None else row
    wcfg = WorkloadConfig(**spec.gen)
    w, row["gen_seconds"] = timed(generate_workload, wcfg)
    row.update({k: v for k, v in w.stats().items() if k in ("trajectories", "unique_tokens", "expanded_tokens", "compression_ideal", "max_trajectory_tokens")})
    log.info("bench workloads: %s: %d trajectories, %d expanded / %d unique tokens (ideal %.2fx)",
             spec.name, row["trajectories"], row["expanded_tokens"], row["unique_tokens"], row["compression_ideal"])

    forest_from_json = _optional("planner_service.ingest", "forest_from_json")
    if forest_from_json is None:
        row["skipped"] = "ingest (planner_service.ingest.forest_from_json) not present yet"
        return row
    doc = w.dumps("tree")
    forest, row["ingest_seconds"] = timed(forest_from_json, doc)
    del doc
    if (forest.unique_tokens, forest.expanded_tokens) != (w.unique_tokens, w.expanded_tokens):
        raise AssertionError(
            f"{spec.name}: ingest built {forest.unique_tokens}/{forest.expanded_tokens} unique/expanded tokens, "
            f"the generator made {w.unique_tokens}/{w.expanded_tokens}"
        )
    plan_step = _optional("planner_service.planner", "plan_step")
    PlanConfig = _optional("planner_service.planner", "PlanConfig")
    if plan_step is None or PlanConfig is None:
        row["skipped"] = "planner (planner_service.planner.plan_step) not present yet"
        return row
    warmup = _optional("planner_service.planner", "warmup")
    if warmup is not None:
        warmup()
    model_config = None
    if not cfg.full:  # the memory model of the model the trainer runs (full scale: the planner's default)
        from trainer.models import NAMED_CONFIGS

        model_config = NAMED_CONFIGS["tiny" if cfg.quick else cfg.model]().to_hf_dict()
    pcfg = PlanConfig(world_size=spec.world_size, microbatch_tokens=spec.microbatch_tokens, chunk_size=spec.chunk_size,
                      windows=spec.windows, model_config=model_config)
    plan, row["planner_seconds"] = timed(plan_step, forest, pcfg)
    st = _plan_stats(plan)
    row.update(
        computed_tokens=st["computed_tokens"],
        computed_per_unique=st["computed_tokens"] / max(1, st["unique_tokens"]),
        compression_achieved=st["compression_achieved"],
        microbatches=st["microbatches"],
        linear_attention_calls=st["linear_attention_calls"],
        replay_tokens=st["replay_tokens"],
        duplicated_tokens=st["duplicated_tokens"],
    )
    log.info("bench workloads: %s: planned in %.3f s, computed/unique %.3f, %d linear-attention calls",
             spec.name, row["planner_seconds"], row["computed_per_unique"], row["linear_attention_calls"])
    if cfg.reference_planner and w.unique_tokens <= cfg.reference_max_tokens:
        try:
            ref, row["planner_ref_seconds"] = timed(plan_step, forest, pcfg, impl="ref")
        except TypeError as exc:  # plan_step without a reference switch
            row["planner_ref_note"] = f"no reference planner entry point ({exc})"
        else:
            if _plan_stats(ref)["computed_tokens"] != st["computed_tokens"]:
                row["planner_ref_note"] = "reference plan differs from the Numba plan"
            row["planner_speedup"] = row["planner_ref_seconds"] / max(row["planner_seconds"], 1e-9)
    elif cfg.reference_planner:
        row["planner_ref_note"] = f"reference not timed above {cfg.reference_max_tokens} distinct tokens"
    # the baseline packs whole trajectories (standard sequence packing): B raised to the longest
    longest = int(forest.traj_length().max())
    expanded, row["planner_expanded_seconds"] = timed(plan_step, forest, _replace(
        pcfg, PlanConfig, sharing=False, windows=False, microbatch_tokens=max(spec.microbatch_tokens, longest), memory_tokens=0))
    row["linear_attention_calls_expanded"] = _plan_stats(expanded)["linear_attention_calls"]
    if cfg.trainer and not cfg.full:
        row.update(_measure_trainer(plan, expanded, row, cfg, forest))
    elif not cfg.full:
        row["trainer_note"] = "update throughput not timed (--no-trainer)"
    return row


def _replace(pcfg, PlanConfig, **changes):
    fields = ("world_size", "microbatch_tokens", "memory_tokens", "chunk_size", "conv_kernel", "sharing", "windows", "replay",
              "all_positions", "model_config", "dtype")
    return PlanConfig(**{**{f: getattr(pcfg, f) for f in fields if hasattr(pcfg, f)}, **changes})


def _measure_trainer(plan, expanded, row: dict, cfg: SuiteConfig, forest) -> dict:
    """Update throughput (expanded tokens per CPU second of forward + backward + AdamW step) of the
    tree plan and the expanded plan on the same model (`cfg.model`), and of the peer a user would
    run instead: transformers' Qwen3-Next on the same weights, trajectory by trajectory
    (`benchmarks.peer`; on a seeded subset of `cfg.peer_max_tokens` expanded tokens when the batch
    is larger). One warm-up step each, then alternating timed steps; the fastest step of each
    counts. CPU seconds of this process, with `cfg.trainer_threads` intra-op threads and a steady
    allocator (`benchmarks.allocator`), rather than wall seconds, because other processes on a
    shared machine only ever add wall time; the wall ratio is reported beside it. Peak bytes saved
    for backward per mode (`benchmarks.peer.SavedTensorBytes`)."""
    Executor = _optional("trainer.executor", "Executor")
    ExecutorConfig = _optional("trainer.executor", "ExecutorConfig")
    train_step = _optional("trainer.executor", "train_step")
    build_model = _optional("trainer.models.loading", "build_model")
    make_optimizer = _optional("trainer.optim", "make_optimizer")
    plan_flops = _optional("trainer.flops", "plan_flops")
    if None in (Executor, ExecutorConfig, train_step, build_model, make_optimizer, plan_flops):
        return {"trainer_note": "trainer (trainer.executor.Executor) not present yet"}
    import torch

    from benchmarks.allocator import steady_allocator
    from benchmarks.peer import SavedTensorBytes, TransformersPeer

    steady_allocator()  # the rest of this process keeps the fixed thresholds too
    torch.manual_seed(0)
    model = build_model("tiny" if cfg.quick else cfg.model, seed=0)
    ex = Executor(model, ExecutorConfig(chunk_size=plan.header.params.chunk_size))
    opt = make_optimizer(model.parameters(), lr=1e-5)
    steps = cfg.trainer_steps if cfg.trainer_steps is not None else (1 if cfg.quick else 5)
    wall: dict[str, list[float]] = {"tree": [], "expanded": [], "transformers": []}
    cpu: dict[str, list[float]] = {"tree": [], "expanded": [], "transformers": []}
    saved = {"tree": 0, "expanded": 0, "transformers": 0}
    rng = np.random.default_rng(7)
    peer_trajs, n_peer = [], 0
    for t in rng.permutation(forest.num_trajectories).tolist():
        if n_peer >= cfg.peer_max_tokens:
            break
        a, b = int(forest.traj_offset[t]), int(forest.traj_offset[t + 1])
        peer_trajs.append((forest.path_tokens(t).tolist(), forest.loss_mask[a:b].tolist()))
        n_peer += b - a
    peer = TransformersPeer.from_model(model)
    first = 0 if cfg.trainer_warmup else 1
    threads = torch.get_num_threads()
    if cfg.trainer_threads:
        torch.set_num_threads(cfg.trainer_threads)
    try:
        for step in range(first, steps + 1):
            for name, p in (("tree", plan), ("expanded", expanded), ("transformers", None)):
                with Stopwatch() as sw:
                    if p is None:
                        peak = peer.train_step([x for x, _ in peer_trajs], [m for _, m in peer_trajs])[2]
                    else:
                        with SavedTensorBytes(model) as gauge:
                            train_step(ex, p, opt)
                        peak = gauge.peak
                saved[name] = max(saved[name], peak)
                if step:  # step 0 warms up allocators and caches
                    wall[name].append(sw.wall)
                    cpu[name].append(sw.cpu)
            log.info("bench workloads: %s: trainer step %d/%d%s", row["workload"], step, steps,
                     f" (tree {wall['tree'][-1]:.2f} s, expanded {wall['expanded'][-1]:.2f} s wall)" if step else " (warm-up)")
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    n_e = row["expanded_tokens"]
    tree_s, exp_s = min(cpu["tree"]), min(cpu["expanded"])
    peer_rate = n_peer / min(cpu["transformers"])
    ratio = exp_s / tree_s
    chunk_size = plan.header.params.chunk_size
    flops_tree = plan_flops(plan, model.config, chunk_size=chunk_size)
    flops_expanded = plan_flops(expanded, model.config, chunk_size=chunk_size)
    flop_compression = flops_expanded.total / flops_tree.total
    return {
        "flops_tree": flops_tree.as_dict(),
        "flops_expanded": flops_expanded.as_dict(),
        "flop_compression": flop_compression,
        "trainer_threads": used_threads,
        "tree_step_cpu_seconds": tree_s,
        "expanded_step_cpu_seconds": exp_s,
        "tree_step_seconds": min(wall["tree"]),
        "expanded_step_seconds": min(wall["expanded"]),
        "tree_tokens_per_cpu_s": n_e / tree_s,
        "expanded_tokens_per_cpu_s": n_e / exp_s,
        "throughput_ratio": ratio,
        "throughput_ratio_wall": min(wall["expanded"]) / min(wall["tree"]),
        "fraction_of_ideal": ratio / flop_compression,
        "fraction_of_token_compression": ratio / row["compression_ideal"],
        "transformers_tokens": n_peer,
        "transformers_tokens_per_cpu_s": peer_rate,
        "tree_vs_transformers": n_e / tree_s / peer_rate,
        "expanded_vs_transformers": n_e / exp_s / peer_rate,
        "tree_vs_transformers_ideal": n_e / tree_s / peer_rate / flop_compression,
        "peak_saved_bytes_tree": saved["tree"],
        "peak_saved_bytes_expanded": saved["expanded"],
        "peak_saved_bytes_transformers": saved["transformers"],
        "peak_live_tokens_tree": int(plan.header.stats.peak_live_tokens),
    }


def run_workloads(cfg: SuiteConfig) -> dict:
    """The headline benchmark: one row per workload of `workload_specs`."""
    rows = []
    for spec in workload_specs(quick=cfg.quick, full=cfg.full):
        row: dict = {"workload": spec.name}
        try:
            measure_workload(spec, cfg, row)
        except Exception as exc:  # one workload's failure must not hide the other rows
            row["error"] = f"{type(exc).__name__}: {exc}"
            log.error("bench workloads: %s failed: %s", spec.name, row["error"], exc_info=True)
        rows.append(row)
    failed = [r["workload"] for r in rows if "error" in r]
    if failed:
        raise WorkloadFailures(f"{len(failed)} of {len(rows)} workloads failed: {', '.join(failed)}", rows)
    out = {"mode": _mode(cfg), "rows": rows}
    if cfg.full:
        out["placement"] = run_placement(cfg)
    return out


#: the placement table: ranks, microbatch budgets and chunk size (full scale / quick)
PLACEMENT_GRID = {"full": ((8, 32, 64), (16384, 32768, 65536), 64), "quick": ((2, 4), (256, 512), 16)}


#: issue 20's goal for the lock-step plan of every cell (lockstep_makespan / makespan)
LOCKSTEP_TARGET = 1.10
#: issue 24's goal for the lock-step plans with windows across ranks at W >= 32: compression / ideal
#: at least this, at a step (lock-step makespan) at most CROSS_GOAL_RATIO x the lower bound
CROSS_GOAL_COMPRESSION = 0.95
CROSS_GOAL_RATIO = 1.05
#: a second placement per cell that accepts a makespan up to this factor above the lower bound
#: (PlanConfig.makespan_slack) to duplicate less: the trade-off between the two targets
PLACEMENT_LOOSE_SLACK = 1.25


def run_placement(cfg: SuiteConfig) -> dict:
    """Makespan ratio (max rank cost / max(total / W, longest trajectory)) and compression of
    the default planner (sharing windows, computed-rows cost model) over the grid of ranks and
    microbatch budgets; one plan per cell, timed in wall and CPU seconds, plus the same cell
    planned with makespan_slack = PLACEMENT_LOOSE_SLACK (its ratio and compression only) and as a
    lock-step plan (its lockstep_ratio and phases; with windows across ranks allowed, the two plans
    `plan_step` compared: compression, makespan ratio and step over the lower bound of each, the
    bytes the crossing one exchanges per step against the duplicated rows' activation bytes it
    saves), and upper bounds on the compression any placement reaches
    (`placement_bound.compression_bound`)."""
    from benchmarks.placement_bound import compression_bound, placement_specs

    plan_step = _optional("planner_service.planner", "plan_step")
    PlanConfig = _optional("planner_service.planner", "PlanConfig")
    forest_from_json = _optional("planner_service.ingest", "forest_from_json")
    worlds, budgets, chunk = PLACEMENT_GRID["quick" if cfg.quick else "full"]
    _optional("planner_service.planner", "warmup")()
    rows = []
    for name, gen in placement_specs(quick=cfg.quick):
        w = generate_workload(WorkloadConfig(**gen))
        forest = forest_from_json(w.dumps("tree"))
        trees = len(forest.tree_ids)
        for W in worlds:
            for B in budgets:
                c0, t0 = time.process_time(), time.perf_counter()
                plan = plan_step(forest, PlanConfig(world_size=W, microbatch_tokens=B, chunk_size=chunk))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                loose = plan_step(forest, PlanConfig(world_size=W, microbatch_tokens=B, chunk_size=chunk,
                                                     makespan_slack=PLACEMENT_LOOSE_SLACK)).header.stats
                lock = plan_step(forest, PlanConfig(world_size=W, microbatch_tokens=B, chunk_size=chunk, lockstep=True)).header.stats
                st = plan.header.stats
                target = 1.05 if trees >= 2 * W else 1.25
                vs_ideal = st.compression_achieved / st.compression_ideal
                with_x, without_x = lock.with_cross_edges, lock.without_cross_edges
                row_bytes = plan.header.params.memory.activation_row_bytes
                rows.append({
                    "workload": name, "world_size": W, "microbatch_tokens": B, "trees_per_rank": trees / W,
                    "expanded_tokens": int(st.expanded_tokens), "makespan_ratio": float(st.makespan_ratio),
                    "target": target, "ratio_met": st.makespan_ratio <= target,
                    "compression_vs_ideal": vs_ideal, "compression_met": vs_ideal >= 0.95,
                    "duplicated_tokens": int(st.duplicated_tokens), "microbatches": int(st.microbatches),
                    "recomputed": sum(mb.recompute for r in plan.ranks for mb in r.microbatches),
                    "peak_live_tokens": int(st.peak_live_tokens), "plan_seconds": wall, "plan_cpu_seconds": cpu,
                    "loose_makespan_ratio": float(loose.makespan_ratio),
                    "loose_compression_vs_ideal": loose.compression_achieved / loose.compression_ideal,
                    # the best any placement can reach (benchmarks/placement_bound.py): at this
                    # plan's makespan, and anywhere the ratio target is met
                    "bound_at_makespan": compression_bound(forest, st.makespan),
                    "bound_at_target": compression_bound(forest, target * st.makespan_lower_bound),
                    # the same cell as a lock-step plan (DESIGN §5.7): its phases' makespan over its free
                    # makespan, and over this (free) plan's
                    "lockstep_ratio": float(lock.lockstep_ratio), "lockstep_met": lock.lockstep_ratio <= LOCKSTEP_TARGET,
                    "lockstep_vs_free": lock.lockstep_makespan / st.makespan if st.makespan > 0 else 1.0,
                    "lockstep_phases": int(lock.lockstep_phases),
                    # windows across ranks (issue 24): the lock-step plan's edges, and the two plans it was chosen from
                    "cross_edges": int(lock.cross_edges), "lockstep_plan_seconds": float(lock.plan_seconds),
                    "lockstep_compression_vs_ideal": lock.compression_achieved / lock.compression_ideal,
                    "lockstep_step_vs_bound": lock.lockstep_makespan / lock.makespan_lower_bound,
                    **_crossing_columns(with_x, without_x, lock.compression_ideal, row_bytes, W),
                })
                log.info("bench placement: %s W=%d B=%d: makespan ratio %.3f, compression %.3f of ideal, lock-step ratio "
                         "%.3f, %.2f s", name, W, B, st.makespan_ratio, vs_ideal, lock.lockstep_ratio, wall)
        del forest, w
    return {"mode": _mode(cfg), "chunk_size": chunk, "rows": rows}


def _crossing_columns(with_x, without_x, ideal: float, row_bytes: int, world: int) -> dict:
    """The placement table's columns of the two lock-step plans compared (PlanStats.with_cross_edges,
    without_cross_edges): compression / ideal, makespan ratio and step / lower bound of each, the
    crossing plan's exchanged bytes and the activation bytes of the duplicated rows it saves, and
    issue 24's goal on the plan with crossing windows (W >= 32)."""
    if not without_x.lockstep_makespan:
        return {}
    out = {}
    for tag, c in (("crossing", with_x), ("local", without_x)):
        out[f"{tag}_compression_vs_ideal"] = c.compression_achieved / ideal if c.lockstep_makespan else None
        out[f"{tag}_makespan_ratio"] = c.makespan_ratio if c.lockstep_makespan else None
        out[f"{tag}_step_vs_bound"] = c.lockstep_makespan / c.makespan_lower_bound if c.lockstep_makespan else None
    if with_x.lockstep_makespan:
        out["exchanged_gib"] = with_x.exchanged_bytes / 2**30
        out["saved_activation_gib"] = (without_x.duplicated_tokens - with_x.duplicated_tokens) * row_bytes / 2**30
        if world >= 32:
            out["crossing_goal_met"] = (out["crossing_compression_vs_ideal"] >= CROSS_GOAL_COMPRESSION
                                        and out["crossing_step_vs_bound"] <= CROSS_GOAL_RATIO)
    return out


PLACEMENT_COLUMNS = (
    ("workload", "workload"), ("world_size", "W"), ("microbatch_tokens", "B"), ("trees_per_rank", "trees / rank"),
    ("makespan_ratio", "makespan ratio"), ("target", "target"), ("compression_vs_ideal", "compression / ideal"),
    ("duplicated_tokens", "duplicated tokens"), ("recomputed", "recomputed windows"), ("plan_seconds", "plan s (wall)"),
    ("plan_cpu_seconds", "plan s (CPU)"), ("loose_makespan_ratio", f"ratio, slack {PLACEMENT_LOOSE_SLACK}"),
    ("loose_compression_vs_ideal", f"compression / ideal, slack {PLACEMENT_LOOSE_SLACK}"),
    ("bound_at_makespan", "bound at this makespan"), ("bound_at_target", "bound at the ratio target"),
    ("lockstep_ratio", "lockstep_ratio"), ("lockstep_vs_free", "lock-step / free makespan"),
    ("lockstep_phases", "lock-step phases"), ("lockstep_plan_seconds", "lock-step plan s (wall)"),
    ("cross_edges", "lock-step cross edges"),
    ("lockstep_compression_vs_ideal", "lock-step compression / ideal"), ("lockstep_step_vs_bound", "lock-step step / bound"),
    ("crossing_compression_vs_ideal", "with crossing: compression / ideal"), ("crossing_makespan_ratio", "with crossing: ratio"),
    ("crossing_step_vs_bound", "with crossing: step / bound"),
    ("local_compression_vs_ideal", "without: compression / ideal"), ("local_makespan_ratio", "without: ratio"),
    ("local_step_vs_bound", "without: step / bound"),
    ("exchanged_gib", "exchanged GiB / step"), ("saved_activation_gib", "saved duplicated activations GiB"),
)


def placement_table(rows: list[dict]) -> str:
    """The markdown placement table; a ratio or compression that misses its target is marked."""
    lines = ["| " + " | ".join(h for _, h in PLACEMENT_COLUMNS) + " |", "|" + "---|" * len(PLACEMENT_COLUMNS)]
    for r in rows:
        cells = []
        for key, _ in PLACEMENT_COLUMNS:
            v = r.get(key)
            if key == "makespan_ratio":
                cells.append(f"{v:.3f}" + ("" if r["ratio_met"] else " (missed)"))
            elif key == "compression_vs_ideal":
                cells.append(f"{v:.3f}" + ("" if r["compression_met"] else " (< 0.95)"))
            elif key == "target":
                cells.append(f"<= {v}")
            elif key == "trees_per_rank":
                cells.append(f"{v:.2f}")
            elif key == "lockstep_ratio":
                cells.append("" if v is None else f"{v:.3f}" + ("" if r["lockstep_met"] else f" (> {LOCKSTEP_TARGET:.2f})"))
            elif key == "crossing_step_vs_bound" and "crossing_goal_met" in r and v is not None:
                cells.append(f"{v:.3f}" + ("" if v <= CROSS_GOAL_RATIO else f" (> {CROSS_GOAL_RATIO})"))
            elif key == "crossing_compression_vs_ideal" and "crossing_goal_met" in r and v is not None:
                cells.append(f"{v:.3f}" + ("" if v >= CROSS_GOAL_COMPRESSION else f" (< {CROSS_GOAL_COMPRESSION})"))
            elif key.startswith(("loose_", "bound_", "lockstep_vs", "lockstep_compression", "lockstep_step", "crossing_",
                                 "local_")):
                cells.append("" if v is None else f"{v:.3f}")
            elif key.endswith("_gib"):
                cells.append("" if v is None else f"{v:.1f}")
            else:
                cells.append(_fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


class WorkloadFailures(RuntimeError):
    """Some headline workloads failed; `rows` still holds every row (failed ones with "error")."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows


def _mode(cfg: SuiteConfig) -> str:
    return "full" if cfg.full else "quick" if cfg.quick else "cpu"


def run_module(name: str, cfg: SuiteConfig) -> dict:
    """Run one component benchmark module; {"status": "skipped"|"failed"|"ok", ...}."""
    module, _ = MODULES[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return {"status": "skipped", "reason": f"{module.replace('.', '/')}.py is not present yet"}
        return {"status": "skipped", "reason": f"{module} needs {exc.name}, which is not present yet"}
    if not callable(getattr(mod, "run", None)):
        return {"status": "skipped", "reason": f"{module} has no run(quick) function"}
    result, seconds = timed(mod.run, quick=cfg.quick)
    return {"status": "ok", "seconds": seconds, "result": result}


def run_suite(cfg: SuiteConfig) -> dict:
    """Run the selected benchmarks and write every result file. Returns the results document."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict = {"mode": _mode(cfg), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "machine": _machine(), "command": _command(cfg), "benchmarks": {}}
    for name in cfg.names():
        log.info("bench: %s ...", name)
        t0 = time.perf_counter()
        try:
            if name == "workloads":
                entry = {"status": "ok", "result": run_workloads(cfg)}
            else:
                entry = run_module(name, cfg)
        except Exception as exc:  # a failing benchmark must not hide the others' results
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            if isinstance(exc, WorkloadFailures):
                entry["result"] = {"mode": _mode(cfg), "rows": exc.rows}
            log.error("bench: %s failed: %s", name, entry["error"])
        entry["seconds"] = time.perf_counter() - t0
        doc["benchmarks"][name] = entry
        log.info("bench: %s %s in %.1f s%s", name, entry["status"], entry["seconds"],
                 f" ({entry['reason']})" if "reason" in entry else "")
    write_results(doc, cfg)
    return doc


def _machine() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "commit": _git_commit()}


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _command(cfg: SuiteConfig) -> str:
    parts = ["harts bench"]
    if cfg.quick:
        parts.append("--quick")
    if cfg.full:
        parts.append("--full")
    if not cfg.trainer:
        parts.append("--no-trainer")
    if not cfg.reference_planner:
        parts.append("--no-reference")
    parts += [f"--only {n}" for n in cfg.only]
    return " ".join(parts)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


HEADLINE = (
    ("workload", "workload"),
    ("expanded_tokens", "expanded tokens"),
    ("compression_ideal", "token compression"),
    ("computed_per_unique", "computed / unique"),
    ("compression_achieved", "achieved compression"),
    ("planner_seconds", "planner Numba (s)"),
    ("planner_ref_seconds", "planner reference (s)"),
    ("calls", "linear-attn calls tree / expanded"),
    ("flop_compression", "ideal: FLOP compression"),
    ("tree_tokens_per_cpu_s", "tree tok/CPU-s"),
    ("expanded_tokens_per_cpu_s", "expanded tok/CPU-s"),
    ("transformers_tokens_per_cpu_s", "transformers tok/CPU-s"),
    ("tree_vs_transformers", "speedup vs transformers"),
    ("expanded_vs_transformers", "expanded / transformers"),
    ("throughput_ratio", "update throughput tree / expanded"),
    ("fraction_of_ideal", "fraction of ideal"),
    ("tree_vs_transformers_ideal", "vs transformers / ideal"),
)


def headline_table(rows: list[dict]) -> str:
    """The markdown headline table (one row per workload); columns no row has a value for are left out."""
    cols = [(k, h) for k, h in HEADLINE
            if k == "workload" or any(("linear_attention_calls" if k == "calls" else k) in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for key, _ in cols:
            if key == "calls":
                cells.append(f"{_fmt(r.get('linear_attention_calls'))} / {_fmt(r.get('linear_attention_calls_expanded'))}"
                             if "linear_attention_calls" in r else "-")
            elif key in ("compression_ideal", "compression_achieved", "flop_compression", "throughput_ratio",
                         "tree_vs_transformers", "expanded_vs_transformers") and key in r:
                cells.append(f"{r[key]:.2f}x")
            elif key.endswith("_tokens_per_cpu_s") and key in r:
                cells.append(f"{r[key]:,.0f}")
            elif key in ("fraction_of_ideal", "fraction_of_token_compression", "tree_vs_transformers_ideal") and key in r:
                cells.append(f"{100 * r[key]:.0f}%")
            else:
                cells.append(_fmt(r.get(key)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _published_line() -> str:
    parts = [f"{name} {lo}x" if lo == hi else f"{name} {lo}-{hi}x" for name, lo, hi in PUBLISHED]
    return "Published update-throughput speedups for context (GPU clusters, large models): " + "; ".join(parts) + "."


def _threads_text(rows: list[dict]) -> str:
    used = sorted({r["trainer_threads"] for r in rows if "trainer_threads" in r})
    if not used:
        return "torch's intra-op threads"
    return f"{'/'.join(map(str, used))} intra-op thread{'s' if used != [1] else ''}"


def _workload_notes(rows: list[dict], mode: str) -> list[str]:
    notes = []
    for r in rows:
        for key in ("error", "skipped", "trainer_note", "planner_ref_note"):
            if key in r:
                notes.append(f"- {r['workload']}: {r[key]}.")
    if mode == "full":
        notes.append("- Full scale: planning only (8 ranks, sharing windows, B = 65,536, C = 64); no trainer run.")
    else:
        notes.append("- CPU scale: token lengths x0.02 (quick: x0.01) and fewer turns; one rank, B = 2,048 (quick: 256, "
                     "below the trees' sizes: sharing windows), C = 16 (a 64-token chunk would span several scaled "
                     "turns and inflate replay); the expanded plan packs whole trajectories (B raised to the longest); "
                     "update throughput in expanded tokens per CPU second of this process (fastest timed step of "
                     "each mode; the machine is shared, so wall time is noisier) with "
                     f"{_threads_text(rows)}, fixed malloc thresholds, reference kernels, fused AdamW; transformers: "
                     "Qwen3NextForCausalLM on the same weights (exported with `trainer.export`), trajectory by "
                     "trajectory, on a seeded subset of up to 20,000 expanded tokens of the batch.")
    return notes


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def render_result(name: str, entry: dict) -> str:
    """Markdown of one benchmark's entry: a key/value table, and a table per list of dict rows."""
    lines = [f"# Benchmark: {name}", ""]
    if name in MODULES:
        lines += [MODULES[name][1] + ".", ""]
    lines.append(f"Status: **{entry['status']}** in {entry.get('seconds', 0):.1f} s.")
    if entry["status"] == "skipped":
        lines.append(f"Skipped: {entry['reason']}.")
    if entry["status"] == "failed":
        lines += ["", "```", entry.get("traceback", entry.get("error", "")).strip(), "```"]
    result = entry.get("result")
    own = None
    if name in MODULES and entry["status"] == "ok":  # a module that renders its own tables
        own = getattr(importlib.import_module(MODULES[name][0]), "result_markdown", None)
    if isinstance(result, dict) and own is not None:
        return "\n".join(lines) + "\n\n" + own(result) + "\n"
    if isinstance(result, dict):
        scalars, tables = {}, {}
        for k, v in _flatten(result).items():
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                tables[k] = v
            else:
                scalars[k] = v
        if scalars:
            lines += ["", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v if not isinstance(v, (list, tuple)) else ', '.join(_fmt(x) for x in v))} |" for k, v in scalars.items()]
        for k, rows in tables.items():
            cols = list(dict.fromkeys(c for r in rows for c in _flatten(r)))
            lines += ["", f"**{k}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            for r in rows:
                fr = _flatten(r)
                lines.append("| " + " | ".join(_fmt(fr.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_results(doc: dict, cfg: SuiteConfig) -> list[Path]:
    """Write summary.md, README-table.md, <name>.md, results.json and the plots; returns the paths."""
    out = cfg.out_dir
    suffix = "-full" if cfg.full else ""
    written = []
    wl = doc["benchmarks"].get("workloads", {})
    rows = wl.get("result", {}).get("rows", [])
    plots = write_plots(rows, out, suffix) if rows else []
    written += plots

    table = headline_table(rows) if rows else "(the workloads benchmark did not run)"
    notes = _workload_notes(rows, doc["mode"])
    intro = (f"Synthetic agentic workloads from `harts_client/synthetic.py` ({doc['mode']} scale, "
             f"`{doc['command']}`, commit {doc['machine']['commit']}, {doc['machine']['cpus']} CPUs). ")
    intro += ("Planning only." if cfg.full else
              f"Update throughput: the `{'tiny' if cfg.quick else cfg.model}` Qwen3-Next-style model on the CPU, forward + backward + AdamW step, "
              "expanded tokens per CPU second; fraction of ideal = throughput ratio / the plan's FLOP compression "
              "(`trainer/flops.py`: expanded plan FLOPs / tree plan FLOPs); speedup vs transformers = tree "
              "throughput / transformers' on the same weights; the last column divides that by the FLOP compression "
              "(target >= 90%).")
    if not cfg.full and (not cfg.only or "workloads" in cfg.only):
        readme = [intro, "", table, "", _published_line(), *([""] + notes if notes else []), "",
                  "![compression](benchmarks/results/compression.png)", ""]
        (out / "README-table.md").write_text("\n".join(readme))
        written.append(out / "README-table.md")

    summary = [f"# HARTS benchmark results ({doc['mode']})", "", f"Command: `{doc['command']}`; started {doc['started']}; "
               f"machine: {doc['machine']['platform']}, Python {doc['machine']['python']}, {doc['machine']['cpus']} CPUs, "
               f"commit {doc['machine']['commit']}.", "", "## Headline", "", intro, "", table, "", _published_line()]
    if notes:
        summary += ["", *notes]
    placement = wl.get("result", {}).get("placement", {}).get("rows", [])
    if placement:
        summary += ["", "## Placement", "",
                    "Makespan ratio = max rank cost / max(total cost / W, longest trajectory's cost) with the default "
                    "planner (sharing windows, C = 64, cost = computed rows, makespan_slack 1.02); targets: <= 1.05 with "
                    "at least 2 trees per rank, <= 1.25 otherwise; compression achieved >= 0.95 of ideal. The "
                    f"two slack columns plan the same cell with makespan_slack {PLACEMENT_LOOSE_SLACK} (a longer step for "
                    "less duplication). The bounds are the highest compression / ideal any placement can reach "
                    "(benchmarks/placement_bound.py: every rank computes the root path of what it keeps) with no rank "
                    "above this plan's makespan, and with the makespan ratio at its target. The lock-step columns plan "
                    "the cell with lockstep=True (one global sequence of phases, DESIGN §5.7; forward 1/3 and backward "
                    f"2/3 of a microbatch's cost, a phase as long as its slowest rank): lockstep_ratio = lock-step "
                    f"makespan / that plan's makespan (target <= {LOCKSTEP_TARGET}), and the same over the free plan's "
                    "makespan. The lock-step plan may give windows across ranks (issue 24: a tree's shared prefix "
                    "imported from the rank that computes it); the planner builds it with and without them and keeps "
                    "the crossing one only where its step (lock-step makespan) is shorter, or at most 1% longer with "
                    "fewer duplicated rows: 'lock-step cross edges' and the next two columns are the chosen plan's, then "
                    "both candidates' compression / ideal, makespan ratio and step / lower bound, the bytes the crossing "
                    "candidate exchanges per step (exports and their gradients) and the activations of the duplicated "
                    f"rows it saves; goal at W >= 32: >= {CROSS_GOAL_COMPRESSION} of ideal at a step <= "
                    f"{CROSS_GOAL_RATIO} x the bound.", "",
                    placement_table(placement)]
    summary += ["", "## Benchmarks", "", "| benchmark | status | seconds | details |", "|---|---|---|---|"]
    for name, entry in doc["benchmarks"].items():
        detail = entry.get("reason") or entry.get("error") or f"[{name}{suffix}.md]({name}{suffix}.md)"
        summary.append(f"| {name} | {entry['status']} | {entry['seconds']:.1f} | {_fmt(detail)} |")
        (out / f"{name}{suffix}.md").write_text(render_result(name, entry))
        written.append(out / f"{name}{suffix}.md")
    summary += [""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    (out / f"summary{suffix}.md").write_text("\n".join(summary))
    written.append(out / f"summary{suffix}.md")
    (out / f"results{suffix}.json").write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    written.append(out / f"results{suffix}.json")
    log.info("bench: wrote %s", ", ".join(str(p) for p in written))
    return written


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    return repr(v)


def write_plots(rows: list[dict], out: Path, suffix: str = "") -> list[Path]:
    """compression.png (token / plan / FLOP compression and throughput ratio per workload, published
    figures as a band) and planner.png (Numba vs reference planner seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = [r["workload"] for r in rows]
    x = np.arange(len(rows))
    series = [("compression_ideal", "token compression (expanded / unique)"),
              ("compression_achieved", "plan compression (expanded / computed)"),
              ("flop_compression", "ideal: FLOP compression of the plan"),
              ("throughput_ratio", "update throughput, tree / expanded")]
    series = [(k, label) for k, label in series if any(k in r for r in rows)]
    fig, ax = plt.subplots(figsize=(8.5, 4.2), dpi=110)
    width = 0.8 / max(1, len(series))
    for i, (key, label) in enumerate(series):
        vals = [r.get(key, np.nan) for r in rows]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.1f}x" if np.isfinite(v) else "" for v in vals], fontsize=7, padding=1)
    lo, hi = PUBLISHED[0][1], PUBLISHED[0][2]
    ax.axhspan(lo, hi, color="0.85", zorder=0, label=f"HARTS published {lo}-{hi}x")
    for name, v, _ in PUBLISHED[1:]:
        ax.axhline(v, color="0.5", lw=0.8, ls="--", zorder=0)
        ax.text(len(rows) - 0.5, v, f" {name.split(' (')[0]} {v}x", fontsize=7, va="bottom", ha="right", color="0.3")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("x over trajectory-expanded")
    ax.set_title("Prefix sharing on synthetic agentic workloads", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    p = out / f"compression{suffix}.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(p)

    if any("planner_seconds" in r for r in rows):
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
        for i, (key, label) in enumerate((("planner_seconds", "Numba"), ("planner_ref_seconds", "plain-Python reference"))):
            vals = [r.get(key, np.nan) for r in rows]
            ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label=label)
        ax.set_yscale("log")
        ax.set_xticks(x, names, fontsize=8)
        ax.set_ylabel("planning time (s, log)")
        ax.set_title("Planner time per step", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / f"planner{suffix}.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(p)
    return paths


def _names(text: str) -> list[str]:
    out = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in out if n not in NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected names from {', '.join(NAMES)}, got {', '.join(bad)}")
    return out


def parser() -> argparse.ArgumentParser:
    """The suite's command line (`harts bench` forwards its arguments here unchanged)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny inputs everywhere (seconds; used by the tests)")
    mode.add_argument("--full", action="store_true",
                      help="planning only, at full scale (tens of millions of expanded tokens per workload)")
    p.add_argument("--only", type=_names, action="append", default=[], metavar="NAME[,NAME]",
                   help=f"run only these benchmarks (repeatable): {', '.join(NAMES)}")
    p.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--trainer-steps", type=int, default=None, help="timed optimizer steps per execution mode (default 5, --quick 1)")
    p.add_argument("--no-trainer", action="store_true", help="skip the tree vs expanded update-throughput timing")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="torch intra-op threads while the trainer is timed (default 1: CPU seconds then count work, "
                        "not OpenMP workers spinning; 0: torch's default)")
    p.add_argument("--model", default="small",
                   help="named model config of the throughput timing (small: 4.7M parameters; tiny: 0.33M, overhead-bound; --quick uses tiny)")
    p.add_argument("--no-reference", action="store_true", help="do not time the plain-Python reference planner")
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.suite [--quick|--full] [--only NAME ...] [--out DIR]`: run the suite, print
    one JSON object (each benchmark's status and seconds, the results directory); exit 1 when a
    benchmark failed, 2 on bad arguments."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = SuiteConfig(
            out_dir=args.out or RESULTS_DIR, quick=args.quick, full=args.full,
            only=tuple(n for group in args.only for n in group), trainer_steps=args.trainer_steps,
            reference_planner=not args.no_reference, trainer=not args.no_trainer, model=args.model,
            trainer_threads=args.trainer_threads,
        )
    except ValueError as exc:
        print(f"python -m benchmarks.suite: error: {exc}", file=sys.stderr)
        return 2
    doc = run_suite(cfg)
    summary = {name: {"status": e["status"], "seconds": round(e["seconds"], 2), **({"reason": e["reason"]} if "reason" in e else {}),
                      **({"error": e["error"]} if "error" in e else {})}
               for name, e in doc["benchmarks"].items()}
    print(json.dumps({"mode": doc["mode"], "out": str(cfg.out_dir), "benchmarks": summary}))
    return 1 if any(e["status"] == "failed" for e in doc["benchmarks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
