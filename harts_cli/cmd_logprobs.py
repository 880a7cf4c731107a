"""Forward-only tree execution: per-trajectory log-probabilities of a rollout batch.

    harts logprobs rollouts.json --model tiny --seed 0 -o logprobs.json
    harts logprobs batch.pb --model /path/to/qwen3-next-checkpoint --chunk-size 64 -o out.json

Plans the batch with sharing and sharing windows on (a trajectory longer than the microbatch
budget spans several microbatches) and a log-prob entry for every position, runs it once without
gradients and writes `{trajectory_id: [logprob of positions 1..L-1]}` to OUT (a
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
    parser.add_argument("--microbatch-tokens", type=int, default=4096,
                        help="token budget B per microbatch (computed rows; longer trajectories span several "
                             "microbatches through sharing windows)")
    parser.add_argument("--memory-tokens", type=int, default=0,
                        help="live-activation budget M per rank for the stack of open windows (0: the planner's default)")
    parser.add_argument("--no-windows", action="store_true",
                        help="ablation: duplicate prefixes instead of sharing windows (B is raised to the longest "
                             "trajectory, which must then fit one microbatch)")
    parser.add_argument("--backend", default="auto", help="gated delta rule kernel backend: auto (ref on the CPU, triton on CUDA) | ref | triton")
    parser.add_argument("--attention-backend", default="auto",
                        help="tree-attention backend: auto (blocked on the CPU, triton on CUDA) | blocked | triton | ref")


def plan_config(args: argparse.Namespace, forest, model_config, **kw):
    """The tree plan's PlanConfig from the shared arguments (windows on unless --no-windows; the
    memory model of the model that runs it)."""
    from planner_service.planner import PlanConfig

    B = args.microbatch_tokens
    if args.no_windows and forest.num_trajectories:
        B = max(B, int(forest.traj_length().max()))
    M = args.memory_tokens if args.memory_tokens else 0
    return PlanConfig(chunk_size=args.chunk_size, microbatch_tokens=B, memory_tokens=max(M, B) if M else 0,
                      conv_kernel=model_config.linear_conv_kernel_dim, windows=not args.no_windows, all_positions=True,
                      model_config=model_config.to_hf_dict(), **kw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="output JSON: trajectory id -> log-probs of positions 1..L-1")


def run(args: argparse.Namespace) -> int:
    from planner_service.planner import plan_step
    from trainer.executor import Executor, ExecutorConfig
    from trainer.models import build_model

    forest = load_forest(args.input, args.format)
    model = build_model(args.model, seed=args.seed)
    plan = plan_step(forest, plan_config(args, forest, model.config))
    ex = Executor(model, ExecutorConfig(chunk_size=args.chunk_size, backend=args.backend,
                                        attention_backend=args.attention_backend, want_logprobs=True))
    res = ex.run_step(plan, backward=False)
    out = {tid: [float(x) for x in lp] for tid, lp in res.logprobs.items()}
    with open(args.output, "w") as fh:
        json.dump(out, fh)
    st = plan.header.stats
    summary = {"trajectories": len(out), "positions": int(sum(len(v) for v in out.values())),
               "expanded_tokens": int(st.expanded_tokens), "computed_tokens": res.computed_tokens,
               "microbatches": res.microbatches, "windows": res.windows, "seconds": round(res.seconds, 4),
               "output": args.output}
    log.info("log-probs of %d trajectories in %.3f s", len(out), res.seconds)
    print(json.dumps(summary))
    return 0
