"""Sealing and verifying plan slices: deterministic bytes plus a SHA-256 checksum.

The service stores sealed slices and serves those bytes verbatim, so a retry returns identical
bytes; trainers verify the checksum before executing anything (docs/design/plan-contract.md,
"Slices and sealing").
"""
from __future__ import annotations

import hashlib

import numpy as np

from proto.arrays import pack, unpack
from proto.harts.v1 import plan_pb2

PLAN_VERSION = "harts.plan.v1"


class ChecksumError(ValueError):
    """A plan slice whose checksum does not match its contents."""


def _digest(slice_: plan_pb2.PlanSlice) -> str:
    unsealed = plan_pb2.PlanSlice()
    unsealed.CopyFrom(slice_)
    unsealed.checksum = ""
    return hashlib.sha256(unsealed.SerializeToString(deterministic=True)).hexdigest()


def slice_plan(plan: plan_pb2.Plan, rank: int) -> plan_pb2.PlanSlice:
    """The (unsealed) slice of `plan` for `rank`: its rank plan and a header restricted to it.

    The slice's size depends on its own rank's work only, not on the world size or the rest of
    the step: `stats.rank_costs` (and `rank_transfer_costs`) hold its own rank's cost; the trajectory table (ids, lengths,
    per-trajectory normalisers) and the tree table list only the trajectories and trees its
    microbatches refer to, `lp_traj` and `seg_tree` index those local tables, and
    `header.trajectory_index` / `tree_index` map them back to the step's (`local_tables`).
    Step-wide scalars (normalisers' totals, params, the other stats) and the lock-step phases are kept.
    """
    if not 0 <= rank < len(plan.ranks):
        raise ValueError(f"rank: expected 0 <= rank < {len(plan.ranks)}, got {rank}")
    src = plan.header
    out = plan_pb2.PlanSlice()
    h = out.header
    h.version, h.step_id = src.version, src.step_id
    h.params.CopyFrom(src.params)
    h.lockstep_phases = src.lockstep_phases  # every rank runs every phase
    h.stats.CopyFrom(src.stats)
    del h.stats.rank_costs[:]
    if rank < len(src.stats.rank_costs):
        h.stats.rank_costs.append(src.stats.rank_costs[rank])
    del h.stats.rank_transfer_costs[:]
    if rank < len(src.stats.rank_transfer_costs):
        h.stats.rank_transfer_costs.append(src.stats.rank_transfer_costs[rank])
    out.rank.CopyFrom(plan.ranks[rank])
    mbs = out.rank.microbatches
    trajs = _local_table(mbs, "lp_traj")
    trees = _local_table(mbs, "seg_tree")
    n = src.normalizers
    h.normalizers.total_loss_tokens = n.total_loss_tokens
    h.normalizers.num_trajectories = n.num_trajectories
    h.normalizers.traj_loss_tokens = pack(unpack(n.traj_loss_tokens, "float32")[trajs], "float32")
    h.normalizers.traj_weight = pack(unpack(n.traj_weight, "float32")[trajs], "float32")
    h.trajectory_ids.extend(src.trajectory_ids[int(t)] for t in trajs)
    h.trajectory_lengths = pack(unpack(src.trajectory_lengths, "int32")[trajs], "int32")
    h.tree_ids.extend(src.tree_ids[int(t)] for t in trees)
    h.trajectory_index = pack(trajs, "int32")
    h.tree_index = pack(trees, "int32")
    if src.HasField("policy_version"):
        h.policy_version = src.policy_version
    if len(src.trajectory_rewards):
        h.trajectory_rewards = pack(unpack(src.trajectory_rewards, "float32")[trajs], "float32")
    h.local_tables = True
    return out


def _local_table(mbs, field: str) -> np.ndarray:
    """Sorted distinct step-wide indices in the microbatches' `field` (int32 bytes), rewriting
    each microbatch's field to index that local table."""
    cols = [unpack(getattr(mb, field), "int32") for mb in mbs]
    used = np.unique(np.concatenate(cols)) if cols else np.zeros(0, np.int32)
    for mb, col in zip(mbs, cols):
        if col.shape[0]:
            setattr(mb, field, pack(np.searchsorted(used, col), "int32"))
    return used.astype(np.int64)


def seal(slice_: plan_pb2.PlanSlice) -> bytes:
    """Set the checksum and return the deterministic serialisation."""
    slice_.checksum = _digest(slice_)
    return slice_.SerializeToString(deterministic=True)


def open_sealed(data: bytes) -> plan_pb2.PlanSlice:
    """Parse sealed slice bytes and verify the checksum.

    Raises:
        ChecksumError: the bytes were altered, truncated or never sealed.
    """
    slice_ = plan_pb2.PlanSlice()
    try:
        slice_.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError; any parse failure is corruption here
        raise ChecksumError(f"plan slice does not parse: {exc}") from exc
    want = _digest(slice_)
    if slice_.checksum != want:
        raise ChecksumError(f"plan slice checksum mismatch: expected {want}, got {slice_.checksum or '(none)'}")
    return slice_
