"""Trainer client: fetch this rank's plan slices from the planner service and train.

    harts train --config examples/train_tiny_fsdp.toml
    harts train --nproc-per-node 2 --config examples/train_tiny_fsdp.toml --objective.clip_high 0.28
    harts train --planner-url http://127.0.0.1:8000 --steps 3 --model tiny --chunk-size 16

The same flags as `python -m trainer.train` (`--help`). Without `--nproc-per-node` (or under
torchrun) it trains in this process; `--nproc-per-node N` with N > 1 launches
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
    """`trainer.train` arguments equivalent to the parsed `harts train` arguments (the token stays out:
    it travels in the environment)."""
    argv: list[str] = []
    for dest, value in vars(args).items():
        if dest == "config":
            argv += ["--config", str(value)]
        elif "." in dest and dest != "planner.token":
            argv += [f"--{dest}", _text(value)]
    return argv


def _text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return "none" if value is None else str(value)


def run(args: argparse.Namespace) -> int:
    from trainer.train import run as run_train, torchrun_command

    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node: expected >= 1, got {args.nproc_per_node}")
    if args.nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        # The token travels in the environment, not on the command line (ps would show it).
        token = vars(args).get("planner.token")
        env = {**os.environ, **({"HARTS_TOKEN": token} if token else {})}
        return subprocess.call(torchrun_command(train_argv(args), args.nproc_per_node), env=env, stdout=sys.stdout)
    return run_train(args)
