"""Trainer client: fetch this rank's plan slices from the planner service and train (DESIGN §5.7).

    harts train --planner-url http://127.0.0.1:8000 --steps 3 --model tiny --chunk-size 16
    harts train --nproc-per-node 2 --planner-url http://127.0.0.1:8000 --steps 3 --checkpoint-dir ckpt

The same flags as `python -m trainer.train` (see its docstring). Without `--nproc-per-node` (or
under torchrun) it trains in this process; `--nproc-per-node N` with N > 1 launches
`torchrun --standalone --nproc_per_node=N -m trainer.train ...` and returns its exit status.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trainer.train import add_arguments as add_train_arguments

    add_train_arguments(parser)
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="N > 1: launch torchrun with N local ranks (on one node) instead of training here")


def train_argv(args: argparse.Namespace) -> list[str]:
    """`trainer.train` arguments equivalent to the parsed `harts train` arguments."""
    argv = ["--planner-url", args.planner_url, "--steps", str(args.steps), "--model", args.model,
            "--seed", str(args.seed), "--lr", repr(args.lr), "--weight-decay", repr(args.weight_decay),
            "--max-grad-norm", repr(args.max_grad_norm), "--backend", args.backend,
            "--chunk-size", str(args.chunk_size), "--checkpoint-every", str(args.checkpoint_every),
            "--plan-timeout", repr(args.plan_timeout), "--ready-timeout", repr(args.ready_timeout)]
    argv += ["--step-ids", args.step_ids] if args.step_ids else ["--step-prefix", args.step_prefix]
    for flag, value in (("--checkpoint-dir", args.checkpoint_dir), ("--metrics-jsonl", args.metrics_jsonl)):
        if value:
            argv += [flag, value]
    if args.resume:
        argv.append("--resume")
    return argv


def run(args: argparse.Namespace) -> int:
    from trainer.train import run as run_train, torchrun_command

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node: expected >= 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        # The token travels in the environment, not on the command line (ps would show it).
        env = {**os.environ, **({"HARTS_TOKEN": args.token} if args.token else {})}
        return subprocess.call(torchrun_command(train_argv(args), args.nproc_per_node), env=env, stdout=sys.stdout)
    return run_train(args)
