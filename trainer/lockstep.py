"""Lock-step plans on a rank (DESIGN §5.7): the slice's phases and stand-ins, checked before anything runs.

A lock-step plan (`PlanParams.lockstep`) lists P phases (`PlanHeader.lockstep_phases`, uint8
`PhaseKind`) and gives every rank exactly P steps, step p of phase p's kind:

    phase             real step                                  stand-in (microbatch = -1)
    PHASE_FORWARD     FORWARD m (graph-less if m is recomputed)  FORWARD k > 0: keeps its graph for
                                                                 BACKWARD k; FORWARD 0: no graph
    PHASE_BACKWARD    BACKWARD m, m not marked recompute         BACKWARD k, the FORWARD k before it
    PHASE_RECOMPUTE   BACKWARD m, m marked recompute (its        BACKWARD 0: forward and backward
                      forward re-runs inside the step)            of a stand-in here

A stand-in is one row (token 0, occurrence 0, no log-prob entries: `standin_microbatch`) whose loss
is an exact zero, run through every FSDP unit, so that every rank issues the same FSDP2
collectives in every phase: per unit one all-gather per forward, one per backward, one
reduce-scatter per backward, in the same order (`trainer.parallelize`).

    steps = lockstep_steps(header, rank, recompute=lambda i: arrays[i].recompute)
    real = without_standins(rank)        # what plan.slice_check.check_rank checks (depth-first order)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from proto.arrays import pack, unpack
from proto.harts.v1 import plan_pb2

__all__ = ["LockstepStep", "lockstep_phases", "lockstep_steps", "without_standins", "standin_microbatch",
           "PHASE_NAMES"]

FORWARD, BACKWARD = plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD
PHASE_NAMES = {plan_pb2.PHASE_FORWARD: "PHASE_FORWARD", plan_pb2.PHASE_BACKWARD: "PHASE_BACKWARD",
               plan_pb2.PHASE_RECOMPUTE: "PHASE_RECOMPUTE"}


@dataclass(slots=True, frozen=True)
class LockstepStep:
    """One phase's step on this rank."""

    phase: int
    """PhaseKind of the phase."""
    kind: int
    """ExecStep.FORWARD or ExecStep.BACKWARD."""
    index: int
    """Index into RankPlan.microbatches; -1 for a stand-in."""
    standin: int
    """Stand-in pairing id (0: unpaired, see the module table); 0 on real steps."""


def lockstep_phases(header: plan_pb2.PlanHeader) -> np.ndarray:
    """uint8 [P] PhaseKind of every phase of a lock-step plan."""
    phases = unpack(header.lockstep_phases, "uint8", name="header.lockstep_phases")
    bad = np.flatnonzero(phases > plan_pb2.PHASE_RECOMPUTE)
    if bad.shape[0]:
        raise ValueError(f"header.lockstep_phases[{int(bad[0])}]: expected a PhaseKind (0, 1 or 2), got {int(phases[bad[0]])}")
    return phases


def lockstep_steps(header: plan_pb2.PlanHeader, rank: plan_pb2.RankPlan,
                   recompute: Callable[[int], bool]) -> list[LockstepStep]:
    """The rank's steps, one per phase, checked against the phase kinds (see the module table).

    Args:
        recompute: whether microbatch index i is marked `recompute`.
    Raises:
        ValueError: a step count other than P, a step of another kind than its phase, a stand-in
            without its pair; the message names `rank r.steps[p]` and the phase.
    """
    phases = lockstep_phases(header)
    where = f"rank {rank.rank}.steps"
    if len(rank.steps) != phases.shape[0]:
        raise ValueError(f"{where}: expected {phases.shape[0]} steps (one per lock-step phase), got {len(rank.steps)}")
    M = len(rank.microbatches)
    open_: set[int] = set()
    out = []
    for p, (phase, s) in enumerate(zip(phases.tolist(), rank.steps)):
        at = f"{where}[{p}] ({PHASE_NAMES[phase]})"
        want = FORWARD if phase == plan_pb2.PHASE_FORWARD else BACKWARD
        if s.kind != want:
            raise ValueError(f"{at}: expected a {plan_pb2.ExecStep.Kind.Name(want)} step, got "
                             f"{plan_pb2.ExecStep.Kind.Name(s.kind)}")
        k = int(s.standin)
        if s.microbatch >= 0:
            if s.microbatch >= M:
                raise ValueError(f"{at}: expected a microbatch index < {M}, got {s.microbatch}")
            if k:
                raise ValueError(f"{at}: expected standin 0 on a real step, got {k}")
            if phase != plan_pb2.PHASE_FORWARD and recompute(s.microbatch) != (phase == plan_pb2.PHASE_RECOMPUTE):
                marked = "marked" if recompute(s.microbatch) else "not marked"
                raise ValueError(f"{at}: backward of microbatch {rank.microbatches[s.microbatch].id}, {marked} recompute, "
                                 f"in a {PHASE_NAMES[phase]} phase")
        elif s.microbatch != -1:
            raise ValueError(f"{at}: expected a microbatch index >= 0 or -1 (a stand-in), got {s.microbatch}")
        elif k < 0:
            raise ValueError(f"{at}: expected a stand-in id >= 0, got {k}")
        elif phase == plan_pb2.PHASE_FORWARD and k:
            if k in open_:
                raise ValueError(f"{at}: stand-in {k} forwarded twice")
            open_.add(k)
        elif phase == plan_pb2.PHASE_BACKWARD:
            if k not in open_:
                raise ValueError(f"{at}: expected the BACKWARD of an open FORWARD stand-in, got stand-in {k} "
                                 f"(open: {sorted(open_)})")
            open_.discard(k)
        elif phase == plan_pb2.PHASE_RECOMPUTE and k:
            raise ValueError(f"{at}: expected stand-in 0 (forward and backward in this phase), got {k}")
        out.append(LockstepStep(phase=phase, kind=want, index=int(s.microbatch), standin=k))
    if open_:
        raise ValueError(f"{where}: FORWARD stand-ins {sorted(open_)} have no BACKWARD")
    return out


def without_standins(rank: plan_pb2.RankPlan) -> plan_pb2.RankPlan:
    """A copy of the rank plan without its stand-in steps: the real steps in their order."""
    out = plan_pb2.RankPlan(rank=rank.rank)
    out.microbatches.extend(rank.microbatches)
    out.steps.extend(s for s in rank.steps if s.microbatch >= 0)
    return out


def standin_microbatch(*, conv_kernel: int) -> plan_pb2.Microbatch:
    """The one-row stand-in: token 0 at depth 0, occurrence 0, a duplicated segment, one linear
    sequence from a zero state and no log-prob entries, so its loss and gradients are exact zeros."""
    one = lambda v: pack([v], "int32")  # noqa: E731
    mb = plan_pb2.Microbatch(
        id=-1, num_rows=1, tokens=one(0), depth=one(0), occurrence=one(0), seg_start=one(0), seg_length=one(1),
        seg_parent=one(-1), seg_tree=one(0), seg_forest=one(0), seg_forest_offset=one(0),
        seg_duplicated=pack([1], "uint8"), conv_ancestors=pack([-1] * max(conv_kernel - 1, 0), "int32"),
        attn_offsets=pack([0, 0], "int32"), num_states=0,
    )
    seq = mb.linear_calls.add().sequences.add(row_start=0, row_end=1, start_depth=0)
    seq.init_state.kind = plan_pb2.StateSource.ZERO
    return mb
