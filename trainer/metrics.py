"""Per-step RL metrics of the trainer: reduced over ranks, written by rank 0 to JSONL and TensorBoard.

    writer = MetricsWriter(cfg.metrics, is_main=ctx.is_main, resume_step=start)
    writer.write(metrics)        # one JSON line + TensorBoard scalars `train/<key>` at metrics["step"]
    writer.close()

A resumed run rewrites the JSONL without the lines after the checkpoint's step and purges
TensorBoard events after it, so every step appears once. The keys and what each means:
docs/design/training-loop.md ("Metrics").
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "stat_metrics", "STAT_SUMS", "STAT_MAX", "STAT_MIN", "moments", "peak_memory_mib",
           "advantage_partials", "reward_metrics"]

#: objective stats (trainer.objectives.LossTerms.stats) by how they reduce over microbatches and ranks.
STAT_SUMS = ("loss_tokens", "clipped", "ratio_sum", "ratio_sq_sum", "kl_old_sum", "kl_ref_sum", "entropy_sum")
STAT_MAX = ("ratio_max",)
STAT_MIN = ("ratio_min",)


def stat_metrics(sums: dict[str, float], maxes: dict[str, float], mins: dict[str, float]) -> dict[str, float]:
    """Metrics from the stats reduced over the step (docs/design/training-loop.md, "Metrics"); keys whose stats are missing are absent."""
    n = sums.get("loss_tokens", 0.0)
    out: dict[str, float] = {}
    if n <= 0:
        return out
    if "clipped" in sums:
        out["clip_fraction"] = sums["clipped"] / n
    if "kl_old_sum" in sums:
        out["approx_kl_old"] = sums["kl_old_sum"] / n
    if "kl_ref_sum" in sums:
        out["kl_ref"] = sums["kl_ref_sum"] / n
    if "entropy_sum" in sums:
        out["entropy"] = sums["entropy_sum"] / n
    if "ratio_sum" in sums and "ratio_sq_sum" in sums:
        mean, std = moments(n, sums["ratio_sum"], sums["ratio_sq_sum"])
        out["ratio_mean"], out["ratio_std"] = mean, std
    if "ratio_max" in maxes:
        out["ratio_max"] = maxes["ratio_max"]
    if "ratio_min" in mins:
        out["ratio_min"] = mins["ratio_min"]
    return out


def moments(n: float, s: float, sq: float) -> tuple[float, float]:
    """(mean, population std) from a count, a sum and a sum of squares."""
    mean = s / n
    return mean, math.sqrt(max(sq / n - mean * mean, 0.0))


def advantage_partials(plan) -> list[float]:
    """[count, sum, sum of squares, max, min] of the advantages of this slice's loss tokens."""
    from proto.arrays import unpack

    n = s = sq = 0.0
    hi, lo = -math.inf, math.inf
    for mb in plan.rank.microbatches:
        if not len(mb.lp_advantage):
            continue
        adv = unpack(mb.lp_advantage, "float32", name="lp_advantage").astype(np.float64)
        mask = unpack(mb.lp_loss_mask, "uint8", name="lp_loss_mask") > 0 if len(mb.lp_loss_mask) else np.ones(adv.shape, bool)
        a = adv[mask]
        if a.size:
            n += a.size
            s += float(a.sum())
            sq += float((a * a).sum())
            hi, lo = max(hi, float(a.max())), min(lo, float(a.min()))
    return [n, s, sq, hi, lo]


def reward_metrics(header, gather=None) -> dict[str, float]:
    """Reward statistics of the step's trajectories when the plan header carries them
    (`PlanHeader.trajectory_rewards`, float32 [T]); {} otherwise.

    Args:
        gather: for a rank's plan slice (whose header holds its own trajectories' rewards, at the
            step-wide indices `trajectory_index`), a max-reduction over ranks of a list of floats
            (`trainer.distributed.all_reduce_values(..., "max")`): the statistics are then over
            every trajectory of the step, each counted once, on every rank.
    """
    from proto.arrays import unpack

    if "trajectory_rewards" not in header.DESCRIPTOR.fields_by_name:
        return {}
    r = unpack(header.trajectory_rewards, "float32", name="trajectory_rewards").astype(np.float64) \
        if len(header.trajectory_rewards) else np.zeros(0)
    if gather is not None:
        full = np.full(int(header.normalizers.num_trajectories), -np.inf)
        index = unpack(header.trajectory_index, "int32") if len(header.trajectory_index) else np.arange(r.size)
        full[index] = r
        r = np.asarray(gather(full.tolist()))
        r = r[np.isfinite(r)]  # a trajectory without loss tokens is on no rank
    if not r.size:
        return {}
    return {"reward_mean": float(r.mean()), "reward_std": float(r.std()), "reward_min": float(r.min()),
            "reward_max": float(r.max())}


def peak_memory_mib(device) -> float:
    """Peak memory of this process: CUDA max allocated since the last reset, else the max RSS."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


class MetricsWriter:
    """Rank 0's metrics sinks; every method is a no-op on other ranks or without sinks."""

    def __init__(self, cfg, *, is_main: bool, resume_step: int = 0):
        self.jsonl = None
        self.tb = None
        self._jsonl_path: Path | None = None
        self._resume_step = resume_step
        if not is_main:
            return
        if cfg.jsonl:
            # opened (and, on resume, cut after the checkpoint's step) by the first write, as
            # TensorBoard purges on its first event: a run that trains nothing changes neither
            self._jsonl_path = Path(cfg.jsonl)
            self._jsonl_path.parent.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:  # the tensorboard package is a pinned dependency
                raise ValueError(f"metrics.tensorboard_dir: expected the tensorboard package to be installed, got {exc}") from None
            Path(cfg.tensorboard_dir).mkdir(parents=True, exist_ok=True)
            # purge_step: events of steps after the checkpoint (an interrupted run) are dropped.
            self.tb = SummaryWriter(cfg.tensorboard_dir, purge_step=resume_step + 1 if resume_step else None)

    def write(self, metrics: dict) -> None:
        if self.jsonl is None and self._jsonl_path is not None:
            if self._resume_step >= 0 and self._jsonl_path.exists():
                _truncate_after(self._jsonl_path, self._resume_step)
            self.jsonl = open(self._jsonl_path, "a")
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(metrics) + "\n")
            self.jsonl.flush()
        if self.tb is not None:
            step = int(metrics["step"])
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step" and math.isfinite(value):
                    self.tb.add_scalar(f"train/{key}", value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _truncate_after(path: Path, step: int) -> None:
    """Keep the lines of steps <= `step` (a resumed run re-trains the later ones); atomic rewrite."""
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            s = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1
            continue
        if s <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
        log.info("metrics %s: dropped %d line(s) after step %d (resumed run)", path, dropped, step)
