"""RL on the CPU: planner + generator + 2 trainer ranks, the reward rising on a verifiable multi-turn task.

    harts rl --config examples/rl_tiny.toml                    # what `make rl` runs
    harts rl --config examples/rl_tiny.toml --steps 10 --out runs/short
    harts rl --config examples/rl_tiny.toml --no-sharing --replay runs/rl_tiny --out runs/rl_tiny-expanded
    harts rl --config examples/rl_swe.toml                     # the agentic coding environment
    harts rl --config examples/rl_plugin.toml                  # a plugin task on a JSONL dataset
    harts -v rl --config ...                                   # debug logs, libraries' progress bars

Prints the run's summary as one JSON object on stdout. What a run does and writes:
docs/design/training-loop.md ("`harts rl`"); tasks, data and engines: README.md ("Using it").
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="RL config (TOML; see examples/rl_tiny.toml, every field documented)")
    p.add_argument("--out", default=None, help="output folder (run.out; recreated)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (run.steps)")
    p.add_argument("--seed", type=int, default=None, help="seed of the model, the warm start, the tasks and the sampling (run.seed)")
    p.add_argument("--nproc", type=int, default=None, help="trainer ranks (run.nproc)")
    p.add_argument("--no-sharing", action="store_true", help="plan the trajectory-expanded baseline instead of trees")
    p.add_argument("--replay", type=Path, default=None, metavar="DIR",
                   help="train on the rollouts recorded in DIR (a harts rl run) instead of generating, and compare")


def run(args: argparse.Namespace) -> int:
    from harts_cli.rl.run import RLError, quiet_libraries, run_rl
    from trainer.rl.config import load_rl_config

    if not getattr(args, "verbose", False):
        quiet_libraries()

    out = args.out
    if out is None and args.replay is not None:
        out = f"{str(args.replay).rstrip('/')}-{'expanded' if args.no_sharing else 'replay'}"
    cfg = load_rl_config(args.config, out=out, steps=args.steps, seed=args.seed, nproc=args.nproc)
    if args.no_sharing:
        cfg.plan.no_sharing = True
    try:
        summary = run_rl(cfg, replay=args.replay)
    except RLError as exc:
        raise ValueError(str(exc)) from None
    print(json.dumps(summary))
    return 0
