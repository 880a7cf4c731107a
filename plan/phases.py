"""What a lock-step schedule means (PlanParams.lockstep): phases, stand-ins, their rules and costs.

    phases = lockstep_phases(header)                              # uint8 [P] of PhaseKind; empty: a free plan
    check_rank_phases(where, phases, steps, recompute)            # one rank: one step per phase, of its kind
    cost = step_cost(phase, microbatch_cost)                      # FORWARD_SHARE forward, the rest backward

Shared by the planner (the report), the fast slice check and the oracle validator, like
`plan.header`; the rules and the cost model: docs/design/lockstep.md.
Legend: P phases, W ranks, n steps of a rank.
"""
from __future__ import annotations

import numpy as np

from plan.microbatch import PlanValidationError
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2

__all__ = ["FORWARD_SHARE", "PHASE_NAMES", "check_rank_phases", "lockstep_phases", "phase_counts", "step_cost"]

#: Share of a microbatch's cost spent in its forward (the usual 1:2 forward:backward FLOP ratio).
FORWARD_SHARE = 1.0 / 3.0

PHASE_FORWARD, PHASE_BACKWARD, PHASE_RECOMPUTE = plan_pb2.PHASE_FORWARD, plan_pb2.PHASE_BACKWARD, plan_pb2.PHASE_RECOMPUTE
PHASE_NAMES = {PHASE_FORWARD: "PHASE_FORWARD", PHASE_BACKWARD: "PHASE_BACKWARD", PHASE_RECOMPUTE: "PHASE_RECOMPUTE"}
_STEP_NAMES = {plan_pb2.ExecStep.FORWARD: "FORWARD", plan_pb2.ExecStep.BACKWARD: "BACKWARD"}


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")


def lockstep_phases(header: plan_pb2.PlanHeader) -> np.ndarray:
    """uint8 [P] the phase kinds of a lock-step plan or slice ([0] in a free plan).

    Raises:
        PlanValidationError: phases in a free plan, none in a lock-step plan, or an unknown kind.
    """
    phases = unpack(header.lockstep_phases, "uint8")
    if not header.params.lockstep:
        if phases.shape[0]:
            _fail("header.lockstep_phases", f"expected none in a free plan (params.lockstep false), got {phases.shape[0]}")
        return phases
    if (phases > PHASE_RECOMPUTE).any():
        i = int(np.flatnonzero(phases > PHASE_RECOMPUTE)[0])
        _fail(f"header.lockstep_phases[{i}]", f"expected a PhaseKind (0, 1 or 2), got {int(phases[i])}")
    return phases


def check_rank_phases(where: str, phases: np.ndarray, steps: list[tuple[int, int, int]], recompute: list[bool]) -> None:
    """Check one rank's steps against the phases (docs/design/lockstep.md, "The rules").

    Args:
        where: e.g. "rank 3", for the messages.
        phases: uint8 [P] `lockstep_phases`.
        steps: (ExecStep.kind, microbatch index or -1, standin) of each step, in order.
        recompute: the `recompute` flag of every microbatch index of the rank.

    Raises:
        PlanValidationError: naming the step, e.g. "rank 0.steps[17]: expected a PHASE_BACKWARD
            step (BACKWARD), got FORWARD".
    """
    P = phases.shape[0]
    if len(steps) != P:
        _fail(f"{where}.steps", f"expected {P} steps, one per phase of header.lockstep_phases, got {len(steps)}")
    open_at: dict[int, int] = {}  # stand-in id -> the step of its FORWARD
    used: set[int] = set()
    for i, ((kind, m, standin), phase) in enumerate(zip(steps, phases.tolist())):
        w = f"{where}.steps[{i}]"
        want = plan_pb2.ExecStep.FORWARD if phase == PHASE_FORWARD else plan_pb2.ExecStep.BACKWARD
        if kind != want:
            _fail(w, f"expected a {PHASE_NAMES[phase]} step ({_STEP_NAMES[want]}), got {_STEP_NAMES.get(kind, kind)}")
        if m >= len(recompute):
            _fail(w, f"expected a microbatch index < {len(recompute)} or -1 (stand-in), got {m}")
        if m >= 0:
            if standin:
                _fail(w, f"expected standin 0 on a real step, got {standin}")
            if phase == PHASE_BACKWARD and recompute[m]:
                _fail(w, f"expected a microbatch not marked recompute in a PHASE_BACKWARD phase, got index {m} (recompute)")
            if phase == PHASE_RECOMPUTE and not recompute[m]:
                _fail(w, f"expected a microbatch marked recompute in a PHASE_RECOMPUTE phase, got index {m} (not recompute)")
            continue
        if m != -1:
            _fail(w, f"expected a microbatch index < {len(recompute)} or -1 (stand-in), got {m}")
        if standin < 0:
            _fail(w, f"expected a stand-in id >= 0, got {standin}")
        if phase == PHASE_FORWARD:
            if standin:
                if standin in used:
                    _fail(w, f"stand-in id {standin} is used twice for a FORWARD (each id pairs one FORWARD with one BACKWARD)")
                used.add(standin)
                open_at[standin] = i
        elif phase == PHASE_BACKWARD:
            if standin not in open_at:
                _fail(w, f"expected a BACKWARD stand-in paired with an earlier FORWARD stand-in (id > 0), got id {standin}")
            del open_at[standin]
        elif standin:
            _fail(w, f"expected standin 0 for a PHASE_RECOMPUTE stand-in (it runs its own forward), got {standin}")
    if open_at:
        k, i = min(open_at.items(), key=lambda x: x[1])
        _fail(f"{where}.steps[{i}]", f"FORWARD stand-in {k} has no BACKWARD stand-in later on this rank")


def step_cost(phase: int, microbatch_cost: float) -> float:
    """Cost of a real step of `phase` for a microbatch of `microbatch_cost` (a stand-in costs 0)."""
    if phase == PHASE_FORWARD:
        return FORWARD_SHARE * microbatch_cost
    if phase == PHASE_BACKWARD:
        return (1.0 - FORWARD_SHARE) * microbatch_cost
    return microbatch_cost


def phase_counts(phases: np.ndarray) -> tuple[int, int, int]:
    """(PHASE_FORWARD, PHASE_BACKWARD, PHASE_RECOMPUTE) phases: PlanStats.lockstep_*_phases."""
    counts = np.bincount(np.asarray(phases, np.int64), minlength=3)
    return int(counts[PHASE_FORWARD]), int(counts[PHASE_BACKWARD]), int(counts[PHASE_RECOMPUTE])
