"""`harts bench` is a runner apart from the benchmarks: it forwards its arguments to
`python -m benchmarks.suite` (a subprocess) and declares the same options as the suite's parser."""
from __future__ import annotations

import argparse
import sys

from benchmarks import suite, suite_config
from harts_cli import cmd_bench
from harts_cli.main import build_parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def test_the_runner_declares_the_suites_options():
    p = argparse.ArgumentParser()
    cmd_bench.add_arguments(p)
    assert _options(p) == _options(suite.parser())
    help_text = next(a.help for a in p._actions if "--only" in a.option_strings)
    assert help_text.endswith(", ".join(suite_config.NAMES))


def test_arguments_reach_the_suite_unchanged():
    parser, _ = build_parser()
    args = parser.parse_args(["bench", "--quick", "--only", "planner,forest", "--only", "kernels", "--out", "/tmp/r",
                              "--no-trainer", "--trainer-threads", "2", "--model", "tiny"])
    argv = cmd_bench.suite_argv(args)
    assert argv[:3] == [sys.executable, "-m", "benchmarks.suite"]
    parsed = suite.parser().parse_args(argv[3:])
    assert parsed.quick and parsed.no_trainer and not parsed.full and not parsed.no_reference
    assert parsed.only == [["planner", "forest"], ["kernels"]] and str(parsed.out) == "/tmp/r"
    assert (parsed.trainer_threads, parsed.model, parsed.trainer_steps) == (2, "tiny", None)
    defaults = cmd_bench.suite_argv(parser.parse_args(["bench"]))
    assert defaults == [sys.executable, "-m", "benchmarks.suite"]  # the suite's own defaults apply
