"""How old a batch's policy may be (AReaL's max_staleness): the trainer's version against the batch's.

    staleness, factor = staleness_scale(trainer_version, batch_policy_version(plan.header), cfg.staleness)

Torch-free (the trainer's metrics and `harts rl` read it too); docs/design/training-loop.md
("Policy versions and staleness").
"""
from __future__ import annotations

__all__ = ["batch_policy_version", "staleness_scale"]


def staleness_scale(trainer_version: int, batch_version: int | None, cfg) -> tuple[int | None, float]:
    """(staleness, gradient factor) of a batch; factor 0.0 means reject (skip the step).

    staleness = trainer_version - batch_version (None when the batch carries no version: no bound).
    Within `cfg.max_staleness` (or unbounded, -1) the factor is 1; beyond it "reject" gives 0 and
    "downweight" gives decay ** (staleness - max_staleness).
    """
    if batch_version is None:
        return None, 1.0
    s = trainer_version - batch_version
    if cfg.max_staleness < 0 or s <= cfg.max_staleness:
        return s, 1.0
    if cfg.mode == "reject":
        return s, 0.0
    return s, cfg.decay ** (s - cfg.max_staleness)


def batch_policy_version(header) -> int | None:
    """The policy_version a step's batch was sampled with, when the plan carries one."""
    if "policy_version" not in header.DESCRIPTOR.fields_by_name or not header.HasField("policy_version"):
        return None
    return int(header.policy_version)
