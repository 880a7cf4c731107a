"""Trainer benchmark: sharing windows, no windows, expanded, and transformers on the same weights.

Run: `.venv/bin/python -m benchmarks.bench_trainer [--quick] [--steps N] [--modes M,...] [--out DIR]`
(progress on stderr, one JSON object on stdout; with --out also `trainer.md` and `trainer.json`).
A benchmark, not a timed test; `harts bench --only trainer` runs it inside the suite.

Percall and tree workloads at scale 0.05, C = 16, B = 2,048, the `small` model: expanded tokens
per CPU second of each mode against the FLOP ideal, and peak saved-for-backward bytes against the
planner's estimate. The modes and figures: benchmarks/README.md ("Sharing windows").
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.allocator import steady_allocator
from benchmarks.peer import SavedTensorBytes, TransformersPeer
from harts_client.synthetic import generate
from harts_client.timing import repeat
from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from trainer.executor import Executor, ExecutorConfig, train_step
from trainer.flops import plan_flops
from trainer.models import build_model
from trainer.optim import make_optimizer

log = logging.getLogger("bench_trainer")

#: (name, generator settings) of the full run.
WORKLOADS = [
    ("percall", dict(scheme="percall", tasks=1, seed=1, scale=0.05)),
    ("tree", dict(scheme="tree", tasks=2, seed=1, scale=0.05)),
]
QUICK_WORKLOADS = [("tree-quick", dict(scheme="tree", tasks=1, seed=1, scale=0.01, turns=(4, 6)))]
MODES = ("windows", "no_windows", "expanded", "transformers", "windows_logprobs", "expanded_logprobs",
         "transformers_logprobs")


def subset_trajectories(doc: dict, max_tokens: int, seed: int) -> dict:
    """`doc` with a seeded random subset of its trajectories of about `max_tokens` expanded tokens."""
    trajs = doc["trajectories"]
    if sum(len(t["tokens"]) for t in trajs) <= max_tokens:
        return doc
    order = np.random.default_rng(seed).permutation(len(trajs))
    keep, n = [], 0
    for i in order.tolist():
        if n >= max_tokens:
            break
        keep.append(trajs[i])
        n += len(trajs[i]["tokens"])
    return {**doc, "batch_id": doc["batch_id"] + "-subset", "trajectories": keep}


def _timed_steps(step, steps: int) -> tuple[float, float, int]:
    """(fastest CPU seconds, its wall seconds, peak saved bytes) of `steps` calls after a warm-up."""
    peaks: list[int] = []
    best = repeat(lambda: peaks.append(step()), steps, warmup=1).fastest("cpu")
    return best.cpu, best.wall, max(peaks)


def bench_workload(name: str, gen: dict, *, steps: int, chunk_size: int, microbatch_tokens: int, model_name: str,
                   max_baseline_tokens: int, modes: tuple[str, ...] = MODES) -> dict:
    """Plan one workload, time every mode of `modes` on the same model (benchmarks/README.md, "Sharing windows"); its row."""
    doc = generate(**gen, vocab_size=256)
    forest = forest_from_json(doc)
    sub_doc = subset_trajectories(doc, max_baseline_tokens, seed=7)
    sub = forest if sub_doc is doc else forest_from_json(sub_doc)
    model = build_model(model_name, seed=0)
    plans, ideal = _plans(forest, sub, model.config, chunk_size, microbatch_tokens)
    row = _workload_row(name, gen, forest, sub, plans, ideal, chunk_size, microbatch_tokens)
    log.info("%s: %d trajectories, %d expanded / %d distinct tokens, ideal %.2fx (FLOPs %.2fx); %d microbatches, "
             "%d windows; baselines on %d tokens", name, row["trajectories"], row["expanded_tokens"],
             row["unique_tokens"], row["compression_ideal"], ideal, row["microbatches"], row["windows"],
             row["baseline_tokens"])
    ex = Executor(model, ExecutorConfig(chunk_size=chunk_size))
    opt = make_optimizer(model.parameters(), lr=1e-5)
    trajs = [t["tokens"] for t in sub_doc["trajectories"]]
    masks = [t["loss_mask"] if "loss_mask" in t else [1] * len(t["tokens"]) for t in sub_doc["trajectories"]]
    peer = TransformersPeer.from_model(model) if any(m.startswith("transformers") for m in modes) else None
    for mode in modes:
        kind, forward_only = mode.removesuffix("_logprobs"), mode.endswith("_logprobs")
        tokens = row["baseline_tokens"] if kind in ("expanded", "transformers") else row["expanded_tokens"]
        if kind == "transformers":
            step = _peer_step(peer, trajs, masks, forward_only)
        else:
            step = _executor_step(ex, opt, model, plans[kind], forward_only)
        cpu, wall, peak = _timed_steps(step, steps)
        row[f"{mode}_cpu_seconds"], row[f"{mode}_wall_seconds"] = cpu, wall
        row[f"{mode}_tokens_per_cpu_s"] = tokens / cpu
        if not forward_only:
            row[f"{mode}_peak_saved_bytes"] = peak
        log.info("%s: %s %.1f CPU s (%.1f wall), %.0f expanded tokens/CPU-s, peak saved %.0f MB", name, mode, cpu, wall,
                 tokens / cpu, peak / 1e6)
    del peer, step
    _add_ratios(row, ideal, sub_doc)
    return row


def _plans(forest, sub, mcfg, chunk_size: int, microbatch_tokens: int) -> tuple[dict, float]:
    """The windows, no-windows and expanded (on `sub`) plans, and the FLOP compression of the
    windowed plan against the whole batch expanded."""
    common = dict(chunk_size=chunk_size, conv_kernel=mcfg.linear_conv_kernel_dim, model_config=mcfg.to_hf_dict())
    longest = int(forest.traj_length().max())
    plans = {
        "windows": plan_step(forest, PlanConfig(microbatch_tokens=microbatch_tokens, **common)),
        "no_windows": plan_step(forest, PlanConfig(microbatch_tokens=max(microbatch_tokens, longest), windows=False, **common)),
        "expanded": plan_step(sub, PlanConfig(microbatch_tokens=max(microbatch_tokens, int(sub.traj_length().max())),
                                              sharing=False, windows=False, **common)),
    }
    full_expanded = plan_step(forest, PlanConfig(microbatch_tokens=max(microbatch_tokens, longest), sharing=False,
                                                 windows=False, **common))
    ideal = plan_flops(full_expanded, mcfg, chunk_size=chunk_size).total / plan_flops(plans["windows"], mcfg, chunk_size=chunk_size).total
    return plans, ideal


def _workload_row(name: str, gen: dict, forest, sub, plans: dict, ideal: float, chunk_size: int,
                  microbatch_tokens: int) -> dict:
    """The workload's sizes and its windowed plan's statistics."""
    st = plans["windows"].header.stats
    longest = int(forest.traj_length().max())
    return {
        "workload": name, "generator": gen, "trajectories": forest.num_trajectories,
        "expanded_tokens": int(forest.expanded_tokens), "unique_tokens": int(forest.unique_tokens),
        "longest_trajectory": longest, "baseline_tokens": int(sub.expanded_tokens),
        "baseline_trajectories": sub.num_trajectories, "microbatch_tokens": microbatch_tokens,
        "no_windows_microbatch_tokens": max(microbatch_tokens, longest), "chunk_size": chunk_size,
        "compression_ideal": float(st.compression_ideal), "compression_achieved": float(st.compression_achieved),
        "flop_compression": ideal, "microbatches": int(st.microbatches), "windows": int(st.windows),
        "recomputed": sum(mb.recompute for r in plans["windows"].ranks for mb in r.microbatches),
        "peak_live_tokens_estimate": int(st.peak_live_tokens), "peak_live_bytes_estimate": int(st.peak_live_bytes),
        "no_windows_compression_achieved": float(plans["no_windows"].header.stats.compression_achieved),
    }


def _peer_step(peer, trajs: list, masks: list, forward_only: bool):
    """One transformers step (forward only: log-probs); returns the peak bytes saved for backward."""
    def step():
        if forward_only:
            peer.logprobs(trajs)
            return 0
        return peer.train_step(trajs, masks)[2]
    return step


def _executor_step(ex, opt, model, plan, forward_only: bool):
    """One executor step of `plan` (forward only: no graph); returns the peak bytes saved for backward."""
    def step():
        if forward_only:
            ex.run_step(plan, backward=False)
            return 0
        with SavedTensorBytes(model) as gauge:
            train_step(ex, plan, opt)
        return gauge.peak
    return step


def _add_ratios(row: dict, ideal: float, sub_doc: dict) -> None:
    """The modes' throughput ratios, and memory per live row against the planner's estimate."""
    r = lambda a, b: row.get(f"{a}_tokens_per_cpu_s", float("nan")) / row.get(f"{b}_tokens_per_cpu_s", float("nan"))  # noqa: E731
    row["windows_vs_expanded"] = r("windows", "expanded")
    row["fraction_of_ideal"] = row["windows_vs_expanded"] / ideal
    row["windows_vs_no_windows"] = r("windows", "no_windows")
    row["windows_vs_transformers"] = r("windows", "transformers")
    row["expanded_vs_transformers"] = r("expanded", "transformers")
    row["windows_vs_ideal_transformers"] = row["windows_vs_transformers"] / ideal
    row["logprobs_windows_vs_transformers"] = r("windows_logprobs", "transformers_logprobs")
    row["logprobs_expanded_vs_transformers"] = r("expanded_logprobs", "transformers_logprobs")
    if "windows_peak_saved_bytes" in row:
        row["windows_saved_bytes_per_live_row"] = row["windows_peak_saved_bytes"] / max(row["peak_live_tokens_estimate"], 1)
        row["estimate_vs_measured"] = row["peak_live_bytes_estimate"] / max(row["windows_peak_saved_bytes"], 1)
    if "transformers_peak_saved_bytes" in row:
        longest_sub = max(len(t["tokens"]) for t in sub_doc["trajectories"])
        row["transformers_saved_bytes_per_row"] = row["transformers_peak_saved_bytes"] / longest_sub


def run(quick: bool = False, threads: int = 1, steps: int | None = None, modes: tuple[str, ...] = MODES) -> dict:
    """Benchmark every workload; returns {"workloads": [...], "settings": {...}}."""
    steady_allocator()
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    settings = dict(model="tiny" if quick else "small", chunk_size=16, microbatch_tokens=256 if quick else 2048,
                    max_baseline_tokens=4000 if quick else 45000, steps=steps or (1 if quick else 2))
    try:
        torch.manual_seed(0)
        rows = []
        for i, (name, gen) in enumerate(QUICK_WORKLOADS if quick else WORKLOADS):
            log.info("[%d/%d] %s", i + 1, len(QUICK_WORKLOADS if quick else WORKLOADS), name)
            rows.append(bench_workload(name, gen, steps=settings["steps"], chunk_size=settings["chunk_size"],
                                       microbatch_tokens=settings["microbatch_tokens"], model_name=settings["model"],
                                       max_baseline_tokens=settings["max_baseline_tokens"], modes=modes))
        settings["threads"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)  # the suite runs the other benchmarks in this process
    return {"workloads": rows, "settings": settings}


COLUMNS = (
    ("workload", "workload"), ("expanded_tokens", "expanded tokens"), ("flop_compression", "ideal (FLOP compression)"),
    ("windows", "windows"), ("windows_tokens_per_cpu_s", "windows tok/CPU-s"),
    ("no_windows_tokens_per_cpu_s", "no windows tok/CPU-s"), ("expanded_tokens_per_cpu_s", "expanded tok/CPU-s"),
    ("transformers_tokens_per_cpu_s", "transformers tok/CPU-s"), ("windows_vs_expanded", "windows / expanded"),
    ("fraction_of_ideal", "fraction of ideal"), ("windows_vs_transformers", "windows / transformers"),
    ("expanded_vs_transformers", "expanded / transformers"), ("windows_vs_no_windows", "windows / no windows"),
)
LOGPROB_COLUMNS = (
    ("workload", "workload"), ("windows_logprobs_tokens_per_cpu_s", "windows tok/CPU-s"),
    ("expanded_logprobs_tokens_per_cpu_s", "expanded tok/CPU-s"),
    ("transformers_logprobs_tokens_per_cpu_s", "transformers tok/CPU-s"),
    ("logprobs_windows_vs_transformers", "windows / transformers"),
    ("logprobs_expanded_vs_transformers", "expanded / transformers"),
)
MEMORY_COLUMNS = (
    ("workload", "workload"), ("windows_peak_saved_bytes", "windows peak saved (MB)"),
    ("no_windows_peak_saved_bytes", "no windows (MB)"), ("expanded_peak_saved_bytes", "expanded (MB)"),
    ("transformers_peak_saved_bytes", "transformers, one trajectory (MB)"),
    ("peak_live_bytes_estimate", "planner estimate, windows (MB)"), ("estimate_vs_measured", "estimate / measured"),
    ("windows_saved_bytes_per_live_row", "windows KB / live row"), ("transformers_saved_bytes_per_row", "transformers KB / row"),
)


def _cell(key: str, v) -> str:
    if v == "":
        return "-"
    if key.endswith("_per_row") or key.endswith("_per_live_row"):
        return f"{v / 1e3:,.0f}"
    if "bytes" in key:
        return f"{v / 1e6:,.0f}"
    if isinstance(v, float):
        return f"{v:,.0f}" if v >= 100 else f"{v:.2f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def result_markdown(result: dict) -> str:
    rows = result["workloads"]
    out = ["# Trainer: sharing windows vs no windows vs expanded vs transformers", "",
           "Command: `.venv/bin/python -m benchmarks.bench_trainer --out benchmarks/results` "
           f"(settings: {json.dumps(result['settings'])}).", ""]
    for title, cols in (("Step (forward + backward + AdamW)", COLUMNS), ("Memory", MEMORY_COLUMNS),
                        ("Forward only (log-probs, `harts logprobs`)", LOGPROB_COLUMNS)):
        out += [f"## {title}", ""]
        out.append("| " + " | ".join(h for _, h in cols) + " |")
        out.append("|" + "---|" * len(cols))
        for r in rows:
            out.append("| " + " | ".join(_cell(k, r.get(k, "")) for k, _ in cols) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small workload, one timed step")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0: torch's default)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per mode after one warm-up (default 2)")
    parser.add_argument("--out", default=None, help="write trainer.md and trainer.json into this folder")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)} (default all)")
    args = parser.parse_args(argv)
    modes = tuple(m for m in args.modes.split(",") if m)
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"--modes: unknown {', '.join(unknown)}; expected some of {', '.join(MODES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    result = run(quick=args.quick, threads=args.threads, steps=args.steps, modes=modes)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "trainer.json").write_text(json.dumps(result, indent=1))
        (out / "trainer.md").write_text(result_markdown(result))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
