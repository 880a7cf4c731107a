"""Build the model from `--model`: a named config with seeded weights, or a Hugging Face Qwen3-Next directory.

    model = build_model("tiny", seed=0)                          # the whole model, in this process
    model = build_model("qwen3-next-8l-64e", device="cuda")      # a plan.named_models config, made on the device
    model = build_model("path/to/hf", shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=True),
                        device=ctx.device)                       # only this rank's FSDP2 shards
    model = build_model(spec, shard=..., fill=False)             # storage only: a DCP checkpoint loads next

Every build starts on the meta device and materialises only the rows the process keeps
(`trainer.models.materialize`; docs/design/execution.md, "Building the model without holding it").
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from plan.named_models import NAMED_MODELS
from trainer.models.config import NAMED_CONFIGS, ModelConfig
from trainer.models.materialize import hf_rows, materialize, meta_model, seed_rows
from trainer.models.qwen3_next import Qwen3NextForRL

log = logging.getLogger(__name__)

__all__ = ["read_config", "model_config", "build_model", "load_model"]


def read_config(model_dir: str | Path) -> ModelConfig:
    """ModelConfig of a checkpoint directory.

    Raises:
        ValueError: no config.json, or not a Qwen3-Next config.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {model_dir}: expected a Hugging Face Qwen3-Next checkpoint with config.json, got none")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: expected JSON, got a parse error ({exc})") from exc
    return ModelConfig.from_hf_dict(doc)


def model_config(spec: str) -> ModelConfig:
    """The ModelConfig of a `--model` argument: a trainer config (`NAMED_CONFIGS`), a full-size
    model of `plan.named_models`, or a checkpoint directory."""
    if spec in NAMED_CONFIGS:
        return NAMED_CONFIGS[spec]()
    if spec in NAMED_MODELS:
        return ModelConfig.from_hf_dict(NAMED_MODELS[spec]())
    if not Path(spec).is_dir():
        raise ValueError(f"--model: expected one of {sorted([*NAMED_CONFIGS, *NAMED_MODELS])} or a checkpoint directory, "
                         f"got {spec!r}")
    return read_config(spec)


def build_model(spec: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                shard: Callable[[Qwen3NextForRL], Qwen3NextForRL] | None = None, fill: bool = True) -> Qwen3NextForRL:
    """`--model` argument: a named config of either kind (random weights from `seed`) or a checkpoint directory.

    Args:
        shard: applied to the meta model before anything is allocated (FSDP2's `parallelize`), so
            that only this rank's rows are made.
        fill: False allocates the (sharded) storage uninitialised, for a checkpoint to load into.
    Raises:
        ValueError: an unknown name, not a Qwen3-Next checkpoint, missing or unexpected weights,
            shape mismatches.
    """
    hf_dir = None if spec in NAMED_CONFIGS or spec in NAMED_MODELS else spec
    return _build(model_config(spec), hf_dir, seed=seed, dtype=dtype, device=device, shard=shard, fill=fill)


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Qwen3NextForRL:
    """The whole model of a Hugging Face directory in this process."""
    return _build(read_config(model_dir), str(model_dir), seed=0, dtype=dtype, device="cpu", shard=None, fill=True)


def _build(cfg: ModelConfig, hf_dir: str | None, *, seed: int, dtype: torch.dtype, device, shard, fill: bool):
    model = meta_model(cfg)
    if shard is not None:
        model = shard(model)
    if not fill:
        materialize(model, device, None)
    elif hf_dir is None:
        materialize(model, device, seed_rows(cfg, seed=seed))
    else:
        expect = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
        with hf_rows(hf_dir, cfg, expect=expect) as rows:
            materialize(model, device, rows)
    return model if dtype == torch.float32 else model.to(dtype)
