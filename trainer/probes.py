"""Verification probes: per-trajectory log-probs, entropies and linear-attention outputs of a step.

`TrajectoryProbes` scatters what each microbatch computed for its log-prob entries back into
trajectory space (one value per trajectory position), so that a tree run and a
trajectory-expanded run of the same step can be compared position by position (`trainer.verify`,
`harts logprobs`). Training does not need them; the executor fills them only when asked.

Legend: P log-prob entries, T trajectories, L trajectory length.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.dtypes import compute_dtype
from proto.arrays import unpack
from trainer.layout import RowLayout


class TrajectoryProbes:
    """Trajectory-space arrays, flat: position i of trajectory t at offsets[t] + i - 1."""

    def __init__(self, header, *, logprobs: bool, entropies: bool, linear: bool):
        self.ids = list(header.trajectory_ids)
        lengths = unpack(header.trajectory_lengths, "int32", name="header.trajectory_lengths")
        self.offsets = np.concatenate([[0], np.cumsum(np.maximum(lengths.astype(np.int64) - 1, 0))])
        n = int(self.offsets[-1])
        self.logprobs = np.full(n, np.nan) if logprobs else None
        self.entropies = np.full(n, np.nan) if entropies else None
        self.linear: dict[int, np.ndarray] | None = {} if linear else None

    def add(self, layout: RowLayout, logprob_P: torch.Tensor, entropy_P: torch.Tensor | None,
            linear: dict[int, torch.Tensor]) -> None:
        """Record one microbatch's entries (tensors of the microbatch's log-prob map); nothing (and no
        read from the device) when no probe was asked for."""
        if self.logprobs is None and self.entropies is None and self.linear is None:
            return
        lp = layout.logprobs
        flat = self.offsets[lp.traj.cpu().numpy()] + lp.pos.cpu().numpy() - 1
        if self.logprobs is not None:
            self.logprobs[flat] = logprob_P.double().cpu().numpy()
        if self.entropies is not None:
            self.entropies[flat] = entropy_P.double().cpu().numpy()
        if self.linear is not None:
            for layer, o_RHV in linear.items():
                o_PHV = o_RHV.index_select(0, lp.row).to(compute_dtype(o_RHV)).cpu().numpy()
                if layer not in self.linear:
                    self.linear[layer] = np.full((int(self.offsets[-1]), *o_RHV.shape[1:]), np.nan, o_PHV.dtype)
                self.linear[layer][flat] = o_PHV

    def _split(self, flat: np.ndarray | None) -> dict[str, np.ndarray] | None:
        if flat is None:
            return None
        return {tid: flat[self.offsets[t] : self.offsets[t + 1]] for t, tid in enumerate(self.ids)}

    def per_trajectory(self) -> tuple[dict | None, dict | None, dict | None]:
        """(log-probs, entropies, linear outputs) by trajectory id (None where not probed)."""
        linear = None
        if self.linear is not None:
            linear = {tid: {layer: arr[self.offsets[t] : self.offsets[t + 1]] for layer, arr in self.linear.items()}
                      for t, tid in enumerate(self.ids)}
        return self._split(self.logprobs), self._split(self.entropies), linear
