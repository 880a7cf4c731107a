"""Trainer benchmark: update throughput of tree vs trajectory-expanded execution on this CPU.

Run: `.venv/bin/python -m benchmarks.bench_trainer [--quick]` (progress on stderr, one JSON object
of figures on stdout). A benchmark, not a timed test.

Workload: synthetic agentic group sampling (`benchmarks.workloads.generate("group", ...)`: a
shared system+tools prompt and task statement per task, then G multi-turn rollouts), and in the
full run also tree sampling (`"tree"`: branches at turn boundaries, at unaligned depths). Both
plans (tree: sharing with windows off; expanded: PlanConfig(sharing=False)) use the same token
budget and run on two copies of the same weights, each with its own AdamW, alternating steps.
A step is forward + backward of every microbatch + one optimizer step; throughput counts
expanded tokens (the work the step stands for) per second, median over the timed steps. The
headline `speedup` uses process CPU seconds (the project's CPUs are shared with other jobs, whose
load makes wall time swing by 2x between steps); `speedup_wall` is reported beside it. The ideal speedup is the plan's FLOP
compression (`trainer.flops`: FLOPs of the expanded plan / FLOPs of the tree plan, replay rows and
depth-weighted attention included); `fraction_of_ideal` = measured speedup / ideal (target >= 0.8);
`fraction_of_token_compression` divides by expanded / distinct tokens instead.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time

import torch

log = logging.getLogger("bench_trainer")

#: (name, scheme, tasks, scale, knobs) of the full run.
WORKLOADS = [
    ("group-G8", "group", 2, 0.05, {"group_size": 8, "turns": (3, 6)}),
    ("tree-b2-l3", "tree", 2, 0.05, {"turns": (4, 8)}),
]
QUICK_WORKLOADS = [("group-G8-quick", "group", 1, 0.02, {"group_size": 8, "turns": (2, 3)})]


def _step_time(executor, plan, optimizer) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one step."""
    from trainer.executor import train_step

    w0, c0 = time.perf_counter(), time.process_time()
    train_step(executor, plan, optimizer)
    return time.perf_counter() - w0, time.process_time() - c0


def bench_workload(name: str, scheme: str, tasks: int, scale: float, knobs: dict, *, reps: int, chunk_size: int,
                   microbatch_tokens: int, model_name: str = "tiny", seed: int = 0) -> dict:
    from benchmarks.workloads import generate
    from planner_service.ingest import forest_from_json
    from planner_service.planner import PlanConfig, plan_step
    from trainer.executor import Executor, ExecutorConfig
    from trainer.flops import plan_flops
    from trainer.models import build_model
    from trainer.optim import make_optimizer

    forest = forest_from_json(generate(scheme, tasks, seed, scale, **knobs))
    longest = int(forest.traj_length().max())
    B = max(microbatch_tokens, longest)
    common = dict(chunk_size=chunk_size, microbatch_tokens=B, windows=False)
    tree_plan = plan_step(forest, PlanConfig(**common))
    flat_plan = plan_step(forest, PlanConfig(sharing=False, **common))
    st = tree_plan.header.stats
    log.info("%s: %d trajectories, %d expanded / %d distinct tokens (ideal %.2fx), %d computed rows, %d + %d microbatches",
             name, forest.num_trajectories, st.expanded_tokens, st.unique_tokens, st.compression_ideal,
             st.computed_tokens, st.microbatches, flat_plan.header.stats.microbatches)
    base = build_model(model_name, seed=seed)
    runs = {}
    for label, plan in (("tree", tree_plan), ("expanded", flat_plan)):
        model = copy.deepcopy(base)
        opt = make_optimizer(model.parameters(), lr=1e-4)
        runs[label] = (Executor(model, ExecutorConfig(chunk_size=chunk_size)), plan, opt)
    times = {"tree": [], "expanded": []}
    cpu = {"tree": [], "expanded": []}
    for label, (ex, plan, opt) in runs.items():  # warm-up: first-call allocations, kernel paths
        _step_time(ex, plan, opt)
    for r in range(reps):
        for label, (ex, plan, opt) in runs.items():
            wall, cpu_s = _step_time(ex, plan, opt)
            times[label].append(wall)
            cpu[label].append(cpu_s)
        log.info("%s: rep %d/%d tree %.3f s, expanded %.3f s", name, r + 1, reps, times["tree"][-1], times["expanded"][-1])
    t_tree, t_flat = statistics.median(times["tree"]), statistics.median(times["expanded"])
    c_tree, c_flat = statistics.median(cpu["tree"]), statistics.median(cpu["expanded"])
    N_e = int(st.expanded_tokens)
    speedup = c_flat / c_tree
    cfg = runs["tree"][0].model.config
    flop_compression = (plan_flops(flat_plan, cfg, chunk_size=chunk_size).total
                        / plan_flops(tree_plan, cfg, chunk_size=chunk_size).total)
    return {
        "workload": name, "scheme": scheme, "trajectories": forest.num_trajectories,
        "expanded_tokens": N_e, "unique_tokens": int(st.unique_tokens), "computed_tokens": int(st.computed_tokens),
        "replay_tokens": int(st.replay_tokens), "duplicated_tokens": int(st.duplicated_tokens),
        "compression_ideal": float(st.compression_ideal), "compression_achieved": float(st.compression_achieved),
        "microbatch_tokens": B, "chunk_size": chunk_size, "microbatches_tree": int(st.microbatches),
        "microbatches_expanded": int(flat_plan.header.stats.microbatches),
        "step_seconds_tree": t_tree, "step_seconds_expanded": t_flat,
        "step_cpu_seconds_tree": c_tree, "step_cpu_seconds_expanded": c_flat,
        "tokens_per_s_tree": N_e / t_tree, "tokens_per_s_expanded": N_e / t_flat,
        "tokens_per_cpu_s_tree": N_e / c_tree, "tokens_per_cpu_s_expanded": N_e / c_flat,
        "flop_compression": flop_compression,
        "speedup_wall": t_flat / t_tree, "speedup": speedup, "fraction_of_ideal": speedup / flop_compression,
        "fraction_of_token_compression": speedup / float(st.compression_ideal), "reps": reps,
    }


def run(quick: bool = False, threads: int = 1) -> dict:
    """Benchmark every workload; returns {"workloads": [...], "settings": {...}}.

    Args:
        quick: one small workload and one timed step (for tests of the suite).
        threads: torch intra-op threads (0: torch's default). 1, as in the headline benchmark:
            CPU seconds then count work, not OpenMP workers spinning between small operators.
    """
    from benchmarks.allocator import steady_allocator

    steady_allocator()
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        workloads = QUICK_WORKLOADS if quick else WORKLOADS
        reps = 1 if quick else 5
        chunk_size, budget = 64, 4096
        results = []
        for i, (name, scheme, tasks, scale, knobs) in enumerate(workloads):
            log.info("[%d/%d] %s", i + 1, len(workloads), name)
            results.append(bench_workload(name, scheme, tasks, scale, knobs, reps=reps, chunk_size=chunk_size,
                                          microbatch_tokens=budget))
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)  # the suite runs the other benchmarks in this process
    return {
        "workloads": results,
        "settings": {"model": "tiny (debugmodel: 4 layers, 8 experts top-2, fp32)", "chunk_size": chunk_size,
                     "microbatch_tokens": budget, "threads": used, "quick": quick,
                     "target_fraction_of_ideal": 0.8},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small workload, one timed step")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0: torch's default)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    print(json.dumps(run(quick=args.quick, threads=args.threads), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
