"""The suite's headline benchmark: per synthetic agentic workload, compression, planner time, throughput.

    rows = run_workloads(cfg)["rows"]           # one dict per `workload_specs` entry
    row = measure_workload(spec, cfg)           # generate, ingest, plan (Numba and reference), train

The update throughput times the tree plan, the expanded plan and transformers on the same model
(`_measure_trainer`); benchmarks/README.md ("The headline") for the columns and modes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from benchmarks.placement_table import run_placement
from benchmarks.suite_config import SuiteConfig, optional_attr, run_mode
from harts_client.synthetic import WorkloadConfig, generate_workload
from harts_client.timing import Stopwatch, timed

log = logging.getLogger("benchmarks.suite")  # also when run as __main__ (harts bench)


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

    forest_from_json = optional_attr("planner_service.ingest", "forest_from_json")
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
    plan_step = optional_attr("planner_service.planner", "plan_step")
    PlanConfig = optional_attr("planner_service.planner", "PlanConfig")
    if plan_step is None or PlanConfig is None:
        row["skipped"] = "planner (planner_service.planner.plan_step) not present yet"
        return row
    warmup = optional_attr("planner_service.planner", "warmup")
    if warmup is not None:
        warmup()
    model_config = None
    if not cfg.full:  # the memory model of the model the trainer runs (full scale: the planner's default)
        from trainer.models import NAMED_CONFIGS  # optional: torch, only where the trainer runs

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
    Executor = optional_attr("trainer.executor", "Executor")
    ExecutorConfig = optional_attr("trainer.executor", "ExecutorConfig")
    train_step = optional_attr("trainer.executor", "train_step")
    build_model = optional_attr("trainer.models.loading", "build_model")
    make_optimizer = optional_attr("trainer.optim", "make_optimizer")
    plan_flops = optional_attr("trainer.flops", "plan_flops")
    if None in (Executor, ExecutorConfig, train_step, build_model, make_optimizer, plan_flops):
        return {"trainer_note": "trainer (trainer.executor.Executor) not present yet"}
    # optional: torch and the peer only once the trainer is there to time
    import torch

    from benchmarks.allocator import steady_allocator
    from benchmarks.peer import SavedTensorBytes, TransformersPeer

    steady_allocator()  # the rest of this process keeps the fixed thresholds too
    torch.manual_seed(0)
    model = build_model("tiny" if cfg.quick else cfg.model, seed=0)
    ex = Executor(model, ExecutorConfig(chunk_size=plan.header.params.chunk_size))
    opt = make_optimizer(model.parameters(), lr=1e-5)
    peer_trajs, n_peer = _peer_subset(forest, cfg.peer_max_tokens)
    peer = TransformersPeer.from_model(model)

    def executor_step(p):
        def step() -> int:
            with SavedTensorBytes(model) as gauge:
                train_step(ex, p, opt)
            return gauge.peak
        return step

    modes = {"tree": executor_step(plan), "expanded": executor_step(expanded),
             "transformers": lambda: peer.train_step([x for x, _ in peer_trajs], [m for _, m in peer_trajs])[2]}
    threads = torch.get_num_threads()
    if cfg.trainer_threads:
        torch.set_num_threads(cfg.trainer_threads)
    try:
        wall, cpu, saved = _time_modes(modes, cfg, row["workload"])
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    chunk_size = plan.header.params.chunk_size
    flops_tree = plan_flops(plan, model.config, chunk_size=chunk_size)
    flops_expanded = plan_flops(expanded, model.config, chunk_size=chunk_size)
    flop_compression = flops_expanded.total / flops_tree.total
    return {"flops_tree": flops_tree.as_dict(), "flops_expanded": flops_expanded.as_dict(),
            "flop_compression": flop_compression, "trainer_threads": used_threads,
            **_throughput(row, wall, cpu, n_peer, flop_compression), **_peaks(saved, plan)}


def _peer_subset(forest, max_tokens: int) -> tuple[list[tuple[list[int], list[int]]], int]:
    """A seeded random subset of the trajectories, (tokens, loss mask) each, of about `max_tokens`
    expanded tokens, and its token count."""
    rng = np.random.default_rng(7)
    peer_trajs, n_peer = [], 0
    for t in rng.permutation(forest.num_trajectories).tolist():
        if n_peer >= max_tokens:
            break
        a, b = int(forest.traj_offset[t]), int(forest.traj_offset[t + 1])
        peer_trajs.append((forest.path_tokens(t).tolist(), forest.loss_mask[a:b].tolist()))
        n_peer += b - a
    return peer_trajs, n_peer


def _time_modes(modes: dict, cfg: SuiteConfig, workload: str
                ) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, int]]:
    """One warm-up step of every mode (unless cfg.trainer_warmup is off), then the timed steps,
    alternating modes. `modes`: name -> step() returning the peak bytes saved for backward.
    Returns the wall and CPU seconds of the timed steps and the peak saved bytes, per mode."""
    steps = cfg.trainer_steps if cfg.trainer_steps is not None else (1 if cfg.quick else 5)
    wall: dict[str, list[float]] = {name: [] for name in modes}
    cpu: dict[str, list[float]] = {name: [] for name in modes}
    saved = {name: 0 for name in modes}
    for step in range(0 if cfg.trainer_warmup else 1, steps + 1):
        for name, run in modes.items():
            with Stopwatch() as sw:
                peak = run()
            saved[name] = max(saved[name], peak)
            if step:  # step 0 warms up allocators and caches
                wall[name].append(sw.wall)
                cpu[name].append(sw.cpu)
        log.info("bench workloads: %s: trainer step %d/%d%s", workload, step, steps,
                 f" (tree {wall['tree'][-1]:.2f} s, expanded {wall['expanded'][-1]:.2f} s wall)" if step else " (warm-up)")
    return wall, cpu, saved


def _throughput(row: dict, wall: dict, cpu: dict, n_peer: int, flop_compression: float) -> dict:
    """Throughputs (fastest timed step of each mode) and their ratios to each other and to the ideal."""
    n_e = row["expanded_tokens"]
    tree_s, exp_s = min(cpu["tree"]), min(cpu["expanded"])
    peer_rate = n_peer / min(cpu["transformers"])
    ratio = exp_s / tree_s
    return {
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
    }


def _peaks(saved: dict[str, int], plan) -> dict:
    """Peak bytes saved for backward per mode, and the tree plan's peak live tokens."""
    return {
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
    out = {"mode": run_mode(cfg), "rows": rows}
    if cfg.full:
        out["placement"] = run_placement(cfg)
    return out


class WorkloadFailures(RuntimeError):
    """Some headline workloads failed; `rows` still holds every row (failed ones with "error")."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows
