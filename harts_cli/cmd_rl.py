"""RL on the CPU: planner + generator + 2 trainer ranks, the reward rising on a verifiable multi-turn task.

    harts rl --config examples/rl_tiny.toml                    # what `make rl` runs
    harts rl --config examples/rl_tiny.toml --steps 10 --out runs/short
    harts rl --config examples/rl_tiny.toml --no-sharing --replay runs/rl_tiny --out runs/rl_tiny-expanded
    harts rl --config examples/rl_swe.toml                     # the agentic coding environment
    harts rl --config examples/rl_plugin.toml                  # a plugin task on a JSONL dataset
    harts -v rl --config ...                                   # debug logs, libraries' progress bars

A live run warm-starts the policy on the task's demonstrations, starts the planner (`harts serve`,
SQLite in OUT), the trainer ranks (torchrun, FSDP2 on gloo) and the generator (the transformers
engine on the newest export: every step's weights come back to it; with run.max_staleness = 1 it
samples step n + 1 while step n trains). Each step plays the task as trees that branch at turn
boundaries, submits them as explicit trees with the policy's log-probs and GRPO advantages, and
records them. OUT gets metrics.jsonl (reward_mean, reward_std, compression,
expanded_tokens_per_s, eval_reward, the trainer's metrics), tb/ (TensorBoard), rl.png, the
exports, the recorded rollouts and summary.json (reward of the first and last 10 steps, wall time).
The task is a shipped one or a plugin ("package.module:Class"), its instances generated or read
from a dataset (`[data]`); a model directory with a chat template renders the conversations with
it. Without -v, transformers' progress bars and advisory warnings stay off.
`--replay DIR` trains DIR's warm start on DIR's recorded rollouts instead of generating
(`--no-sharing`: trajectory-expanded plans) and compares loss and grad norm per step with DIR,
trained on its own and on DIR's weights of every step (`harts_cli.rl.anchored`; replay.json,
replay.png). Prints the summary as one JSON object on stdout.
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
