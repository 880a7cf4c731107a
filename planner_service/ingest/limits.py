"""Size limits of one rollout batch (DESIGN §3: "sizes over the configured limits").

Each limit is checked as early as the count it bounds is known (before any array is built where
possible), and exceeding one raises `LimitError` naming the limit, e.g. `max_tokens: expected at
most 50000000 expanded tokens, got 50000001`.
"""
from __future__ import annotations

from dataclasses import dataclass

from planner_service.errors import LimitError


@dataclass(slots=True, kw_only=True)
class Limits:
    """Upper bounds on what one batch may contain. All must be >= 1."""

    max_body_bytes: int = 1 << 30
    """Serialized size of the request body (JSON text or protobuf bytes)."""
    max_trajectories: int = 100_000
    """Number of trajectories, flat and explicit-tree ones together."""
    max_tokens: int = 50_000_000
    """Expanded tokens N_e: the sum of all trajectory lengths (explicit ones as path lengths)."""
    max_trajectory_length: int = 1 << 20
    """Tokens of one trajectory (an explicit one: of its root-to-node path)."""
    max_trees: int = 100_000
    """Explicit trees in the `trees` section."""
    max_nodes: int = 5_000_000
    """Explicit-tree nodes, all trees together."""
    max_node_tokens: int = 50_000_000
    """Tokens stored in explicit-tree nodes, all trees together."""
    max_id_length: int = 1024
    """Characters of any string id (batch, trajectory, tree, group)."""

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")

    def check(self, name: str, value: int, what: str) -> None:
        """Raise `LimitError` when `value` exceeds the limit `name`.

        Args:
            name: a field of this class, e.g. "max_tokens".
            value: the measured count.
            what: the unit in the message, e.g. "expanded tokens".
        """
        bound = getattr(self, name)
        if value > bound:
            raise LimitError(f"{name}: expected at most {bound} {what}, got {value}")
