"""Generate synthetic agentic rollouts (group, tree or per-call sampling) as a JSON input document.

Run: `harts gen --scheme tree --tasks 4 --seed 0 --scale 0.05 -o rollouts.json`. The document goes
to OUT (`-`: stdout); a one-line JSON summary (trajectories, unique/expanded tokens, ideal
compression) goes to stdout when OUT is a file, to stderr otherwise.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

log = logging.getLogger(__name__)

EPILOG = """\
schemes (one rollout tree per task; tree_id = task id):
  group    GRPO group sampling: G rollouts per task share the system+tools prompt and the task
           statement and branch at the first action; each rollout is a multi-turn episode.
  tree     tree sampling at turn boundaries: a rollout branches K ways after a sampled turn,
           LEVELS times, so branch depths fall at arbitrary positions relative to chunk boundaries.
  percall  one sample per model call of a reasoning agent whose history drops earlier reasoning:
           the spine (prompt, actions, observations) with each call's reasoning+action as a leaf,
           a caterpillar tree per rollout. The loss mask is 1 on the call's own output only.

lengths (full scale; --scale multiplies every token length, not turn counts): system+tools prompt
2-6k (one sequence shared by all tasks, but trees are per task, so it merges within a task only),
task statement 0.5-2k, 10-100 turns, actions 20-1,500, observations 100-4,000, reasoning 50-2,000
(percall). Log-normal draws clipped to each range. The loss mask is 1 on actions only (percall: on
the call's reasoning and action). Advantage = Bernoulli reward - the task's mean reward (GRPO)."""


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (two integers), got {text!r}") from None
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("--scheme", required=True, choices=("group", "tree", "percall"), help="sampling scheme (see below)")
    p.add_argument("--tasks", type=int, required=True, help="number of tasks (one tree each)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    p.add_argument("--scale", type=float, default=1.0, help="multiplier of every token length, e.g. 0.02 for CPU runs (default 1)")
    p.add_argument("-o", "--output", default="-", help="output JSON file, '-' for stdout (default)")
    p.add_argument("--form", choices=("flat", "tree"), default="flat",
                   help="flat trajectories (default) or explicit trees (smaller: shared nodes written once)")
    p.add_argument("--vocab-size", type=int, default=256, help="token ids in [0, V) (default 256, the tiny model's)")
    p.add_argument("--group-size", type=int, default=None, help="rollouts per task: group (default 8), percall (default 4)")
    p.add_argument("--branching", type=int, default=2, help="tree: ways per branch point (default 2)")
    p.add_argument("--levels", type=int, default=3, help="tree: nested branch points per path (default 3)")
    p.add_argument("--max-tokens-per-trajectory", type=int, default=131072,
                   help="context limit at full scale, scaled with --scale; longer rollouts are truncated (default 131072)")
    p.add_argument("--old-logprobs", action="store_true", help="also emit synthetic rollout log-probs")
    p.add_argument("--batch-id", default="", help="batch id (default <scheme>-n<tasks>-s<seed>)")
    for name, default in (("turns", "10:100"), ("system-tokens", "2000:6000"), ("task-tokens", "500:2000"),
                          ("action-tokens", "20:1500"), ("observation-tokens", "100:4000"), ("reasoning-tokens", "50:2000")):
        p.add_argument(f"--{name}", type=_range, default=_range(default), metavar="LO:HI",
                       help=f"full-scale range (default {default})")


def run(args: argparse.Namespace) -> int:
    from harts_client.synthetic import WorkloadConfig, generate_workload
    from harts_client.timing import timed

    cfg = WorkloadConfig(
        scheme=args.scheme, tasks=args.tasks, seed=args.seed, scale=args.scale, vocab_size=args.vocab_size,
        group_size=args.group_size, branching=args.branching, levels=args.levels,
        system_tokens=args.system_tokens, task_tokens=args.task_tokens, turns=args.turns,
        action_tokens=args.action_tokens, observation_tokens=args.observation_tokens,
        reasoning_tokens=args.reasoning_tokens, max_tokens_per_trajectory=args.max_tokens_per_trajectory,
        old_logprobs=args.old_logprobs, batch_id=args.batch_id,
    )
    w, seconds = timed(generate_workload, cfg)
    stats = w.stats()
    log.info("gen: %d trajectories, %d expanded tokens generated in %.2f s; writing %s",
             stats["trajectories"], stats["expanded_tokens"], seconds, args.output)
    if args.output == "-":
        try:
            w.write_json(sys.stdout, args.form)
            sys.stdout.flush()
        except BrokenPipeError:  # `harts gen ... | head`: the reader left; not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        print(json.dumps(stats), file=sys.stderr)
    else:
        with open(args.output, "w") as fp:
            w.write_json(fp, args.form)
        stats["output"] = args.output
        print(json.dumps(stats))
    return 0
