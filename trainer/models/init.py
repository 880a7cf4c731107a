"""Seeded initialisation that gives the same weights at any world size (counter-based, per row block).

    w = init_rows("model.layers.0.mlp.gate.weight", (8, 64), slice(2, 6), seed=0, cfg=cfg)   # rows 2..5

transformers' Qwen3-Next scheme, drawn in fixed row blocks each from its own generator, so that a
rank draws only the blocks of its FSDP2 shard and world sizes 1, 2 and 4 give bitwise the same
weights: docs/design/execution.md ("Building the model without holding it").
"""
from __future__ import annotations

import hashlib

import torch

from trainer.models.config import ModelConfig

__all__ = ["init_rows", "BLOCK_ELEMENTS"]

#: about this many values per generator block
BLOCK_ELEMENTS = 1 << 16


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative 63-bit seed


def _rows_per_block(shape: tuple[int, ...]) -> int:
    row = 1
    for n in shape[1:]:
        row *= n
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def _draw(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.01, 16, generator=gen).log()
    return torch.randn(shape, generator=gen) * std


def init_rows(name: str, shape: tuple[int, ...], rows: slice, *, seed: int, cfg: ModelConfig) -> torch.Tensor:
    """Rows `rows` (dim 0, step 1) of parameter `name` of global shape `shape`, float32 on the CPU.

    The same values whichever rows are asked for: row i is always drawn in block
    i // rows_per_block from that block's own generator.
    """
    start, stop, step = rows.indices(shape[0]) if shape else (0, 0, 1)
    assert step == 1, f"{name}: rows must be a contiguous slice, got {rows}"
    out_shape = (max(stop - start, 0), *shape[1:])
    if name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        return torch.ones(out_shape)
    if name.endswith("norm.weight"):
        return torch.zeros(out_shape)
    if stop <= start:
        return torch.empty(out_shape)
    per = _rows_per_block(shape)
    parts = []
    for b in range(start // per, (stop - 1) // per + 1):
        lo, hi = b * per, min((b + 1) * per, shape[0])
        block = _draw(name, (hi - lo, *shape[1:]), torch.Generator().manual_seed(_block_seed(seed, name, b)),
                      cfg.initializer_range)
        parts.append(block[max(start, lo) - lo: min(stop, hi) - lo])
    return torch.cat(parts) if len(parts) > 1 else parts[0]
