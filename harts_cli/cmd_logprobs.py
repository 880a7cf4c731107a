"""Forward-only tree execution: per-trajectory log-probabilities of a rollout batch.

    harts logprobs rollouts.json --model tiny --seed 0 -o logprobs.json
    harts logprobs batch.pb --model /path/to/qwen3-next-checkpoint --chunk-size 64 -o out.json

Plans the batch with sharing on, windows off and a log-prob entry for every position, runs it
once without gradients and writes `{trajectory_id: [logprob of positions 1..L-1]}` to OUT (a
trajectory of one token maps to []). Prints a one-line JSON summary on stdout.
"""
from __future__ import annotations

import argparse
import json
import logging

from harts_cli.inputs import add_input_arguments, load_forest

log = logging.getLogger(__name__)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments shared by `harts logprobs` and `harts verify`."""
    add_input_arguments(parser)
    parser.add_argument("--model", default="tiny", help="a named config (tiny, tiny-dense, tiny-deep, small; random weights) or a Hugging Face Qwen3-Next directory")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights of a named config")
    parser.add_argument("--chunk-size", type=int, default=64, help="linear-attention chunk size C of the kernel")
    parser.add_argument("--microbatch-tokens", type=int, default=0,
                        help="token budget B per microbatch (0: max(4096, longest trajectory), which every batch fits "
                             "without sharing windows)")
    parser.add_argument("--backend", default="ref", help="gated delta rule kernel backend (ref | triton)")


def microbatch_budget(requested: int, forest) -> int:
    """The budget B to plan with: `requested`, or with 0 the smallest default that fits every path."""
    if requested:
        return requested
    return max(4096, int(forest.traj_length().max()) if forest.num_trajectories else 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="output JSON: trajectory id -> log-probs of positions 1..L-1")


def run(args: argparse.Namespace) -> int:
    from planner_service.planner import PlanConfig, plan_step
    from trainer.executor import Executor, ExecutorConfig
    from trainer.models import build_model

    forest = load_forest(args.input, args.format)
    model = build_model(args.model, seed=args.seed)
    plan = plan_step(forest, PlanConfig(chunk_size=args.chunk_size, microbatch_tokens=microbatch_budget(args.microbatch_tokens, forest),
                                        conv_kernel=model.config.linear_conv_kernel_dim, windows=False, all_positions=True))
    ex = Executor(model, ExecutorConfig(chunk_size=args.chunk_size, backend=args.backend, want_logprobs=True))
    res = ex.run_step(plan, backward=False)
    out = {tid: [float(x) for x in lp] for tid, lp in res.logprobs.items()}
    with open(args.output, "w") as fh:
        json.dump(out, fh)
    st = plan.header.stats
    summary = {"trajectories": len(out), "positions": int(sum(len(v) for v in out.values())),
               "expanded_tokens": int(st.expanded_tokens), "computed_tokens": res.computed_tokens,
               "microbatches": res.microbatches, "seconds": round(res.seconds, 4), "output": args.output}
    log.info("log-probs of %d trajectories in %.3f s", len(out), res.seconds)
    print(json.dumps(summary))
    return 0
