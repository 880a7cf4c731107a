"""`harts` console script.

Each subcommand lives in `harts_cli/cmd_<name>.py` with two functions:
`add_arguments(parser)` (cheap: no torch/numba import at module level) and `run(args) -> int`.
Logs go to stderr; machine-readable results to stdout.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from planner_service.errors import HartsError

#: name -> one-line help. The module is harts_cli.cmd_<name>.
COMMANDS: dict[str, str] = {
    "tree": "build the prefix forest of a rollout batch and print its statistics",
    "plan": "plan a rollout batch for a trainer topology and print the plan report",
    "calibrate": "time the executor on synthetic microbatches and fit the planner's cost model",
    "serve": "run the planner service (HTTP + gRPC)",
    "logprobs": "forward-only tree execution: per-trajectory log-probabilities",
    "verify": "run tree and expanded plans on the same weights and compare them",
    "train": "trainer client: fetch plans from the service and train (run under torchrun)",
    "export": "export a training checkpoint as a Hugging Face directory for the generators",
    "gen": "generate synthetic agentic rollouts (group, tree or per-call sampling)",
    "bench": "run the benchmark suite and write benchmarks/results",
    "demo": "end-to-end demo: rollouts -> planner -> tree training on the CPU",
}


def _available() -> dict[str, object]:
    mods = {}
    for name in COMMANDS:
        try:
            mods[name] = importlib.import_module(f"harts_cli.cmd_{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"harts_cli.cmd_{name}":
                raise
    return mods


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    parser = argparse.ArgumentParser(prog="harts", description="HARTS: prefix-sharing RL training for hybrid-attention models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    mods = _available()
    for name, mod in mods.items():
        p = sub.add_parser(name, help=COMMANDS[name], description=(mod.__doc__ or COMMANDS[name]).strip().split("\n\n")[0])
        mod.add_arguments(p)
    return parser, mods


def main(argv: list[str] | None = None) -> int:
    parser, mods = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # one INFO line per HTTP request drowns the progress output
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(mods[args.command].run(args) or 0)
    except (HartsError, ValueError, FileNotFoundError) as exc:
        print(f"harts {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
