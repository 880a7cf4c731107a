"""Trainer entry point: each torchrun rank long-polls its plan slices from the planner and trains (DESIGN §5.7).

    torchrun --nproc_per_node=2 -m trainer.train --config examples/train_tiny_fsdp.toml
    torchrun --nproc_per_node=2 -m trainer.train --config examples/train_tiny_fsdp.toml \\
        --objective.clip_high 0.28 --job.steps 10 --checkpoint.export_every 2
    python -m trainer.train --config ...   # one process (world size 1, no torchrun needed)
    harts train --nproc-per-node 2 ...     # the same CLI; launches torchrun itself
    python -m trainer.train --help         # every field of the config, with its default

The run is one `trainer.config.TrainerConfig`: a TOML or YAML file (`--config`, see
examples/train_tiny_fsdp.toml) overridden by dotted flags (`--section.field value`); the flags
of earlier releases (`--steps`, `--lr`, `--planner-url`, `--checkpoint-dir`, ...) still work.

Step i (0-based) trains the planner step `job.step_ids[i]`, or `<job.step_prefix><i>`. Every rank
builds its part of the model on the meta device and fills only its FSDP2 shards (from
`job.seed`, the same weights at any world size; from a Hugging Face directory; or, resuming, from
the checkpoint; `--data-parallel replicate` builds full replicas), applies `trainer.parallelize`,
long-polls its own slice of the step's plan (the next one is fetched in the background while the
current one trains), runs it with the executor and reduces the gradients: with
`parallelism.reshard_after_forward` true, FSDP2 gathers each unit per forward and per backward
and reduce-scatters after every backward, on lock-step plans only (a free plan is refused with
an error naming the field); otherwise units stay gathered and gradients are SUM-reduced once, in
the rank's last backward (a rank without microbatches runs a zero-loss stand-in so that it takes
part in the collectives). Windows across ranks of a lock-step plan (cross edges) exchange their
exports and gradients point to point at the end of their phases (`trainer.cross_rank`), every
wait bounded by `parallelism.p2p_timeout_s`. At start rank 0 prints the per-rank memory report of
`plan.cluster_memory` (shards, gathered units, activations left, whether it fits). Then it clips, sets the scheduled learning rate, steps AdamW and logs
one metrics line from rank 0 (`trainer.metrics` lists the keys, `peak_param_grad_bytes` among
them; JSONL and TensorBoard). The plan's world size must equal torchrun's, and its chunk size,
conv kernel and vocabulary the model's.

Checkpoints (sharded DCP: model, optimizer, step; loadable at any world size) go to
`checkpoint.dir` every `checkpoint.every` steps and after the last one, keeping the newest
`checkpoint.keep_last`; `checkpoint.resume` continues from the newest one. Every
`checkpoint.export_every` steps rank 0 writes a Hugging Face directory for the generators
(`trainer.export`, gathered one unit at a time) carrying the policy version (= completed steps). A batch submitted with a
`policy_version` older than `staleness.max_staleness` versions is rejected (skipped) or
down-weighted (`staleness.mode`); one newer than the trainer's version (negative staleness) is an
error naming both versions. SIGTERM (on any rank) finishes the current step, checkpoints
and exits 0 (a rank still waiting for a plan exits at once, keeping the previous checkpoint).
Errors (bad config, planner unreachable, a plan for another topology, vocabulary or chunk size)
print one line per rank and exit 1.
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
