"""Build the prefix forest of a rollout batch and print its statistics.

    harts tree rollouts.json            # JSON document (docs/rollouts.md)
    harts tree batch.pb                 # protobuf RolloutBatch bytes
    cat rollouts.json | harts tree -    # stdin (JSON, or protobuf with --format pb)

Prints one JSON object on stdout: trajectories, trees, segments, unique_tokens, expanded_tokens,
compression, max_depth (Forest.stats()) and build_seconds (parse + validation + build, after the
Numba warm-up). A rejected batch exits with code 2 and a one-line message naming the field.
"""
from __future__ import annotations

import argparse
import json
import logging

from harts_cli.inputs import add_input_arguments, read_input
from harts_client.timing import timed

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_input_arguments(parser)
    parser.add_argument("--python", action="store_true", help="use the plain-Python radix builder (reference)")
    parser.add_argument("--max-tokens", type=int, default=None, help="override Limits.max_tokens (expanded tokens)")


def run(args: argparse.Namespace) -> int:
    from planner_service.ingest import Limits, forest_from_json, forest_from_proto, warmup

    data, fmt = read_input(args.input, args.format)
    limits = Limits() if args.max_tokens is None else Limits(max_tokens=args.max_tokens)
    _, seconds = timed(warmup)
    log.debug("numba warm-up %.3f s", seconds)
    log.info("read %d bytes (%s) from %s", len(data), fmt, args.input)
    build = forest_from_proto if fmt == "pb" else forest_from_json
    forest, seconds = timed(build, data, limits, numba=not args.python)
    stats = forest.stats()
    stats["build_seconds"] = round(seconds, 6)
    log.info("forest: %d trajectories, %d segments, compression %.2fx in %.3f s",
             stats["trajectories"], stats["segments"], stats["compression"], seconds)
    print(json.dumps(stats))
    return 0
