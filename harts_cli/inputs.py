"""Reading a rollout batch from a file or stdin: the one input path of every `harts` subcommand."""
from __future__ import annotations

import argparse
import sys


def add_input_arguments(parser: argparse.ArgumentParser, *, optional: bool = False) -> None:
    """The positional `input` and `--format`, shared by tree, plan, logprobs and verify (`optional`:
    the command also runs without a batch)."""
    parser.add_argument("input", nargs="?" if optional else None,
                        help="rollout batch: a .json file, a .pb file (protobuf RolloutBatch) or - for stdin")
    parser.add_argument("--format", choices=("auto", "json", "pb"), default="auto",
                        help="input format; auto: .pb files are protobuf, everything else JSON")


def read_input(path: str, fmt: str = "auto") -> tuple[bytes, str]:
    """The batch's bytes and its format ("json" or "pb")."""
    if path == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(path, "rb") as fh:
            data = fh.read()
    if fmt == "auto":
        fmt = "pb" if path.endswith(".pb") else "json"
    return data, fmt


def load_forest(path: str, fmt: str = "auto", limits=None, *, numba: bool = True):
    """Validate the batch at `path` and build its prefix Forest (raises ValidationError / LimitError)."""
    from planner_service import ingest

    data, fmt = read_input(path, fmt)
    build = ingest.forest_from_proto if fmt == "pb" else ingest.forest_from_json
    return build(data, limits, numba=numba)
