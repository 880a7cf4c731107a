"""Fixed-order accumulation of rows into rows, without `index_add_`/`scatter_add_`.

    adds = RowAdds.build(target).to(device)     # host indices -> levels of distinct targets, once
    adds.apply_(dst, src)                        # dst[target[i]] += src[i], in order of i

`index_add_` with repeated indices adds in an unspecified order on a GPU (float atomics); the
levels add each target's rows in index order, as the CPU's sequential `index_add_` does, with
gathers and unique-index copies only (docs/design/execution.md, "Small pieces").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.devices import to_device

__all__ = ["RowAdds"]


@dataclass(slots=True, kw_only=True)
class RowAdds:
    """dst[target[i]] += src[i] for every i, in order of i, in levels of unique targets."""

    levels: list[tuple[torch.Tensor, torch.Tensor]]
    """(targets, sources) int64 per level; each level's targets are distinct."""

    @staticmethod
    def build(target: np.ndarray) -> RowAdds:
        """The plan for `target` [n] (host integers), on the CPU."""
        target = np.asarray(target, dtype=np.int64).reshape(-1)
        order = np.argsort(target, kind="stable")
        sorted_t = target[order]
        starts = np.r_[0, np.flatnonzero(sorted_t[1:] != sorted_t[:-1]) + 1] if target.size else np.zeros(0, np.int64)
        group_start = np.repeat(starts, np.diff(np.r_[starts, target.size]))
        occurrence = np.empty_like(target)
        occurrence[order] = np.arange(target.size) - group_start
        levels = []
        for level in range(int(occurrence.max()) + 1 if target.size else 0):
            i = np.flatnonzero(occurrence == level)
            levels.append((torch.from_numpy(target[i]), torch.from_numpy(i)))
        return RowAdds(levels=levels)

    def to(self, device: torch.device | str) -> RowAdds:
        return RowAdds(levels=[(to_device(t, device), to_device(s, device)) for t, s in self.levels])

    def apply_(self, dst: torch.Tensor, src: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """dst[target[i]] += src[i] along `dim`, in place, in order of i; returns dst."""
        for targets, sources in self.levels:
            dst.index_copy_(dim, targets, dst.index_select(dim, targets) + src.index_select(dim, sources))
        return dst
