"""Trained weights back to the generators: a Hugging Face Qwen3-Next directory from a checkpoint.

    harts export ckpt/step-00000004 --out hf/step-4 [--dtype bfloat16] [--max-shard-mb 2048]
    python -m trainer.train ... --checkpoint.export_every 2      # the trainer exports as it goes

An export is what vLLM / SGLang / transformers load: `config.json` (Qwen3NextConfig), the weights
as sharded safetensors (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`) in
the original Qwen3-Next layout (per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`; a tied lm
head is not written twice), and `harts.json` with the policy version (= completed trainer steps)
and the step ids that produced it. The export root's `latest` names the newest export; it is
written last, atomically, so a generator polling it never sees a half-written directory
(`harts_client.rollouts.latest_export`). This inverts `trainer.models.loading.load_model`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch

from trainer.models.config import NAMED_CONFIGS, ModelConfig

log = logging.getLogger(__name__)

__all__ = ["hf_state_dict", "write_hf_dir", "TOKENIZER_FILES", "export_checkpoint", "model_config_of_meta", "prune", "LATEST", "META"]

LATEST = "latest"
#: files an export copies from the model directory it started from (`write_hf_dir(files_from=...)`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "generation_config.json")
META = "harts.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our parameter names -> the Qwen3-Next checkpoint names and layouts.

    Stacked experts `experts.gate_up_proj` [E, 2I, D] / `experts.down_proj` [E, D, I] become
    per-expert `experts.{e}.gate_proj.weight` [I, D], `up_proj.weight` [I, D], `down_proj.weight`
    [D, I]; with tied embeddings `lm_head.weight` is left out. Every other name is already HF's.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            inner = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :inner]
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, inner:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        else:
            out[name] = t
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def write_hf_dir(out: str | Path, state: dict[str, torch.Tensor], cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 2 << 30, meta: dict | None = None, files_from: str | Path | None = None) -> Path:
    """Write config.json, sharded safetensors, harts.json, generation_config.json and the tokenizer
    into `out` (created; replaced if present), every file mode 0644 (readable by the generators' user).

    Args:
        state: our full (unsharded) state dict, e.g. `Qwen3NextForRL.state_dict()`.
        dtype: dtype of the written floating-point weights.
        max_shard_bytes: size limit of one .safetensors shard (a larger tensor gets a shard of its own).
        meta: extra fields of harts.json (policy_version, step_ids, ...).
        files_from: the model directory the run started from: its tokenizer files and
            generation_config.json (`TOKENIZER_FILES`) are copied. Without a generation_config.json
            there, one is written for plain sampling (temperature 1, no top-k / top-p: the
            distribution the trainer's log-probs describe).
    Side effects: writes into a sibling temporary directory, then renames it to `out`.
    """
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", dtype if v.is_floating_point() else v.dtype).contiguous()
               for k, v in hf_state_dict(state, cfg).items()}
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
    src = Path(files_from) if files_from is not None else None
    for name in TOKENIZER_FILES:
        if src is not None and (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    if not (tmp / "generation_config.json").is_file():
        (tmp / "generation_config.json").write_text(json.dumps(
            {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}, indent=1))
    for f in tmp.iterdir():
        f.chmod(0o644)
    tmp.chmod(0o755)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def point_latest(root: str | Path, name: str) -> None:
    """Point `root/latest` at the export `name` (atomically)."""
    _write_atomic(Path(root) / LATEST, name + "\n")


def prune(root: str | Path, keep: int, prefix: str = "step-") -> list[Path]:
    """Delete all but the newest `keep` `<prefix>XXXXXXXX` directories under root (0: keep all); returns them."""
    if keep <= 0:
        return []
    root = Path(root)
    dirs = sorted(p for p in root.glob(f"{prefix}*") if p.is_dir() and p.name[len(prefix):].isdigit())
    doomed = dirs[:-keep]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


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
    spec = meta.get("model")
    return write_hf_dir(out, model.state_dict(), cfg, dtype=dtype, max_shard_bytes=max_shard_bytes,
                        meta={"policy_version": int(meta["step"]), "step_ids": meta.get("step_ids", []),
                              "checkpoint": str(path.resolve())},
                        files_from=spec if spec and Path(spec).is_dir() else None)
