"""The partitioner's last stage: every rank's order, the microbatch specs and the partition report.

    part, report = assemble(k, cfg, rf, l1, e, l2)        # depth-first order per rank
    part, report = assemble(k, cfg, rf, l1, e, l2, sch)   # a lock-step schedule's order

Order and report: docs/design/planner.md. Legend: n units of all rank forests, M microbatches, W ranks.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

import planner_service.planner.lockstep as lockstep
from planner_service.planner.config import PlanConfig
from planner_service.planner.edge_modes import EdgeRows, Level2
from planner_service.planner.pieces import Level1
from planner_service.planner.rank_forests import RankForests
from planner_service.planner.spec import MicrobatchSpec, Partition

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class PartitionReport:
    """The partitioner's own estimates (the builder's PlanStats are authoritative)."""

    rows: np.ndarray
    """int64 [M] computed rows per microbatch (kept + replay + duplicated)."""
    kept: np.ndarray
    """int64 [M] kept tokens per microbatch."""
    duplicated: np.ndarray
    """int64 [M] duplicated rows (placement prefixes and duplicated-edge context)."""
    rank_load: np.ndarray
    """float64 [W] estimated cost per rank (placement's cost model; computed rows without windows)."""
    live: np.ndarray
    """int64 [M] live bytes while each microbatch runs (its full activations plus its open
    windows' live bytes, plan.memory_model)."""
    pieces: int
    """Number of connected pieces level 1 cut the rank forests into."""
    exports: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 [M] upper bound of the bytes each microbatch keeps as a recomputed open window (its
    own exported rows and states; 0 for one nobody imports from)."""
    lower_bound: float = 0.0
    """Placement's makespan lower bound estimate: max(total cost / W, the costliest root path)."""

    @property
    def imbalance(self) -> float:
        mean = float(self.rank_load.mean()) if self.rank_load.size else 0.0
        return float(self.rank_load.max()) / mean if mean > 0 else 1.0

    @property
    def peak_live(self) -> int:
        return int(self.live.max()) if self.live.size else 0


def assemble(k, cfg: PlanConfig, rf: RankForests, l1: Level1, e: EdgeRows, l2: Level2,
             sch: lockstep.Schedule | None = None) -> tuple[Partition, PartitionReport]:
    """Every rank's order (depth-first, or the lock-step schedule `sch`), the microbatch specs and
    the partition report."""
    W, M = cfg.world_size, l1.num_microbatches
    if sch is not None:
        rank_steps = sch.rank_steps
    else:
        step_rank, step_kind, step_mb = k.dfs_order(l1.mb_parent, l2.shared, l2.mb_rank, W)
        rank_steps = [[] for _ in range(W)]
        for r, kind, m in zip(step_rank.tolist(), step_kind.tolist(), step_mb.tolist()):
            rank_steps[r].append(("B" if kind else "F", m))
    kept_specs = _specs(rf.unit_seg, rf.unit_off, rf.unit_len, l1.unit_mb, M, ~rf.dup)
    dup_specs = _specs(rf.unit_seg, rf.unit_off, rf.unit_len, l1.unit_mb, M, rf.dup)
    microbatches = [
        MicrobatchSpec(
            ranges=kept_specs[m], dup_ranges=dup_specs[m], parent=int(l1.mb_parent[m]), shared=bool(l2.shared[m]),
            rank=int(l2.mb_rank[m]), recompute=bool(l2.recompute[m]),
        )
        for m in range(M)
    ]
    has_parent = l1.mb_parent >= 0
    report = PartitionReport(
        rows=l2.rows, kept=e.kept, duplicated=e.own_dup + np.where(has_parent & ~l2.shared, e.ctx, 0),
        rank_load=l2.load, live=l2.live, pieces=int(l1.pieces.shape[0]), exports=l2.exports,
        lower_bound=rf.lower_bound,
    )
    log.debug(
        "partition: %d pieces, %d microbatches (%d windows, %d duplicated edges, %d recomputed), "
        "rows %d (%d duplicated by placement), imbalance %.3f, peak live %d bytes",
        report.pieces, M, int(l2.shared.sum()), int((has_parent & ~l2.shared).sum()), int(l2.recompute.sum()),
        int(l2.rows.sum()), int(e.own_dup.sum()), report.imbalance, report.peak_live,
    )
    return Partition(microbatches=microbatches, rank_steps=rank_steps,
                     phases=None if sch is None else sch.phases), report


def _specs(unit_seg, unit_off, unit_len, unit_mb, M: int, select: np.ndarray) -> list[np.ndarray]:
    """Token ranges (segment, start, end) of every microbatch over the units `select` (bool [n]),
    merging units of one segment that follow each other in the rank forest."""
    idx = np.flatnonzero(select)
    if idx.shape[0] == 0:
        return [np.zeros((0, 3), np.int64) for _ in range(M)]
    order = idx[np.argsort(unit_mb[idx], kind="stable")]
    mb = unit_mb[order]
    seg = unit_seg[order]
    new = np.ones(order.shape[0], np.bool_)
    new[1:] = (mb[1:] != mb[:-1]) | (seg[1:] != seg[:-1]) | (order[1:] != order[:-1] + 1)
    first = np.flatnonzero(new)
    last = np.r_[first[1:], order.shape[0]] - 1
    ranges = np.stack(
        [seg[first].astype(np.int64), unit_off[order[first]].astype(np.int64),
         unit_off[order[last]].astype(np.int64) + unit_len[order[last]]],
        axis=1,
    )
    cuts = np.searchsorted(mb[first], np.arange(1, M))
    return np.split(ranges, cuts)

