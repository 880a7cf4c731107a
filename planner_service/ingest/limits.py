"""Size limits of one rollout batch (`Limits`): what a batch may cost to ingest and plan.

    limits = Limits(max_tokens=10_000_000)
    limits.check("max_tokens", n, "expanded tokens", field)   # LimitError naming the limit and the field

The limits bound what a batch costs, not how much it shares, and each is checked as soon as the
count it bounds is known (expanded counts in int64); the defaults and the largest steps they
admit: docs/rollouts.md ("Limits") and docs/design/service.md ("Ingestion and validation").
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from planner_service.errors import LimitError


@dataclass(slots=True, kw_only=True)
class Limits:
    """Upper bounds on what one batch may contain. All must be >= 1."""

    max_body_bytes: int = 1 << 30
    """Serialized size of the request body (JSON text or protobuf bytes): 1 GiB."""
    max_trajectories: int = 100_000
    """Number of trajectories, flat and explicit-tree ones together."""
    max_unique_tokens: int = 1 << 26
    """Distinct tokens N_u of the merged forest (67,108,864): what the planner packs."""
    max_tokens: int = 1 << 30
    """Expanded tokens N_e (1,073,741,824): the sum of all trajectory lengths (explicit ones as path
    lengths). A memory guard: explicit trees can describe long paths in a small body."""
    max_loss_tokens: int = 1 << 26
    """Positions with loss_mask 1 (67,108,864): one log-prob entry each in a training plan."""
    max_trajectory_length: int = 1 << 20
    """Tokens of one trajectory (an explicit one: of its root-to-node path)."""
    max_trees: int = 100_000
    """Explicit trees in the `trees` section."""
    max_nodes: int = 5_000_000
    """Explicit-tree nodes, all trees together."""
    max_node_tokens: int = 1 << 26
    """Tokens stored in explicit-tree nodes, all trees together (67,108,864)."""
    max_id_length: int = 1024
    """Characters of any string id (batch, trajectory, tree, group)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name}: expected an int >= 1, got {value!r}")

    def check(self, name: str, value: int, what: str, field: str = "") -> None:
        """Raise `LimitError` when `value` exceeds the limit `name`.

        Args:
            name: a field of this class, e.g. "max_tokens".
            value: the measured count.
            what: the unit in the message, e.g. "expanded tokens".
            field: the document field at which the count crossed the limit, if one did.
        """
        bound = getattr(self, name)
        if value > bound:
            where = f" (at {field})" if field else ""
            raise LimitError(f"{name}: expected at most {bound} {what}, got {value}{where}", field=field)
