"""Load a Hugging Face Qwen3-Next model directory (config.json + safetensors) into `Qwen3NextForRL`.

Accepts the original checkpoint layout (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`,
what `save_pretrained` writes) and the transformers v5 in-memory layout (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`). Multi-token-prediction weights (`mtp.*`) are ignored.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from trainer.models.config import NAMED_CONFIGS, ModelConfig
from trainer.models.qwen3_next import Qwen3NextForRL

log = logging.getLogger(__name__)

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


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


def _regroup_experts(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> stacked gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    out, experts = {}, {}
    for name, t in raw.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        E = max(by_e) + 1
        if sorted(by_e) != list(range(E)) or any(len(v) != 3 for v in by_e.values()):
            raise ValueError(f"{prefix}: expected gate/up/down weights for experts 0..{E - 1}, got an incomplete set")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]], 0) for e in range(E)])
        out[f"{prefix}.down_proj"] = torch.stack([by_e[e]["down_proj"] for e in range(E)])
    return out


def load_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Qwen3NextForRL:
    """Build the model from a checkpoint directory and load every weight.

    Raises:
        ValueError: not a Qwen3-Next checkpoint, missing or unexpected weights, shape mismatches.
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    model = Qwen3NextForRL(cfg)
    state = {k: v for k, v in _regroup_experts(_read_tensors(model_dir)).items() if not k.startswith("mtp.")}
    if cfg.tie_word_embeddings:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
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
