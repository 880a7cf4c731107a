"""Load a Hugging Face Qwen3-Next model directory (config.json + safetensors) into `Qwen3NextForRL`.

Names and layouts (per-expert or stacked experts, tied embeddings, `mtp.*` ignored) go through
`trainer.models.state_dict_adapter.StateDictAdapter`, the one mapping `harts export` inverts.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from trainer.models.config import NAMED_CONFIGS, ModelConfig
from trainer.models.qwen3_next import Qwen3NextForRL
from trainer.models.state_dict_adapter import StateDictAdapter

log = logging.getLogger(__name__)


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


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir}: expected *.safetensors weights, got none")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Qwen3NextForRL:
    """Build the model from a checkpoint directory and load every weight.

    Raises:
        ValueError: not a Qwen3-Next checkpoint, missing or unexpected weights, shape mismatches.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    model = Qwen3NextForRL(cfg)
    try:
        state = StateDictAdapter(cfg).from_hf(_read_tensors(model_dir))
    except ValueError as exc:
        raise ValueError(f"model directory {model_dir}: {exc}") from None
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(
            f"model directory {model_dir}: expected Qwen3-Next weights matching config.json; "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for k, t in want.items():
        if tuple(state[k].shape) != tuple(t.shape):
            raise ValueError(f"{model_dir}: weight {k}: expected shape {list(t.shape)}, got {list(state[k].shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.to(dtype)


def build_model(spec: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen3NextForRL:
    """`--model` argument: a named config (random weights from `seed`) or a checkpoint directory."""
    if spec in NAMED_CONFIGS:
        model = Qwen3NextForRL(NAMED_CONFIGS[spec]())
        model.init_weights(seed)
        return model.to(dtype)
    if not Path(spec).is_dir():
        raise ValueError(f"--model: expected one of {sorted(NAMED_CONFIGS)} or a checkpoint directory, got {spec!r}")
    return load_model(spec, dtype=dtype)
