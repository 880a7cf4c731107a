"""The seam between partitioning (levels 1-2: what goes where) and the plan builder (how rows run).

`partition(forest, cfg) -> Partition` decides microbatch membership, edge modes, placement and
order; `build_plan(forest, cfg, partition) -> plan_pb2.Plan` lays out rows, ancestry, the
minimum-call linear-attention schedule, imports/exports, the log-prob map and the report (docs/design/planner.md).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True, kw_only=True)
class MicrobatchSpec:
    """One microbatch as the partitioner decided it."""

    ranges: np.ndarray
    """int64 [n, 3] kept token ranges (forest segment, start offset, end offset), end exclusive.
    Each distinct forest token is kept in exactly one microbatch. A range that does not start at
    offset 0 continues the same segment's previous range; long segments are split only at
    chunk-aligned depths."""
    parent: int = -1
    """Microbatch whose rows precede this one's piece roots on their paths; -1 when every piece
    starts at a forest root. All non-root pieces of a microbatch hang below the same parent. A
    sharing window's parent runs on the same rank, or, in a lock-step plan with cross_rank_windows
    (PlanConfig.crossing), on another one: a window across ranks (plan.proto CrossEdge)."""
    shared: bool = False
    """With a parent: True imports the ancestors from the parent (sharing window); False
    duplicates the whole root-to-piece path as context rows (occurrence 0, no loss terms)."""
    rank: int = 0
    """Data-parallel rank that runs it."""
    recompute: bool = False
    """Activation recomputation for this window parent (forward without graph first)."""
    dup_ranges: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    """int64 [n, 3] token ranges (forest segment, start, end) this microbatch computes as
    duplicated rows (occurrence 0, no log-prob entries) although another microbatch keeps them:
    the root path of a placement part whose ancestors run on other ranks (placement.py). Like
    kept rows they are local rows that window children may import. Besides these, a microbatch
    with a duplicated (not shared) edge duplicates its whole root path (`shared`)."""


@dataclass(slots=True, kw_only=True)
class Partition:
    """All microbatches of a step and each rank's execution order."""

    microbatches: list[MicrobatchSpec]
    """Indexed by global microbatch id."""
    rank_steps: list[list[tuple[str, int]]] = field(default_factory=list)
    """Per rank, ("F" | "B", global microbatch id) in execution order: depth-first over the
    microbatch forest, forward on entry, backward after every dependent's backward. In a
    lock-step partition one entry per phase, microbatch -1 for a stand-in."""
    phases: np.ndarray | None = None
    """Lock-step partitions: uint8 [P] PhaseKind of every phase (plan/phases.py); None: free."""

    def digest(self) -> bytes:
        """SHA-256 of everything the builder reads: equal digests build equal plans (the crossing
        candidates of different prefixes and placements often coincide)."""
        h = hashlib.sha256()
        for mb in self.microbatches:
            h.update(np.array([mb.parent, mb.shared, mb.rank, mb.recompute, len(mb.ranges), len(mb.dup_ranges)], np.int64).tobytes())
            h.update(np.ascontiguousarray(mb.ranges, np.int64).tobytes())
            h.update(np.ascontiguousarray(mb.dup_ranges, np.int64).tobytes())
        for steps in self.rank_steps:
            h.update(repr(steps).encode())
            h.update(b";")
        if self.phases is not None:
            h.update(np.ascontiguousarray(self.phases, np.uint8).tobytes())
        return h.digest()
