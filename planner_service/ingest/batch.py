"""The source-independent form of a rollout batch between parsing and validation (`RawBatch`).

    raw = parse_json(load_document(body, limits), limits)     # or parse_proto: a RawBatch, one pass
    raw = check.check_batch(raw, limits)                       # arrays validated and materialised

Per-position arrays stay raw (JSON lists or protobuf bytes) in `Column`s until `check_batch`;
every problem goes to a `FirstError` with a sort key in document order, so the error names the
first offending field (docs/design/rollout-forest.md, "How a forest is built").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from planner_service.errors import ValidationError

#: Order of the fields inside one trajectory / node object (document order for "first field").
RANK = {
    "id": 0, "tree_id": 1, "tokens": 2, "node": 2, "parent": 1,
    "loss_mask": 3, "old_logprobs": 4, "ref_logprobs": 5, "advantage": 6, "advantages": 6,
    "reward": 7, "group_id": 8, "weight": 9,
}

#: Largest finite float32, the type every float field is stored in.
F32_MAX = float(np.finfo(np.float32).max)


class Stop(Exception):
    """The parsing pass met a problem: `key` orders it among all problems of the batch."""

    def __init__(self, key: tuple, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.key, self.field, self.message = key, field, message


class FirstError:
    """Collects problems and raises the one that comes first in document order."""

    __slots__ = ("key", "field", "message")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.field = ""
        self.message = ""

    def offer(self, key: tuple, field: str, message: str) -> None:
        if self.key is None or key < self.key:
            self.key, self.field, self.message = key, field, message

    def raise_first(self) -> None:
        if self.key is not None:
            raise ValidationError(self.field, self.message)


class ListRef:
    """A number list that the JSON scan parsed already: list k of `RawBatch.lists`, of n elements."""

    __slots__ = ("k", "n")

    def __init__(self, k: int, n: int):
        self.k, self.n = k, n

    def __len__(self) -> int:
        return self.n


@dataclass(slots=True)
class Column:
    """One per-position field: a raw value per owner (trajectory or node) that has it.

    After `check_batch`: `values` holds all entries concatenated and `offsets` [n+1] their bounds.
    """

    name: str
    """Field name as the source spells it ("tokens", "loss_mask", "advantage"/"advantages", ...)."""
    kind: str
    """"token" (int ids), "mask" (0/1) or "float"."""
    owners: list[int] = field(default_factory=list)
    """Global owner index of each entry, increasing."""
    raw: list = field(default_factory=list)
    """JSON lists, `ListRef`s (JSON lists the scan parsed) or little-endian bytes, one per entry."""
    values: np.ndarray | None = None
    offsets: np.ndarray | None = None

    @property
    def rank(self) -> int:
        return RANK[self.name]

    def lengths(self) -> np.ndarray:
        """int64 [entries] entry lengths (after materialisation)."""
        return np.diff(self.offsets)


@dataclass(slots=True, kw_only=True)
class RawBatch:
    """A parsed rollout batch. Trajectories are indexed globally (g): flat ones first, then each
    explicit tree's, in document order; nodes likewise over all trees."""

    source: str
    """"json" or "proto" (decides how `Column.raw` is decoded)."""
    lists: Any = None
    """JSON text only: the `json_scan.ScannedJSON` that holds the lists `ListRef`s point to."""
    batch_id: str = ""
    vocab_size: int = 0
    policy_version: int | None = None
    """Version of the sampling policy (RolloutBatch.policy_version), None when absent."""
    # trajectories [T]
    traj_ids: list[str] = field(default_factory=list)
    traj_tree: list[int] = field(default_factory=list)
    """-1 for flat trajectories, else the explicit tree index k."""
    traj_index: list[int] = field(default_factory=list)
    """Index j inside its section (`trajectories[j]` or `trees[k].trajectories[j]`)."""
    flat_tree_name: list[str] = field(default_factory=list)
    """[n_flat] tree_id of each flat trajectory."""
    traj_node_id: list[int] = field(default_factory=list)
    """[T - n_flat] node id where each explicit-tree trajectory ends."""
    adv_scalar: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    weight: list[float | None] = field(default_factory=list)
    group_ids: list[str] = field(default_factory=list)
    columns: dict[str, Column] = field(default_factory=dict)
    """"tokens" (flat owners), "loss_mask", "old_logprobs", "ref_logprobs", "advantage"."""
    # explicit trees [K] and their nodes [V]
    tree_ids: list[str] = field(default_factory=list)
    trees_complete: int = 0
    """Trees whose node lists were parsed entirely (structure checks run on those only)."""
    node_tree: list[int] = field(default_factory=list)
    node_index: list[int] = field(default_factory=list)
    node_id: list[int] = field(default_factory=list)
    node_parent: list[int | None] = field(default_factory=list)
    node_tokens: Column = field(default_factory=lambda: Column("tokens", "token"))
    node_columns: dict[str, Column] = field(default_factory=dict)
    """"loss_mask", "old_logprobs", "ref_logprobs" carried by nodes (the compact tree form), owners
    are node indices; a tree's nodes carry a field on all of them or on none."""
    tree_node_fields: list[frozenset[str]] = field(default_factory=list)
    """[K] the per-position fields each explicit tree's nodes carry."""
    stop: Stop | None = None
    """The parsing pass's first problem, if any."""
    # filled by check_batch
    n_flat: int = 0
    node_parent_idx: np.ndarray | None = None
    """int64 [V] parent node (global index), -1 for roots."""
    traj_node_idx: np.ndarray | None = None
    """int64 [T - n_flat] global node index of each explicit trajectory's last node."""
    traj_len: np.ndarray | None = None
    """int64 [T] trajectory lengths (explicit ones: root-to-node path lengths)."""

    def traj_key(self, g: int) -> tuple:
        k = self.traj_tree[g]
        return (2, self.traj_index[g]) if k < 0 else (3, k, 2, self.traj_index[g])

    def traj_path(self, g: int) -> str:
        k = self.traj_tree[g]
        j = self.traj_index[g]
        return f"trajectories[{j}]" if k < 0 else f"trees[{k}].trajectories[{j}]"

    def node_key(self, n: int) -> tuple:
        return (3, self.node_tree[n], 1, self.node_index[n])

    def node_path(self, n: int) -> str:
        return f"trees[{self.node_tree[n]}].nodes[{self.node_index[n]}]"


def number_text(value: int | float) -> str:
    """A number for a message: its repr, or its size when it has more than 40 digits."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    return repr(value)


def printable(name: str) -> str:
    """A document key as it can appear in a field path: escaped if it is not valid Unicode text."""
    try:
        name.encode("utf-8")
        return name
    except UnicodeEncodeError:
        return ascii(name)[1:-1]


def describe(value) -> str:
    """Short description of a JSON value for "got ..." messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {number_text(value)}"
    if isinstance(value, str):
        return f"string {value[:40]!r}" + ("..." if len(value) > 40 else "")
    if isinstance(value, (list, ListRef)):
        return f"list of {len(value)}"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


#: per-position fields a tree node may carry (the compact explicit-tree form)
NODE_FIELDS = ("loss_mask", "old_logprobs", "ref_logprobs")


class Walk:
    """State of one parsing pass (JSON or protobuf): ids seen so far and running size totals.

    Subclasses implement `run(doc)`; `parse` runs it and records the first problem in `raw.stop`.
    """

    def __init__(self, raw: RawBatch, limits):
        self.raw = raw
        self.limits = limits
        self.seen_traj: dict[str, str] = {}
        self.tree_fields: dict[int, dict[str, bool]] = {}
        for name in NODE_FIELDS:
            raw.node_columns[name] = Column(name, "mask" if name == "loss_mask" else "float")
        self.presence: dict[str, tuple[bool, str]] = {}
        self.total_tokens = 0
        self.total_nodes = 0
        self.total_node_tokens = 0

    def run(self, doc) -> None:
        raise NotImplementedError

    def parse(self, doc) -> RawBatch:
        try:
            self.run(doc)
        except Stop as stop:
            self.raw.stop = stop
        return self.raw

    def node_field(self, k: int, j: int, name: str, has: bool, key: tuple, path: str) -> None:
        """Record whether node j of tree k carries `name`; the tree's first node decides for all."""
        fields = self.tree_fields.setdefault(k, {})
        if j == 0:
            fields[name] = has
        elif fields.get(name, False) != has:
            raise Stop(key + (RANK[name],), f"{path}.{name}",
                       f"expected {name} on every node of trees[{k}] or on none (nodes[0] "
                       f"{'has it' if fields.get(name) else 'has none'}), got {'a value' if has else 'none'}")

    def end_nodes(self, k: int) -> frozenset[str]:
        """The fields tree k's nodes carry (after its node list), recorded in the batch."""
        fields = frozenset(n for n, has in self.tree_fields.get(k, {}).items() if has)
        self.raw.tree_node_fields.append(fields)
        return fields

    def tree_field_clash(self, name: str, has: bool, node_fields: frozenset[str] | None, key: tuple, path: str) -> bool:
        """Whether a tree trajectory has `name` through its tree's nodes; a copy of its own is an error."""
        if node_fields is None or name not in node_fields:
            return has
        if has:
            raise Stop(key + (RANK[name],), f"{path}.{name}",
                       f"expected {name} on the nodes of the tree or on its trajectories, got both")
        return True

    def add_trajectory_id(self, tid: str, key: tuple, path: str) -> None:
        """Record a (checked) trajectory id; a repeat or one too many stops the walk."""
        if tid in self.seen_traj:
            raise Stop(key, f"{path}.id", f"expected a unique trajectory id, got {tid!r} again (first at {self.seen_traj[tid]})")
        self.seen_traj[tid] = path
        self.limits.check("max_trajectories", len(self.seen_traj), "trajectories", path)
        self.raw.traj_ids.append(tid)
