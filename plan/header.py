"""The step-wide header rules of a plan or slice (version, parameters, phases, trajectory table, normalisers).

Shared by the fast slice check (`plan.slice_check`) and the oracle validator (`plan.validator`),
so that neither imports the other (docs/design/plan-contract.md, "The header").
"""
from __future__ import annotations

import numpy as np

from plan.microbatch import PlanValidationError
from plan.phases import lockstep_phases
from plan.seal import PLAN_VERSION
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2

__all__ = ["check_header"]


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")


def check_header(header: plan_pb2.PlanHeader) -> None:
    """Check the step-wide header of a plan or slice: version, parameters, trajectory table,
    normalisers, lock-step phases (plan.phases.lockstep_phases)."""
    if header.version != PLAN_VERSION:
        _fail("header.version", f"expected {PLAN_VERSION!r}, got {header.version!r}")
    p = header.params
    c = p.chunk_size
    if c < 1 or c & (c - 1):
        _fail("header.params.chunk_size", f"expected a power of two, got {c}")
    if p.conv_kernel < 1 or p.vocab_size < 1 or p.world_size < 1:
        _fail("header.params", "expected conv_kernel, vocab_size and world_size >= 1")
    lockstep_phases(header)
    T = len(header.trajectory_ids)
    try:
        lengths = unpack(header.trajectory_lengths, "int32", name="header.trajectory_lengths")
    except ValueError as exc:
        raise PlanValidationError(str(exc)) from None
    if lengths.shape[0] != T:
        _fail("header.trajectory_lengths", f"expected {T} entries, got {lengths.shape[0]}")
    n = header.normalizers
    local = header.local_tables
    if not local and n.num_trajectories != T:
        _fail("header.normalizers.num_trajectories", f"expected {T}, got {n.num_trajectories}")
    for name in ("traj_loss_tokens", "traj_weight"):
        a = unpack(getattr(n, name), "float32", name=f"header.normalizers.{name}")
        if a.shape[0] != T:
            _fail(f"header.normalizers.{name}", f"expected {T} entries, got {a.shape[0]}")
    tl = unpack(n.traj_loss_tokens, "float32")
    total = float(tl.astype(np.float64).sum())
    if (abs(total - n.total_loss_tokens) if not local else total - n.total_loss_tokens) > 1e-6 * max(1.0, n.total_loss_tokens):
        _fail("header.normalizers.total_loss_tokens", f"expected {'the sum' if not local else 'at least the sum'} of traj_loss_tokens {total}, got {n.total_loss_tokens}")
    for name, size, limit in (("trajectory_index", T, n.num_trajectories), ("tree_index", len(header.tree_ids), None)):
        index = unpack(getattr(header, name), "int32", name=f"header.{name}")
        if not local:
            if index.shape[0]:
                _fail(f"header.{name}", "expected none in a whole plan (its tables are the step's)")
            continue
        if index.shape[0] != size or (index.shape[0] and ((np.diff(index) <= 0).any() or index[0] < 0 or (limit is not None and index[-1] >= limit))):
            _fail(f"header.{name}", f"expected {size} increasing step-wide indices{f' below {limit}' if limit is not None else ''}")
