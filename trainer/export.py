"""Trained weights back to the generators: a Hugging Face Qwen3-Next directory from a checkpoint.

    harts export ckpt/step-00000004 --out hf/step-4 [--dtype bfloat16] [--max-shard-mb 2048]
    python -m trainer.train ... --checkpoint.export_every 2      # the trainer exports as it goes

An export is what vLLM / SGLang / transformers load: `config.json` (Qwen3NextConfig), the weights
as sharded safetensors (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`) in
the original Qwen3-Next layout (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`; a tied lm
head is not written twice), and `harts.json` with the policy version (= completed trainer steps)
and the step ids that produced it. The export root's `latest` names the newest export; it is
written last, atomically, so a generator polling it never sees a half-written directory
(`harts_client.rollouts.latest_export`, `trainer.step_dirs`). Names and layouts come from
`trainer.models.state_dict_adapter`, so `trainer.models.loading.load_model` reads an export back.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from trainer.models.config import NAMED_CONFIGS, ModelConfig
from trainer.models.state_dict_adapter import StateDictAdapter
from trainer.step_dirs import LATEST, point_latest, prune

log = logging.getLogger(__name__)

__all__ = ["write_hf_dir", "export_checkpoint", "model_config_of_meta", "point_latest", "prune", "LATEST", "META"]

META = "harts.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def write_hf_dir(out: str | Path, state: dict[str, torch.Tensor], cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 2 << 30, meta: dict | None = None) -> Path:
    """Write config.json, sharded safetensors and harts.json into `out` (created; replaced if present).

    Args:
        state: our full (unsharded) state dict, e.g. `Qwen3NextForRL.state_dict()`.
        dtype: dtype of the written floating-point weights.
        max_shard_bytes: size limit of one .safetensors shard (a larger tensor gets a shard of its own).
        meta: extra fields of harts.json (policy_version, step_ids, ...).
    Side effects: writes into a sibling temporary directory, then renames it to `out`.
    """
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in StateDictAdapter(cfg).to_hf(state).items()}
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in names}, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True))
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(hf, indent=1))
    (tmp / META).write_text(json.dumps({"format": "harts.export.v1", **(meta or {})}, indent=1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def model_config_of_meta(meta: dict) -> ModelConfig:
    """The ModelConfig a checkpoint was trained with (harts.json `model_config`, else its `model` spec)."""
    if meta.get("model_config"):
        return ModelConfig.from_hf_dict(meta["model_config"])
    spec = meta.get("model")
    if spec in NAMED_CONFIGS:
        return NAMED_CONFIGS[spec]()
    if spec and Path(spec, "config.json").is_file():
        from trainer.models.loading import read_config

        return read_config(spec)
    raise ValueError(f"checkpoint meta: expected model_config or a model name/directory, got model={spec!r}")


def export_checkpoint(ckpt: str | Path, out: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                      max_shard_bytes: int = 2 << 30) -> Path:
    """Load a (sharded, any world size) DCP checkpoint in this process and write its HF directory.

    `ckpt` is a checkpoint directory (step-XXXXXXXX) or a checkpoint root (its `latest` is used).
    Raises:
        ValueError: not a HARTS checkpoint.
    """
    from trainer import checkpoint
    from trainer.models.qwen3_next import Qwen3NextForRL

    path = Path(ckpt)
    if not (path / ".metadata").is_file():
        found = checkpoint.latest(path) if path.is_dir() else None
        if found is None:
            raise ValueError(f"{ckpt}: expected a HARTS checkpoint directory (with .metadata and harts.json) "
                             "or a checkpoint root with `latest`, got neither")
        path = found
    meta = checkpoint.read_meta(path)
    cfg = model_config_of_meta(meta)
    model = Qwen3NextForRL(cfg)
    checkpoint.load(path, model=model)
    return write_hf_dir(out, model.state_dict(), cfg, dtype=dtype, max_shard_bytes=max_shard_bytes,
                        meta={"policy_version": int(meta["step"]), "step_ids": meta.get("step_ids", []),
                              "checkpoint": str(path.resolve())})
