"""Parsing pass over a protobuf `RolloutBatch`: the twin of `parse_json` for the binary body.

Same walk, same rules, same sort keys; arrays stay as their little-endian `bytes` and are decoded
in one `numpy.frombuffer` per field by `check.check_batch`. Per-position arrays use the proto
field names in error paths (`trajectories[2].advantages`; docs/design/rollout-forest.md).
"""
from __future__ import annotations

import math

from google.protobuf.message import DecodeError

from planner_service.errors import ValidationError
from planner_service.ingest.batch import NODE_FIELDS, RANK, Column, RawBatch, Stop, Walk
from planner_service.ingest.limits import Limits
from proto.harts.v1 import rollouts_pb2

_ITEM = {"token": 4, "mask": 1, "float": 4}
_TYPE = {"token": "int32", "mask": "uint8", "float": "float32"}


def load_batch(batch: rollouts_pb2.RolloutBatch | bytes | bytearray, limits: Limits) -> rollouts_pb2.RolloutBatch:
    """Decode protobuf bytes (size-checked) into a RolloutBatch."""
    if isinstance(batch, rollouts_pb2.RolloutBatch):
        return batch
    if not isinstance(batch, (bytes, bytearray, memoryview)):
        raise ValidationError("", f"expected a RolloutBatch or its bytes, got {type(batch).__name__}")
    limits.check("max_body_bytes", len(batch), "bytes of protobuf")
    msg = rollouts_pb2.RolloutBatch()
    try:
        msg.ParseFromString(bytes(batch))
    except DecodeError as exc:
        raise ValidationError("", f"expected a serialized harts.v1.RolloutBatch, got undecodable bytes ({exc})") from None
    return msg


def parse_proto(batch: rollouts_pb2.RolloutBatch, limits: Limits) -> RawBatch:
    """One parsing pass over a decoded RolloutBatch (see `parse_json`)."""
    raw = RawBatch(source="proto")
    for name, kind in (("tokens", "token"), ("loss_mask", "mask"), ("old_logprobs", "float"),
                       ("ref_logprobs", "float"), ("advantages", "float")):
        raw.columns["advantage" if name == "advantages" else name] = Column(name, kind)
    return _Walk(raw, limits).parse(batch)


class _Walk(Walk):

    def string(self, value: str, key: tuple, field: str, *, required: bool) -> str:
        if required and not value:
            raise Stop(key, field, "expected a non-empty string, got an empty one")
        if len(value) > self.limits.max_id_length:
            raise Stop(key, field, f"expected at most {self.limits.max_id_length} characters (Limits.max_id_length), got {len(value)}")
        return value

    def number(self, value: float, key: tuple, field: str) -> float:
        if not math.isfinite(value):
            raise Stop(key, field, f"expected a finite float32, got {value!r}")
        return value

    def array(self, data: bytes, kind: str, key: tuple, field: str, length: int | None) -> int:
        """Check the byte length of an array field; returns its element count."""
        item = _ITEM[kind]
        if length is not None and len(data) != item * length:
            raise Stop(key, field, f"expected {item * length} bytes ({length} {_TYPE[kind]}, one per token), got {len(data)}")
        if len(data) % item:
            raise Stop(key, field, f"expected a multiple of {item} bytes ({_TYPE[kind]}), got {len(data)}")
        return len(data) // item

    def run(self, batch: rollouts_pb2.RolloutBatch) -> None:
        raw = self.raw
        raw.batch_id = self.string(batch.batch_id, (0,), "batch_id", required=True)
        if batch.vocab_size < 1:
            raise Stop((1,), "vocab_size", f"expected an integer >= 1, got {batch.vocab_size}")
        raw.vocab_size = batch.vocab_size
        if batch.HasField("policy_version"):
            if batch.policy_version < 0:
                raise Stop((1, 1), "policy_version", f"expected an integer >= 0, got {batch.policy_version}")
            raw.policy_version = batch.policy_version
        self.limits.check("max_trajectories", len(batch.trajectories), "trajectories", "trajectories")
        self.limits.check("max_trees", len(batch.trees), "trees", "trees")
        for j, traj in enumerate(batch.trajectories):
            self.flat_trajectory(j, traj)
        for k, tree in enumerate(batch.trees):
            self.tree(k, tree)
        if not raw.traj_ids:
            raise Stop((5,), "trajectories", "expected at least one trajectory (flat or in a tree), got none")

    def trajectory_id(self, tid: str, key: tuple, path: str) -> None:
        self.add_trajectory_id(self.string(tid, key + (0,), f"{path}.id", required=True), key + (0,), path)

    def per_position(self, slot: str, data: bytes, key: tuple, path: str, length: int | None) -> None:
        col = self.raw.columns[slot]
        self.array(data, col.kind, key + (col.rank,), f"{path}.{col.name}", length)
        col.owners.append(len(self.raw.traj_ids) - 1)
        col.raw.append(data)

    def common(self, traj, key: tuple, path: str, length: int | None, node_fields: frozenset[str] | None = None) -> None:
        raw = self.raw
        self.tree_field_clash("loss_mask", bool(traj.loss_mask), node_fields, key, path)
        if traj.loss_mask:
            self.per_position("loss_mask", traj.loss_mask, key, path, length)
        for name in ("old_logprobs", "ref_logprobs"):
            data = getattr(traj, name)
            has = self.tree_field_clash(name, bool(data), node_fields, key, path)
            first = self.presence.setdefault(name, (has, path))
            if first[0] != has:
                raise Stop(key + (RANK[name],), f"{path}.{name}",
                           f"expected {name} on every trajectory or on none ({first[1]} "
                           f"{'has' if first[0] else 'has none'}), got "
                           f"{'some' if data else 'values on its tree nodes' if has else 'none'}")
            if data:
                self.per_position(name, data, key, path, length)
        if traj.advantages:
            self.per_position("advantage", traj.advantages, key, path, length)
            raw.adv_scalar.append(0.0)
        else:
            raw.adv_scalar.append(self.number(traj.advantage, key + (RANK["advantage"],), f"{path}.advantage"))
        raw.reward.append(self.number(traj.reward, key + (RANK["reward"],), f"{path}.reward"))
        raw.group_ids.append(self.string(traj.group_id, key + (RANK["group_id"],), f"{path}.group_id", required=False))
        weight = None
        if traj.HasField("weight"):
            weight = self.number(traj.weight, key + (RANK["weight"],), f"{path}.weight")
            if weight < 0:
                raise Stop(key + (RANK["weight"],), f"{path}.weight", f"expected a weight >= 0, got {weight!r}")
        raw.weight.append(weight)

    def flat_trajectory(self, j: int, traj: rollouts_pb2.Trajectory) -> None:
        raw = self.raw
        key, path = (2, j), f"trajectories[{j}]"
        self.trajectory_id(traj.id, key, path)
        raw.traj_tree.append(-1)
        raw.traj_index.append(j)
        raw.flat_tree_name.append(self.string(traj.tree_id, key + (1,), f"{path}.tree_id", required=False))
        n = self.array(traj.tokens, "token", key + (2,), f"{path}.tokens", None)
        if n == 0:
            raise Stop(key + (2,), f"{path}.tokens", "expected at least one token id, got an empty array")
        self.limits.check("max_trajectory_length", n, "tokens in one trajectory", f"{path}.tokens")
        self.total_tokens += n
        self.limits.check("max_tokens", self.total_tokens, "expanded tokens", f"{path}.tokens")
        col = raw.columns["tokens"]
        col.owners.append(len(raw.traj_ids) - 1)
        col.raw.append(traj.tokens)
        self.common(traj, key, path, n)

    def tree(self, k: int, tree: rollouts_pb2.RolloutTree) -> None:
        raw = self.raw
        key, path = (3, k), f"trees[{k}]"
        tid = self.string(tree.id, key + (0,), f"{path}.id", required=True)
        raw.tree_ids.append(tid)  # uniqueness: check.py
        if not tree.nodes:
            raise Stop(key + (1,), f"{path}.nodes", "expected a list of at least one node, got list of 0")
        for j, node in enumerate(tree.nodes):
            nkey, npath = (3, k, 1, j), f"{path}.nodes[{j}]"
            n = self.array(node.tokens, "token", nkey + (2,), f"{npath}.tokens", None)
            if n == 0:
                raise Stop(nkey + (2,), f"{npath}.tokens", "expected at least one token id, got an empty array")
            self.total_nodes += 1
            self.limits.check("max_nodes", self.total_nodes, "tree nodes", npath)
            self.total_node_tokens += n
            self.limits.check("max_node_tokens", self.total_node_tokens, "tree-node tokens", f"{npath}.tokens")
            raw.node_tree.append(k)
            raw.node_index.append(j)
            raw.node_id.append(node.id)
            raw.node_parent.append(node.parent if node.HasField("parent") else None)
            raw.node_tokens.owners.append(len(raw.node_id) - 1)
            raw.node_tokens.raw.append(node.tokens)
            for name in NODE_FIELDS:
                data = getattr(node, name)
                self.node_field(k, j, name, bool(data), nkey, npath)
                if data:
                    col = raw.node_columns[name]
                    self.array(data, col.kind, nkey + (RANK[name],), f"{npath}.{name}", n)
                    col.owners.append(len(raw.node_id) - 1)
                    col.raw.append(data)
        raw.trees_complete = k + 1
        node_fields = self.end_nodes(k)
        for j, traj in enumerate(tree.trajectories):
            tkey, tpath = (3, k, 2, j), f"{path}.trajectories[{j}]"
            self.trajectory_id(traj.id, tkey, tpath)
            raw.traj_tree.append(k)
            raw.traj_index.append(j)
            raw.traj_node_id.append(traj.node)
            self.common(traj, tkey, tpath, None, node_fields)
