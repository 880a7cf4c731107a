"""Run the benchmark suite and write benchmarks/results (summary.md, README-table.md, plots).

Run: `harts bench` (CPU scale, a few minutes), `harts bench --quick` (tiny inputs),
`harts bench --full` (planning only, full-scale workloads of tens of millions of expanded tokens),
`harts bench --only planner --only workloads`. Benchmarks whose module has not landed are
skipped and listed as such. Prints one JSON object on stdout: each benchmark's status and seconds,
and the files written; exits 1 when a benchmark failed.

This command is a runner apart from the benchmarks it runs: it starts `python -m benchmarks.suite`
(benchmarks/suite.py, whose `--help` is the reference for these options) as a subprocess with the
same arguments and never imports `benchmarks`, so that no product command depends on them.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

#: the suite's switches and options, forwarded as given (benchmarks/suite.py `parser` validates them)
FLAGS = ("quick", "full", "no_trainer", "no_reference")
OPTIONS = ("out", "trainer_steps", "trainer_threads", "model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny inputs everywhere (seconds; used by the tests)")
    mode.add_argument("--full", action="store_true",
                      help="planning only, at full scale (tens of millions of expanded tokens per workload)")
    p.add_argument("--only", action="append", default=[], metavar="NAME[,NAME]",
                   help="run only these benchmarks (repeatable): workloads, forest, planner, trainer, service, kernels, rl")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--trainer-steps", default=None, help="timed optimizer steps per execution mode (default 5, --quick 1)")
    p.add_argument("--no-trainer", action="store_true", help="skip the tree vs expanded update-throughput timing")
    p.add_argument("--trainer-threads", default=None,
                   help="torch intra-op threads while the trainer is timed (default 1; 0: torch's default)")
    p.add_argument("--model", default=None,
                   help="named model config of the throughput timing (default small; --quick uses tiny)")
    p.add_argument("--no-reference", action="store_true", help="do not time the plain-Python reference planner")


def suite_argv(args: argparse.Namespace) -> list[str]:
    """The `python -m benchmarks.suite` command line of these arguments."""
    argv = [sys.executable, "-m", "benchmarks.suite"]
    argv += [f"--{name.replace('_', '-')}" for name in FLAGS if getattr(args, name)]
    for name in OPTIONS:
        if getattr(args, name) is not None:
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for names in args.only:
        argv += ["--only", names]
    return argv


def run(args: argparse.Namespace) -> int:
    return subprocess.run(suite_argv(args)).returncode
