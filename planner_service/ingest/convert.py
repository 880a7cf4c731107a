"""Lossless conversion between the JSON document and the protobuf `RolloutBatch` of a batch.

Both directions go through a checked `RawBatch`, so only valid batches convert and the two forms
of one batch build the same Forest (floats travel as float32 either way). Absent optional fields
stay absent (loss_mask, log-probs, weight); a per-token advantage list is `advantage` in JSON and
`advantages` in protobuf; per-node fields of the compact tree form stay on the nodes (docs/rollouts.md).
"""
from __future__ import annotations

import numpy as np

from planner_service.ingest.batch import NODE_FIELDS, Column, RawBatch
from proto import arrays
from proto.harts.v1 import rollouts_pb2

_PER_POSITION = ("loss_mask", "old_logprobs", "ref_logprobs", "advantage")
_PROTO_NAME = {"loss_mask": "loss_mask", "old_logprobs": "old_logprobs", "ref_logprobs": "ref_logprobs",
               "advantage": "advantages"}
_DTYPE = {"token": "int32", "mask": "uint8", "float": "float32"}


def _entries(col: Column, T: int) -> np.ndarray:
    """int64 [T] entry index of each trajectory in `col`, -1 where absent."""
    idx = np.full(T, -1, np.int64)
    idx[np.asarray(col.owners, np.int64)] = np.arange(len(col.owners))
    return idx


def _slice(col: Column, e: int) -> np.ndarray:
    return col.values[col.offsets[e] : col.offsets[e + 1]]


def _per_position(raw: RawBatch, entries: dict[str, np.ndarray], g: int):
    """(slot, column, entry) of each per-position field trajectory g has."""
    for slot in _PER_POSITION:
        e = int(entries[slot][g])
        if e >= 0:
            yield slot, raw.columns[slot], e


def to_proto(raw: RawBatch) -> rollouts_pb2.RolloutBatch:
    """The RolloutBatch of a checked batch."""
    T = len(raw.traj_ids)
    entries = {slot: _entries(raw.columns[slot], T) for slot in _PER_POSITION}
    out = rollouts_pb2.RolloutBatch(batch_id=raw.batch_id, vocab_size=raw.vocab_size)
    if raw.policy_version is not None:
        out.policy_version = raw.policy_version
    tokens = raw.columns["tokens"]

    def fill(msg, g: int) -> None:
        for slot, col, e in _per_position(raw, entries, g):
            setattr(msg, _PROTO_NAME[slot], arrays.pack(_slice(col, e), _DTYPE[col.kind]))
        if entries["advantage"][g] < 0:
            msg.advantage = raw.adv_scalar[g]
        msg.reward = raw.reward[g]
        msg.group_id = raw.group_ids[g]
        if raw.weight[g] is not None:
            msg.weight = raw.weight[g]

    for g in range(raw.n_flat):
        msg = out.trajectories.add(id=raw.traj_ids[g], tree_id=raw.flat_tree_name[g],
                                   tokens=arrays.pack(_slice(tokens, g), "int32"))
        fill(msg, g)
    trees = [out.trees.add(id=tid) for tid in raw.tree_ids]
    nodes = raw.node_tokens
    node_entries = {name: _entries(raw.node_columns[name], len(raw.node_id)) for name in NODE_FIELDS}
    for n, k in enumerate(raw.node_tree):
        node = trees[k].nodes.add(id=raw.node_id[n], tokens=arrays.pack(_slice(nodes, n), "int32"))
        if raw.node_parent[n] is not None:
            node.parent = raw.node_parent[n]
        for name, col in raw.node_columns.items():
            e = int(node_entries[name][n])
            if e >= 0:
                setattr(node, name, arrays.pack(_slice(col, e), _DTYPE[col.kind]))
    for g in range(raw.n_flat, T):
        msg = trees[raw.traj_tree[g]].trajectories.add(id=raw.traj_ids[g], node=raw.traj_node_id[g - raw.n_flat])
        fill(msg, g)
    return out


def to_json(raw: RawBatch) -> dict:
    """The JSON document of a checked batch (docs/rollouts.md)."""
    T = len(raw.traj_ids)
    entries = {slot: _entries(raw.columns[slot], T) for slot in _PER_POSITION}
    tokens = raw.columns["tokens"]

    def fields(g: int) -> dict:
        obj = {}
        for slot, col, e in _per_position(raw, entries, g):
            values = _slice(col, e)
            obj[slot] = values.astype(np.uint8 if col.kind == "mask" else np.float32).tolist()
        if entries["advantage"][g] < 0:
            obj["advantage"] = float(np.float32(raw.adv_scalar[g]))
        obj["reward"] = float(np.float32(raw.reward[g]))
        if raw.group_ids[g]:
            obj["group_id"] = raw.group_ids[g]
        if raw.weight[g] is not None:
            obj["weight"] = float(np.float32(raw.weight[g]))
        return obj

    doc: dict = {"batch_id": raw.batch_id, "vocab_size": raw.vocab_size}
    if raw.policy_version is not None:
        doc["policy_version"] = raw.policy_version
    flat = []
    for g in range(raw.n_flat):
        obj = {"id": raw.traj_ids[g]}
        if raw.flat_tree_name[g]:
            obj["tree_id"] = raw.flat_tree_name[g]
        obj["tokens"] = _slice(tokens, g).tolist()
        obj.update(fields(g))
        flat.append(obj)
    if flat:
        doc["trajectories"] = flat
    trees = [{"id": tid, "nodes": [], "trajectories": []} for tid in raw.tree_ids]
    nodes = raw.node_tokens
    node_entries = {name: _entries(raw.node_columns[name], len(raw.node_id)) for name in NODE_FIELDS}
    for n, k in enumerate(raw.node_tree):
        node = {"id": raw.node_id[n], "parent": raw.node_parent[n], "tokens": _slice(nodes, n).tolist()}
        for name, col in raw.node_columns.items():
            e = int(node_entries[name][n])
            if e >= 0:
                node[name] = _slice(col, e).astype(np.uint8 if col.kind == "mask" else np.float32).tolist()
        trees[k]["nodes"].append(node)
    for g in range(raw.n_flat, T):
        obj = {"id": raw.traj_ids[g], "node": raw.traj_node_id[g - raw.n_flat]}
        obj.update(fields(g))
        trees[raw.traj_tree[g]]["trajectories"].append(obj)
    if trees:
        doc["trees"] = trees
    return doc
