"""Sealing and verifying plan slices: deterministic bytes plus a SHA-256 checksum.

The service stores sealed slices and serves those bytes verbatim, so a retry returns identical
bytes; trainers verify the checksum before executing anything.
"""
from __future__ import annotations

import hashlib

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
    """The (unsealed) slice of `plan` for `rank`."""
    if not 0 <= rank < len(plan.ranks):
        raise ValueError(f"rank: expected 0 <= rank < {len(plan.ranks)}, got {rank}")
    out = plan_pb2.PlanSlice()
    out.header.CopyFrom(plan.header)
    out.rank.CopyFrom(plan.ranks[rank])
    return out


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
