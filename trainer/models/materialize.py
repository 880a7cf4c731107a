"""Models no rank holds whole: built on the meta device, sharded, then only this rank's rows filled.

    model = meta_model(cfg)                                   # no memory: every parameter on "meta"
    model = parallelize(model, mesh, cfg.parallelism, ctx)    # FSDP2 shards, still on "meta"
    materialize(model, ctx.device, seed_rows(cfg, seed=0))    # this rank's rows from a seed ...
    with hf_rows(model_dir, cfg, expect=shapes) as fill:      # ... or read from a HF directory ...
        materialize(model, ctx.device, fill)
    materialize(model, ctx.device, None)                      # ... or left empty for a DCP load

Which rows a rank holds and where each fill reads them: docs/design/execution.md ("Building the
model without holding it").
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from trainer.models.config import ModelConfig
from trainer.models.init import init_rows
from trainer.models.qwen3_next import Qwen3NextForRL
from trainer.models.state_dict_adapter import StateDictAdapter

__all__ = ["meta_model", "materialize", "local_rows", "seed_rows", "hf_rows", "RowFill"]

#: fill(name, global shape, rows) -> the float32 rows of that parameter
RowFill = Callable[[str, tuple[int, ...], slice], torch.Tensor]


def meta_model(cfg: ModelConfig) -> Qwen3NextForRL:
    """The model with every parameter on the meta device (shapes only)."""
    with torch.device("meta"):
        return Qwen3NextForRL(cfg)


def local_rows(p: torch.Tensor) -> tuple[slice, torch.Tensor]:
    """(global rows this rank holds, the local tensor holding them) of a parameter: every row of a
    plain tensor; of a DTensor sharded along dim 0 (FSDP2's Shard(0), or experts sharded over the
    expert-parallel ranks and then by FSDP2), the one contiguous block of rows it keeps."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return slice(0, p.shape[0] if p.dim() else 1), p
    for pl in p.placements:
        assert getattr(pl, "dim", None) == 0, f"expected placements sharding dim 0, got {p.placements}"
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = p.to_local()
    start = min(offset[0], p.shape[0])
    assert local.shape[0] == shape[0], f"shard at row {start}: expected {shape[0]} rows, got {local.shape[0]}"
    return slice(start, start + shape[0]), local


@torch.no_grad()
def materialize(model: torch.nn.Module, device: torch.device | str, fill: RowFill | None) -> torch.nn.Module:
    """Allocate `model`'s parameters (this rank's shards only) on `device` and fill their rows.

    Side effects: replaces the meta parameters in place (FSDP2 keeps its sharded parameters).
    Raises:
        ValueError: `fill` returns rows of another shape (names the parameter).
    """
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives a plain module's shared parameter two copies (FSDP2 keeps one)
    if fill is None:
        return model
    for name, p in model.named_parameters():
        rows, local = local_rows(p)
        if rows.stop <= rows.start:  # a rank past the last row of a small parameter holds none of it
            continue
        values = fill(name, tuple(p.shape), rows)
        if tuple(values.shape) != tuple(local.shape):
            raise ValueError(f"weight {name} rows {rows.start}..{rows.stop}: expected shape {list(local.shape)}, "
                             f"got {list(values.shape)}")
        local.copy_(values)
    return model


def seed_rows(cfg: ModelConfig, *, seed: int) -> RowFill:
    """Rows of the seeded initialisation (`trainer.models.init.init_rows`)."""
    return lambda name, shape, rows: init_rows(name, shape, rows, seed=seed, cfg=cfg)


@contextlib.contextmanager
def hf_rows(model_dir: str | Path, cfg: ModelConfig, *, expect: dict[str, tuple[int, ...]]) -> Iterator[RowFill]:
    """Rows read lazily from the safetensors files of a Hugging Face directory (files open while in use).

    Args:
        expect: our parameter names -> global shapes (the meta model's): the checkpoint must provide
            exactly these (missing or unexpected names and wrong shapes are errors).
    Raises:
        ValueError: no safetensors, missing or unexpected weights, a shape mismatch.
    """
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir}: expected *.safetensors weights, got none")
    adapter = StateDictAdapter(cfg)
    with contextlib.ExitStack() as stack:
        source = {}
        for f in files:
            handle = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            source.update({k: handle.get_slice(k) for k in handle.keys()})
        have = set(adapter.names_from_hf(source))
        missing, unexpected = sorted(set(expect) - have), sorted(have - set(expect))
        if missing or unexpected:
            raise ValueError(
                f"model directory {model_dir}: expected Qwen3-Next weights matching config.json; "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
        for name in expect:
            if name in source and tuple(source[name].get_shape()) != tuple(expect[name]):
                raise ValueError(f"{model_dir}: weight {name}: expected shape {list(expect[name])}, "
                                 f"got {list(source[name].get_shape())}")

        def fill(name: str, shape: tuple[int, ...], rows: slice) -> torch.Tensor:
            try:
                return adapter.read(name, source, rows).to(torch.float32)
            except ValueError as exc:
                raise ValueError(f"model directory {model_dir}: {exc}") from None

        yield fill
