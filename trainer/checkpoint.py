"""Training checkpoints with `torch.distributed.checkpoint` (DCP): model, optimizer and step.

    path = save(ckpt_dir, step=2, model=model, optimizer=opt, meta={"step_ids": [...]}, ctx=ctx)  # collective
    meta = load(latest(ckpt_dir), model=model, optimizer=opt)      # -> {"step": 2, ...}; any world size

`ckpt_dir/step-00000002/` holds one DCP checkpoint and `harts.json` (completed steps, step ids);
`latest` is written last, by rank 0 (`trainer.step_dirs`). Sharding, resharding on load and
resuming: docs/design/training-loop.md ("Checkpoints").
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.distributed import DistContext, barrier
from trainer.step_dirs import LATEST, latest_name, point_latest, prune, step_name, write_atomic

log = logging.getLogger(__name__)

__all__ = ["save", "load", "load_model_tensors", "latest", "read_meta", "prune", "CheckpointError"]

META = "harts.json"


class CheckpointError(Exception):
    """A checkpoint directory that cannot be resumed from."""


def save(ckpt_dir: str | Path, *, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         meta: dict, ctx: DistContext) -> Path:
    """Write a checkpoint after `step` completed steps (collective); returns its directory.

    Side effects: creates `ckpt_dir/step-XXXXXXXX/` and points `ckpt_dir/latest` at it.
    """
    root = Path(ckpt_dir)
    path = root / step_name(step)
    if ctx.is_main:
        path.mkdir(parents=True, exist_ok=True)
    barrier(ctx)
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer),
        "train": {"step": torch.tensor(step, dtype=torch.int64)},
    }
    with warnings.catch_warnings():  # DCP warns that a single process saves alone: that is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=not ctx.initialized)
    if ctx.is_main:
        write_atomic(path / META, json.dumps({"step": step, **meta}, indent=1))
        point_latest(root, path.name)
    barrier(ctx)
    return path


def latest(ckpt_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under `ckpt_dir`, or None when there is none."""
    name = latest_name(ckpt_dir)
    if name is None:
        return None
    path = Path(ckpt_dir) / name
    if not (path / ".metadata").is_file() or not (path / META).is_file():
        raise CheckpointError(f"{Path(ckpt_dir) / LATEST}: expected a complete checkpoint at {path}, found none")
    return path


def read_meta(path: str | Path) -> dict:
    """The harts.json of a checkpoint: {"step": completed steps, "step_ids": [...], ...}."""
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: expected a readable {META}, got {exc}") from None


def load(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
         no_dist: bool | None = None) -> dict:
    """Load a checkpoint into `model` (and `optimizer`) in place; returns its meta.

    Works on any number of ranks (also without a process group: `no_dist` defaults to that).
    """
    if no_dist is None:
        no_dist = not (torch.distributed.is_available() and torch.distributed.is_initialized())
    meta = read_meta(path)
    state: dict = {"model": get_model_state_dict(model), "train": {"step": torch.tensor(0, dtype=torch.int64)}}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    step = int(state["train"]["step"])
    if step != meta.get("step"):
        raise CheckpointError(f"{path}: expected step {meta.get('step')} (from {META}), got {step} in the DCP state")
    return meta


def load_model_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Read some of a checkpoint's model tensors by parameter name into `tensors` (full, in this process).

    Only those tensors are read (`harts export` goes unit by unit).
    Raises:
        CheckpointError: a name the checkpoint does not have.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"model": tensors}, checkpoint_id=str(path), no_dist=True)
        except (RuntimeError, KeyError) as exc:  # DCP raises CheckpointException (a RuntimeError) for missing keys
            raise CheckpointError(f"{path}: expected model tensors {sorted(tensors)[:3]}..., got {exc}") from None
