"""Content digest of a validated rollout batch: the service's idempotency key.

Two submissions are the same batch when they say the same thing, however they were serialised:
JSON with other whitespace or key order, number spellings (`1.0`, `1e0`), an explicit default,
or the protobuf form of the same content. Ingestion reduces every form to one canonical `Forest`
(`planner_service.ingest`: "the same content gives the same Forest in either form"), so the
digest is a SHA-256 over the forest's fields: every array with its dtype and shape, every string
list with explicit lengths. Floats are hashed as the float32 values the planner uses, so two
spellings that round to the same float32 are the same batch.
See docs/design/service.md ("Idempotency").
"""
from __future__ import annotations

import hashlib

import numpy as np

from planner_service.forest import Forest

__all__ = ["forest_digest", "DIGEST_VERSION"]

DIGEST_VERSION = "content-v2"
"""Prefix of every digest; change it whenever the hashed fields change (v2: policy_version)."""

_ARRAYS = ("tokens", "seg_parent", "seg_offset", "seg_length", "seg_depth", "seg_tree", "traj_seg", "traj_offset",
           "loss_mask", "advantages", "old_logprobs", "ref_logprobs", "reward", "weight")
_STRINGS = ("tree_ids", "traj_ids", "group_ids")


def forest_digest(forest: Forest) -> str:
    """`content-v2:<hex SHA-256>` of everything a plan and a training step can depend on (the
    policy_version included: the trainer's staleness bound reads it from the plan)."""
    h = hashlib.sha256()

    def put(tag: str, data: bytes) -> None:
        h.update(tag.encode())
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)

    put("batch_id", _text(forest.batch_id))
    put("vocab_size", int(forest.vocab_size).to_bytes(8, "little", signed=True))
    put("policy_version", b"none" if forest.policy_version is None else int(forest.policy_version).to_bytes(8, "little"))
    for name in _ARRAYS:
        arr = getattr(forest, name)
        if arr is None:
            put(name, b"none")
            continue
        arr = np.ascontiguousarray(arr)
        put(name, f"{arr.dtype.str}{arr.shape}".encode())
        h.update(memoryview(arr).cast("B"))
    for name in _STRINGS:
        values = getattr(forest, name)
        put(name, len(values).to_bytes(8, "little"))
        for v in values:
            put("", _text(v))
    return f"{DIGEST_VERSION}:{h.hexdigest()}"


def _text(s: str) -> bytes:
    # surrogatepass: a lone surrogate (rejected by ingest, but never a reason to crash here)
    return s.encode("utf-8", "surrogatepass")
