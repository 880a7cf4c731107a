"""`harts` console script.

Each subcommand lives in `harts_cli/cmd_<name>.py` with two functions: `add_arguments(parser)`
and `run(args) -> int`; a command imports only its own module (`build_parser(only=...)`).
Logs go to stderr; machine-readable results to stdout.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
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
    "rl": "RL on a verifiable multi-turn task: planner + generator + trainer ranks, reward and compression per step",
}


def default_threads() -> int:
    """Intra-op threads for the compute commands: half the cores this process may run on, at most 8,
    at least 1 (a 2-core machine gets 1). Small CPU operators with a thread pool on a busy machine
    spend most of their time in OpenMP workers waiting for each other: `harts verify` took 16 min
    with torch's default pool on a loaded 2-core machine and 1.5 min with one thread."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def pin_threads(n: int | None) -> int:
    """Use `n` intra-op threads (None: $OMP_NUM_THREADS if set, else `default_threads()`); set
    before torch is imported, so that its thread pool starts at that size."""
    if n is None:
        env = os.environ.get("OMP_NUM_THREADS", "")
        n = int(env) if env.isdigit() and int(env) > 0 else default_threads()
    if n < 1:
        raise ValueError(f"--threads: expected >= 1, got {n}")
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    return n


def _load(name: str):
    """harts_cli.cmd_<name>, or None where it is not part of this installation."""
    try:
        return importlib.import_module(f"harts_cli.cmd_{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"harts_cli.cmd_{name}":
            raise
        return None


def build_parser(only: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The parser with every subcommand and their modules by name; `only`: just that subcommand's
    module is imported and its arguments added (the others stay listed), so that a command pays
    for no other command's imports (`harts plan`'s planner, `harts train`'s torch)."""
    parser = argparse.ArgumentParser(prog="harts", description="HARTS: prefix-sharing RL training for hybrid-attention models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: $OMP_NUM_THREADS, else half the usable cores, "
                             "at most 8, at least 1)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    mods = {}
    for name, help_ in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_)
            continue
        mod = _load(name)
        if mod is None:
            continue
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or help_).strip().split("\n\n")[0])
        mod.add_arguments(p)
        mods[name] = mod
    return parser, mods


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the first word naming a command is the command (no option of `harts` itself takes one as its value)
    parser, mods = build_parser(only=next((a for a in argv if a in COMMANDS), None))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # one INFO line per HTTP request drowns the progress output
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        pin_threads(args.threads)
        return int(mods[args.command].run(args) or 0)
    except (HartsError, ValueError, FileNotFoundError) as exc:
        print(f"harts {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
