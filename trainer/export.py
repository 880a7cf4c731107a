"""Trained weights back to the generators: a Hugging Face Qwen3-Next directory from a checkpoint.

    harts export ckpt/step-00000004 --out hf/step-4 [--dtype bfloat16] [--max-shard-mb 2048]
    python -m trainer.train ... --checkpoint.export_every 2      # the trainer exports as it goes

`export_model` (collective: the trainer all-gathers one FSDP2 unit at a time) and
`export_checkpoint` (one unit at a time from a DCP checkpoint) write `config.json`, sharded
safetensors in the Qwen3-Next layout, `harts.json` and the tokenizer files as the units arrive.
What is written and why: docs/design/training-loop.md ("Weights back to the generators").
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from trainer.models.config import NAMED_CONFIGS, ModelConfig
from trainer.models.state_dict_adapter import StateDictAdapter
from trainer.step_dirs import LATEST, point_latest, prune

log = logging.getLogger(__name__)

__all__ = ["write_hf_dir", "write_hf_units", "export_model", "export_checkpoint", "gathered_units", "unit_names",
           "model_config_of_meta", "point_latest", "prune", "LATEST", "META", "TOKENIZER_FILES", "CARRIED_CONFIG_KEYS"]

META = "harts.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
#: files an export copies from the model directory it started from (`write_hf_units(files_from=...)`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
#: config.json keys the trainer's ModelConfig does not hold that an export copies from the source's config.json
CARRIED_CONFIG_KEYS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
#: max_position_embeddings of an export whose source names none (a named model): transformers'
#: Qwen3-Next default, written out so that every engine reads the same context length
DEFAULT_MAX_POSITIONS = 32768
#: generation_config.json of an export whose model directory has none: plain sampling, the
#: distribution the trainer's log-probs describe (temperature 1, no top-k / top-p).
PLAIN_SAMPLING = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def write_hf_dir(out: str | Path, state: dict[str, torch.Tensor], cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 2 << 30, meta: dict | None = None, files_from: str | Path | None = None) -> Path:
    """Write an export (config.json, sharded safetensors, harts.json, generation_config.json, the
    tokenizer) into `out` from a whole state dict in memory.

    Args:
        state: our full (unsharded) state dict, e.g. `Qwen3NextForRL.state_dict()`.
    See `write_hf_units` for the rest.
    """
    return write_hf_units(out, [state], cfg, dtype=dtype, max_shard_bytes=max_shard_bytes, meta=meta,
                          files_from=files_from)


def write_hf_units(out: str | Path, units: Iterable[dict[str, torch.Tensor]], cfg: ModelConfig, *,
                   dtype: torch.dtype = torch.bfloat16, max_shard_bytes: int = 2 << 30, meta: dict | None = None,
                   files_from: str | Path | None = None) -> Path:
    """Write config.json, sharded safetensors, harts.json, generation_config.json and the tokenizer
    into `out` (created; replaced if present), every file mode 0644 (readable by the generators' user),
    taking our full tensors one unit at a time: host memory holds one unit plus one output file.

    Args:
        units: our full tensors by name, a group at a time (an FSDP2 unit, or a whole state dict).
        dtype: dtype of the written floating-point weights.
        max_shard_bytes: size limit of one .safetensors file (a larger tensor gets a file of its own).
        meta: extra fields of harts.json (policy_version, step_ids, ...).
        files_from: the model directory the run started from: its tokenizer files and
            generation_config.json (`TOKENIZER_FILES`) are copied, and its config.json's
            `CARRIED_CONFIG_KEYS`. Without a tokenizer there (or None) a model of the byte
            tokenizer's 256 ids gets that tokenizer's files; without a generation_config.json,
            `PLAIN_SAMPLING` with the token ids is written.
    Side effects: writes into a sibling temporary directory, then renames it to `out`.
    """
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    adapter = StateDictAdapter(cfg)
    files: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            save_file(pending, str(tmp / f"part-{len(files):05d}.safetensors"), metadata={"format": "pt"})
            files.append(sorted(pending))
            pending, size = {}, 0

    for unit in units:
        for name, t in sorted(adapter.to_hf(unit).items()):
            t = t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous()
            n = t.numel() * t.element_size()
            if pending and size + n > max_shard_bytes:
                flush()
            pending[name] = t
            size += n
            total += n
    flush()
    weight_map = {}
    for i, names in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(tmp / f"part-{i:05d}.safetensors", tmp / fname)
        weight_map.update({k: fname for k in names})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1, sort_keys=True))
    src = Path(files_from) if files_from is not None else None
    for name in TOKENIZER_FILES:
        if src is not None and (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    _write_tokenizer_and_config(tmp, cfg, src, dtype)
    (tmp / META).write_text(json.dumps({"format": "harts.export.v1", **(meta or {})}, indent=1))
    for f in tmp.iterdir():
        f.chmod(0o644)  # safetensors writes 0600
    tmp.chmod(0o755)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _write_tokenizer_and_config(tmp: Path, cfg: ModelConfig, src: Path | None, dtype: torch.dtype) -> None:
    """config.json (with `CARRIED_CONFIG_KEYS`), the byte tokenizer for a model of its vocabulary
    when no tokenizer was copied, and a plain-sampling generation_config.json when none was."""
    from harts_client.tokenizer import ByteTokenizer, HFTokenizer

    byte = ByteTokenizer()
    if not (tmp / "tokenizer.json").is_file() and cfg.vocab_size == byte.vocab_size:
        byte.save(tmp)
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = str(dtype).removeprefix("torch.")
    try:
        source = json.loads((src / "config.json").read_text()) if src is not None else {}
    except (OSError, ValueError):
        source = {}
    hf.update({k: source[k] for k in CARRIED_CONFIG_KEYS if source.get(k) is not None})
    hf.setdefault("max_position_embeddings", DEFAULT_MAX_POSITIONS)
    tok = None
    if (tmp / "tokenizer.json").is_file():
        try:
            tok = HFTokenizer(tmp)
        except ValueError as exc:  # a tokenizer without an eos token: the source's ids only
            log.warning("export: %s", exc)
    if tok is not None:
        for key, value in (("bos_token_id", tok.bos_id), ("eos_token_id", tok.eos_id), ("pad_token_id", tok.pad_id)):
            if value is not None:
                hf.setdefault(key, value)
    (tmp / "config.json").write_text(json.dumps(hf, indent=1))
    if not (tmp / "generation_config.json").is_file():
        ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
        (tmp / "generation_config.json").write_text(json.dumps({**PLAIN_SAMPLING, **ids}, indent=1))


def unit_names(model: torch.nn.Module) -> list[list[str]]:
    """Our parameter names grouped as the FSDP2 units are: the root's (embeddings, final norm, lm
    head: what no decoder block holds), then each decoder block's."""
    blocks = [[] for _ in model.model.layers]
    root = []
    for name, _ in model.named_parameters():
        if name.startswith("model.layers."):
            blocks[int(name.split(".")[2])].append(name)
        else:
            root.append(name)
    return [root, *blocks]


def gathered_units(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The model's full parameters one unit at a time (an FSDP2 shard is all-gathered: collective,
    every rank must consume the iterator)."""
    params = dict(model.named_parameters())
    for names in unit_names(model):
        yield {n: params[n].full_tensor() if hasattr(params[n], "full_tensor") else params[n] for n in names}


def export_model(out: str | Path, model: torch.nn.Module, *, write: bool, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 2 << 30, meta: dict | None = None,
                 files_from: str | Path | None = None) -> Path | None:
    """Export a (sharded) training model unit by unit; collective: every rank calls it, `write` on one
    (`write_hf_units` describes the arguments).

    Returns:
        the directory written (None where `write` is false).
    """
    units = gathered_units(model)
    if not write:
        for _ in units:
            pass
        return None
    return write_hf_units(out, units, model.config, dtype=dtype, max_shard_bytes=max_shard_bytes, meta=meta,
                          files_from=files_from)


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
    """Write the HF directory of a (sharded, any world size) DCP checkpoint in this process, reading
    it unit by unit: host memory holds one unit plus one output file.

    `ckpt` is a checkpoint directory (step-XXXXXXXX) or a checkpoint root (its `latest` is used).
    Raises:
        ValueError: not a HARTS checkpoint.
    """
    from trainer import checkpoint
    from trainer.models.materialize import meta_model

    path = Path(ckpt)
    if not (path / ".metadata").is_file():
        found = checkpoint.latest(path) if path.is_dir() else None
        if found is None:
            raise ValueError(f"{ckpt}: expected a HARTS checkpoint directory (with .metadata and harts.json) "
                             "or a checkpoint root with `latest`, got neither")
        path = found
    meta = checkpoint.read_meta(path)
    cfg = model_config_of_meta(meta)
    spec = meta.get("model")
    skeleton = meta_model(cfg)
    shapes = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}

    def units() -> Iterator[dict[str, torch.Tensor]]:
        for names in unit_names(skeleton):
            tensors = {n: torch.empty(shapes[n]) for n in names}
            checkpoint.load_model_tensors(path, tensors)
            yield tensors

    return write_hf_units(out, units(), cfg, dtype=dtype, max_shard_bytes=max_shard_bytes,
                          meta={"policy_version": int(meta["step"]), "step_ids": meta.get("step_ids", []),
                                "checkpoint": str(path.resolve())},
                          files_from=spec if spec and Path(spec).is_dir() else None)
