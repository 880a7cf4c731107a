"""End-to-end demo on the CPU: synthetic agentic rollouts -> planner -> exact tree training.

    harts demo                                   # what `make demo` runs (about a minute on 2 cores)
    harts demo --steps 6 --scheme group --tasks 3 --out demo-out

Each step submits a synthetic batch to an in-process planner core (SQLite, `OUT/planner.db`),
fetches rank 0's sealed slice and trains the tiny model on it with sharing windows (the trees are
larger than B = 1,024); at the end the last batch runs as a tree and trajectory-expanded on the
same weights: identical log-probs and gradients (Invariant E, docs/design/rollout-forest.md).
Per-step metrics go to stderr and `OUT/metrics.jsonl`; prints one JSON summary on stdout.
"""
from __future__ import annotations

import argparse
import json
import logging
import pathlib

log = logging.getLogger("harts.demo")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=4, help="training steps (one rollout batch each)")
    parser.add_argument("--scheme", default="tree", choices=["group", "tree", "percall"], help="rollout sampling scheme (see harts gen)")
    parser.add_argument("--tasks", type=int, default=2, help="tasks (rollout trees) per batch")
    parser.add_argument("--scale", type=float, default=0.02, help="length scale of the synthetic rollouts (1.0 = published agent lengths)")
    parser.add_argument("--model", default="tiny", help="named config (tiny, tiny-dense, tiny-deep, small) or a Qwen3-Next checkpoint directory")
    parser.add_argument("--chunk-size", type=int, default=16, help="linear-attention chunk size C")
    parser.add_argument("--microbatch-tokens", type=int, default=1024,
                        help="token budget B per microbatch (below the trees' sizes: sharing windows)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the rollouts")
    parser.add_argument("--out", default="demo-out", help="folder for planner.db and metrics.jsonl (recreated)")
    parser.add_argument("--no-verify", action="store_true", help="skip the final tree-vs-expanded comparison")


def run(args: argparse.Namespace) -> int:
    import torch

    from harts_client.synthetic import generate
    from harts_client.timing import timed
    from planner_service.core import PlannerCore, ServiceConfig
    from proto.harts.v1 import planner_pb2
    from plan.seal import open_sealed
    from trainer.executor import Executor, ExecutorConfig, train_step
    from trainer.models import build_model
    from trainer.optim import make_optimizer

    if args.steps < 1:
        raise ValueError(f"--steps: expected >= 1, got {args.steps}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("planner.db", "planner.db-wal", "planner.db-shm", "metrics.jsonl"):
        (out / stale).unlink(missing_ok=True)

    torch.manual_seed(args.seed)
    model = build_model(args.model, seed=args.seed)
    vocab = model.config.vocab_size
    topology = planner_pb2.Topology(world_size=1, microbatch_tokens=args.microbatch_tokens, chunk_size=args.chunk_size,
                                    model=json.dumps(model.config.to_hf_dict()))  # the memory model of this model
    log.info("planner: in-process core, SQLite at %s; compiling the Numba planner", out / "planner.db")
    core = PlannerCore(ServiceConfig(db_path=str(out / "planner.db"), conv_kernel=model.config.linear_conv_kernel_dim))
    core.start()
    executor = Executor(model, ExecutorConfig(chunk_size=args.chunk_size))
    optimizer = make_optimizer(model.parameters(), lr=args.lr)
    log.info("model %s: %.2fM parameters, %d layers (%s)", args.model, sum(p.numel() for p in model.parameters()) / 1e6,
             model.config.num_hidden_layers, ", ".join(model.config.layer_types))

    history = []
    doc = None
    try:
        with open(out / "metrics.jsonl", "w") as metrics:
            for step in range(args.steps):
                doc = generate(args.scheme, args.tasks, seed=args.seed + step, scale=args.scale, vocab_size=vocab)
                step_id = doc["batch_id"] = f"demo-{args.scheme}-{step}"
                core.submit(json.dumps(doc).encode(), "json")
                status = core.plan(step_id, topology)
                plan_slice = open_sealed(core.fetch(step_id, 0))
                res, seconds = timed(train_step, executor, plan_slice, optimizer)
                stats = status.stats
                row = {
                    "step": step, "loss": res.loss, "trajectories": len(doc["trajectories"]),
                    "expanded_tokens": res.expanded_tokens, "computed_tokens": res.computed_tokens,
                    "compression_ideal": round(stats.compression_ideal, 3),
                    "compression_achieved": round(stats.compression_achieved, 3),
                    "microbatches": res.microbatches, "windows": res.windows,
                    "recomputed_microbatches": res.recomputed_microbatches,
                    "linear_attention_calls": stats.linear_attention_calls,
                    "plan_seconds": round(stats.plan_seconds, 4), "train_seconds": round(seconds, 3),
                    "expanded_tokens_per_second": round(res.expanded_tokens / seconds, 1),
                }
                history.append(row)
                metrics.write(json.dumps(row) + "\n")
                log.info("step %d/%d: loss %+.4f | %d trajectories, %d expanded -> %d computed tokens (%.2fx, ideal %.2fx) "
                         "| %d microbatches, %d windows | %d calls | plan %.3fs, train %.2fs, %.0f expanded tok/s",
                         step + 1, args.steps, row["loss"], row["trajectories"], row["expanded_tokens"], row["computed_tokens"],
                         row["compression_achieved"], row["compression_ideal"], row["microbatches"], row["windows"],
                         row["linear_attention_calls"],
                         row["plan_seconds"], seconds, row["expanded_tokens_per_second"])
    finally:
        core.close()

    summary = {"steps": history, "metrics": str(out / "metrics.jsonl")}
    if not args.no_verify:
        summary["invariant_e"] = _compare_tree_and_expanded(doc, model, args)
    print(json.dumps(summary))
    return 0


def _compare_tree_and_expanded(doc: dict, model, args: argparse.Namespace) -> dict:
    """Run the last batch as a tree plan and as the trajectory-expanded plan on the same weights."""
    from planner_service.ingest import forest_from_json
    from planner_service.planner import PlanConfig, plan_step
    from trainer.executor import Executor, ExecutorConfig
    from trainer.verify import compare_runs, run_and_capture

    forest = forest_from_json(doc)
    common = dict(chunk_size=args.chunk_size, conv_kernel=model.config.linear_conv_kernel_dim, all_positions=True,
                  model_config=model.config.to_hf_dict())
    longest = int(forest.traj_length().max())
    executor = Executor(model, ExecutorConfig(chunk_size=args.chunk_size, want_logprobs=True, capture_linear=True))
    log.info("Invariant E: running the last batch trajectory-expanded and as a windowed tree on the same weights")
    expanded, g_expanded = run_and_capture(executor, plan_step(forest, PlanConfig(
        sharing=False, windows=False, microbatch_tokens=max(args.microbatch_tokens, longest), **common)))
    tree, g_tree = run_and_capture(executor, plan_step(forest, PlanConfig(microbatch_tokens=args.microbatch_tokens, **common)))
    rep = compare_runs(expanded, g_expanded, tree, g_tree)
    out = {
        "logprob_max_abs_diff": rep["logprob_max_abs_diff"],
        "linear_outputs_bitwise_equal": rep["linear_outputs_bitwise_equal"],
        "grad_rel_diff_max": rep["grad_rel_diff_max"],
        "expert_load_equal": rep["expert_load_equal"],
        "computed_tokens_expanded": expanded.computed_tokens,
        "computed_tokens_tree": tree.computed_tokens,
        "windows_tree": tree.windows,
        "seconds_expanded": round(expanded.seconds, 3),
        "seconds_tree": round(tree.seconds, 3),
    }
    log.info("Invariant E: max |d logprob| %.2g, linear-attention outputs bitwise equal: %s, max rel grad diff %.2g, "
             "expert loads equal: %s; computed tokens %d -> %d, step time %.2fs -> %.2fs",
             out["logprob_max_abs_diff"], out["linear_outputs_bitwise_equal"], out["grad_rel_diff_max"],
             out["expert_load_equal"], out["computed_tokens_expanded"], out["computed_tokens_tree"],
             out["seconds_expanded"], out["seconds_tree"])
    return out
