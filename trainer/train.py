"""Trainer entry point: each torchrun rank long-polls its plan slices from the planner and trains.

    torchrun --nproc_per_node=2 -m trainer.train --config examples/train_tiny_fsdp.toml
    torchrun --nproc_per_node=2 -m trainer.train --config examples/train_tiny_fsdp.toml \\
        --objective.clip_high 0.28 --job.steps 10 --checkpoint.export_every 2
    python -m trainer.train --config ...   # one process (world size 1, no torchrun needed)
    harts train --nproc-per-node 2 ...     # the same CLI; launches torchrun itself
    python -m trainer.train --help         # every field of the config, with its default

This module is the command line only; the loop is `trainer.loop` (docs/design/training-loop.md).
Errors (bad config, planner unreachable, a plan for another topology) print one line per rank, exit 1.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from trainer.config import ConfigError, TrainerConfig, add_config_arguments, config_from_namespace

__all__ = ["TrainerConfig", "add_arguments", "config_from_args", "main", "run", "torchrun_command"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The trainer's flags (shared by `python -m trainer.train` and `harts train`): `--config` and
    one `--section.field` per config field (`trainer.config`)."""
    add_config_arguments(p)


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return config_from_namespace(args)


def torchrun_command(argv: list[str], nproc: int) -> list[str]:
    """The torchrun command line that runs this module with `argv` on `nproc` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "trainer.train", *argv]


def run(args: argparse.Namespace) -> int:
    """Train with parsed arguments; returns the exit status (errors are printed, not raised)."""
    # optional here: the loop imports torch, which `--help` and argument errors do not need
    from trainer.loop import TrainError, train

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per long-poll request otherwise
    try:
        cfg = config_from_args(args)
        train(cfg)
    except (TrainError, ConfigError, ValueError) as exc:
        print(f"trainer.train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n\n")[0],
                                epilog="Example config: examples/train_tiny_fsdp.toml (every field, documented).")
    add_arguments(p)
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s", stream=sys.stderr)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
