"""Decode a rank's plan slice once: every microbatch (`plan.microbatch`), its steps, phases and cross edges.

    header, ranks = rank_plans(plan_or_slice)          # a Plan's ranks or a PlanSlice's one
    decoded = decode_rank(header, ranks[0])            # DecodedSlice, or PlanValidationError naming the field

The one decoding of a slice between the wire and its users: the trainer's check
(`plan.slice_check.check_decoded`) reads the decoded slice, and the executor runs it (`trainer.layout`
turns its arrays into tensors). Decoding checks only what indexing needs (lengths, index bounds,
vocabulary); the rules across microbatches are the slice check's (docs/design/plan-contract.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan.cross_edges import CrossEdgeArrays, decode_edges
from plan.microbatch import MicrobatchArrays, _fail, decode_microbatch
from plan.phases import lockstep_phases
from proto.harts.v1 import plan_pb2

__all__ = ["BACKWARD", "FORWARD", "DecodedSlice", "decode_rank", "rank_plans", "rank_steps"]


FORWARD, BACKWARD = plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD


def rank_plans(plan) -> tuple[plan_pb2.PlanHeader, list[plan_pb2.RankPlan]]:
    """(header, rank plans) of a Plan (every rank) or a PlanSlice (its one rank)."""
    if isinstance(plan, plan_pb2.PlanSlice):
        return plan.header, [plan.rank]
    if isinstance(plan, plan_pb2.Plan):
        return plan.header, list(plan.ranks)
    raise TypeError(f"plan: expected plan_pb2.Plan or plan_pb2.PlanSlice, got {type(plan).__name__}")


def rank_steps(rank: plan_pb2.RankPlan) -> list[tuple[int, int]]:
    """(kind, microbatch index) of a rank's execution order; FORWARD m, BACKWARD m per microbatch
    when the plan lists no steps."""
    if len(rank.steps):
        return [(int(s.kind), int(s.microbatch)) for s in rank.steps]
    return [(k, i) for i in range(len(rank.microbatches)) for k in (FORWARD, BACKWARD)]


@dataclass(slots=True, kw_only=True)
class DecodedSlice:
    """One rank's slice decoded once: the header and every microbatch's arrays, its steps, phases and
    cross edges (`decode_rank`); `plan.slice_check.check_decoded` checks it, the executor runs it."""

    header: plan_pb2.PlanHeader
    rank: int
    microbatches: list[MicrobatchArrays]
    """In `RankPlan.microbatches` order (what ExecStep.microbatch indexes)."""
    steps: list[tuple[int, int]]
    """(kind, index into `microbatches`) per execution step: ExecStep.FORWARD / BACKWARD; index
    -1 for a stand-in of a lock-step plan."""
    standins: list[int]
    """ExecStep.standin of every step (0 on real steps and in free plans)."""
    phases: np.ndarray
    """uint8 [P] header.lockstep_phases (empty in a free plan): steps[i] runs in phase i."""
    edges: list[CrossEdgeArrays]
    """The rank's windows across ranks (RankPlan.cross_edges, increasing id; none in a free plan)."""

    def by_id(self) -> dict[int, MicrobatchArrays]:
        return {a.id: a for a in self.microbatches}


def decode_rank(header: plan_pb2.PlanHeader, rank: plan_pb2.RankPlan) -> DecodedSlice:
    """Every microbatch of a RankPlan decoded once (lengths and index bounds, `decode_microbatch`),
    with its execution steps, phases and cross edges; the rules that need several microbatches are
    `plan.slice_check.check_decoded`'s.

    Raises:
        PlanValidationError: a microbatch id twice, or what `decode_microbatch` finds.
    """
    seen: set[int] = set()
    arrays = []
    for mb in rank.microbatches:
        if mb.id in seen:
            _fail(f"rank {rank.rank}.microbatches", f"microbatch id {mb.id} appears twice")
        seen.add(mb.id)
        arrays.append(decode_microbatch(mb, header.params))
    steps = rank_steps(rank)
    standins = [int(s.standin) for s in rank.steps] or [0] * len(steps)
    return DecodedSlice(header=header, rank=int(rank.rank), microbatches=arrays, steps=steps, standins=standins,
                        phases=lockstep_phases(header), edges=decode_edges(rank))
