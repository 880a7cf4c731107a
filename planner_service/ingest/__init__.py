"""Rollout ingestion: JSON or protobuf rollout batches -> validated prefix `Forest` (docs/design/rollout-forest.md).

    from planner_service.ingest import Limits, forest_from_json, forest_from_proto, warmup
    warmup()                                   # once at start-up: loads/compiles the Numba code
    forest = forest_from_json(body_bytes)      # or a dict / str; raises ValidationError, LimitError
    forest = forest_from_proto(pb_bytes, Limits(max_tokens=10_000_000))

Both input forms (docs/rollouts.md, proto/harts/v1/rollouts.proto) go through one pipeline,
`parse_json` / `parse_proto` -> `RawBatch` -> `check.check_batch` -> `build.build_forest`, so the
same content gives the same Forest in either form; a `ValidationError` names the first offending
field in document order.
"""
from __future__ import annotations

from planner_service.forest import Forest
from planner_service.ingest import json_scan
from planner_service.ingest.build import build_forest
from planner_service.ingest.check import check_batch
from planner_service.ingest.convert import to_json, to_proto
from planner_service.ingest.limits import Limits
from planner_service.ingest.parse_json import load_document, parse_json
from planner_service.ingest.parse_proto import load_batch, parse_proto
from proto.harts.v1 import rollouts_pb2

__all__ = ["Limits", "forest_from_json", "forest_from_proto", "json_to_proto", "proto_to_json", "warmup"]


def forest_from_json(doc: dict | bytes | str, limits: Limits | None = None, *, numba: bool = True) -> Forest:
    """Validate a JSON rollout document and build its prefix forest.

    Args:
        doc: the decoded object, or its JSON text / UTF-8 bytes.
        limits: size limits (defaults: `Limits()`).
        numba: False uses the plain-Python radix builder (tests and benchmarks only).

    Raises:
        ValidationError: the first offending field, e.g. `trajectories[3].loss_mask`.
        LimitError: a size over `limits`, naming the limit.
    """
    limits = limits or Limits()
    raw = check_batch(parse_json(load_document(doc, limits), limits), limits)
    return build_forest(raw, numba=numba, limits=limits)


def forest_from_proto(batch: rollouts_pb2.RolloutBatch | bytes, limits: Limits | None = None, *,
                      numba: bool = True) -> Forest:
    """Validate a protobuf RolloutBatch (message or serialized bytes) and build its prefix forest.

    Same rules, errors and result as `forest_from_json` for the same content.
    """
    limits = limits or Limits()
    raw = check_batch(parse_proto(load_batch(batch, limits), limits), limits)
    return build_forest(raw, numba=numba, limits=limits)


def json_to_proto(doc: dict | bytes | str, limits: Limits | None = None) -> rollouts_pb2.RolloutBatch:
    """The protobuf form of a valid JSON rollout document (raises like `forest_from_json`)."""
    limits = limits or Limits()
    return to_proto(check_batch(parse_json(load_document(doc, limits), limits), limits))


def proto_to_json(batch: rollouts_pb2.RolloutBatch | bytes, limits: Limits | None = None) -> dict:
    """The JSON document of a valid RolloutBatch; inverse of `json_to_proto` up to float32 rounding."""
    limits = limits or Limits()
    return to_json(check_batch(parse_proto(load_batch(batch, limits), limits), limits))


def warmup() -> None:
    """Compile (or load from the Numba cache) the ingestion kernels on a tiny batch."""
    json_scan.warmup()
    forest_from_json({
        "batch_id": "warmup", "vocab_size": 4,
        "trajectories": [{"id": "a", "tokens": [1, 2]}, {"id": "b", "tokens": [1, 3]}],
        "trees": [{"id": "t", "nodes": [{"id": 0, "tokens": [1]}, {"id": 1, "parent": 0, "tokens": [2]}],
                   "trajectories": [{"id": "c", "node": 1}]}],
    })
