"""The canonical prefix forest of one training step (`Forest`): flat numpy arrays that Numba code can walk.

    forest = planner_service.ingest.forest_from_json(body)    # built by ingestion, consumed by the planner
    forest.check()                                            # the invariants (tests)

Segments in depth-first preorder, a trajectory the root-to-`traj_seg[t]` chain, trajectory-space
arrays concatenated per trajectory: docs/design/rollout-forest.md ("The forest").
Legend: S segments, T trajectories, N_u distinct tokens, N_e expanded tokens (sum of lengths).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True, kw_only=True)
class Forest:
    """Prefix forest plus trajectory-space fields of one step."""

    batch_id: str
    """Client idempotency key of the step."""
    vocab_size: int
    """Vocabulary size; every token id is in [0, vocab_size)."""
    tokens: np.ndarray
    """int32 [N_u] distinct tree tokens, segment after segment."""
    seg_parent: np.ndarray
    """int32 [S] parent segment, -1 for a root."""
    seg_offset: np.ndarray
    """int64 [S] start of the segment's tokens in `tokens`."""
    seg_length: np.ndarray
    """int32 [S] number of tokens, >= 1."""
    seg_depth: np.ndarray
    """int32 [S] depth (position in the trajectory) of the segment's first token."""
    seg_tree: np.ndarray
    """int32 [S] index into `tree_ids`."""
    tree_ids: list[str]
    """Tree names: the flat form's tree_id ("" for the default namespace) or the explicit tree id."""
    traj_ids: list[str]
    """[T] client trajectory ids, in submission order (flat ones first, then explicit trees')."""
    traj_seg: np.ndarray
    """int32 [T] last segment of each trajectory's path."""
    traj_offset: np.ndarray
    """int64 [T+1] offsets of each trajectory's positions in the trajectory-space arrays."""
    loss_mask: np.ndarray
    """uint8 [N_e] 1 where the policy produced the token."""
    advantages: np.ndarray
    """float32 [N_e] per-position advantage (scalar advantages broadcast)."""
    old_logprobs: np.ndarray | None = None
    """float32 [N_e] rollout-policy log-probs, None when the batch has none."""
    ref_logprobs: np.ndarray | None = None
    """float32 [N_e] reference-policy log-probs, None when the batch has none."""
    reward: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """float32 [T] scalar rewards."""
    weight: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """float32 [T] per-trajectory loss weights (1.0 by default)."""
    group_ids: list[str] = field(default_factory=list)
    """[T] GRPO group ids ("" when absent)."""
    policy_version: int | None = None
    """Version of the policy that sampled the batch (RolloutBatch.policy_version), None when absent."""

    @property
    def num_segments(self) -> int:
        return int(self.seg_parent.shape[0])

    @property
    def num_trajectories(self) -> int:
        return len(self.traj_ids)

    @property
    def unique_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def expanded_tokens(self) -> int:
        return int(self.traj_offset[-1])

    def traj_length(self) -> np.ndarray:
        """int64 [T] trajectory lengths."""
        return np.diff(self.traj_offset)

    def path(self, t: int) -> list[int]:
        """Segments of trajectory t's path, root first."""
        out = []
        s = int(self.traj_seg[t])
        while s >= 0:
            out.append(s)
            s = int(self.seg_parent[s])
        return out[::-1]

    def path_tokens(self, t: int) -> np.ndarray:
        """int32 [L] the token ids of trajectory t (rebuilt from the forest)."""
        parts = [self.tokens[self.seg_offset[s] : self.seg_offset[s] + self.seg_length[s]] for s in self.path(t)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def stats(self) -> dict:
        """Summary printed by `harts tree`."""
        depth_end = self.seg_depth.astype(np.int64) + self.seg_length
        return {
            "batch_id": self.batch_id,
            "trajectories": self.num_trajectories,
            "trees": len(np.unique(self.seg_tree)) if self.num_segments else 0,
            "segments": self.num_segments,
            "unique_tokens": self.unique_tokens,
            "expanded_tokens": self.expanded_tokens,
            "compression": (self.expanded_tokens / self.unique_tokens) if self.unique_tokens else 0.0,
            "max_depth": int(depth_end.max()) if self.num_segments else 0,
        }

    def check(self) -> None:
        """Assert the forest's invariants (docs/design/rollout-forest.md, "The forest"; for tests)."""
        S = self.num_segments
        assert self.seg_offset.shape == self.seg_length.shape == self.seg_depth.shape == (S,)
        assert self.seg_tree.shape == (S,)
        assert (self.seg_length >= 1).all()
        if S:
            assert self.seg_offset[0] == 0
            assert (self.seg_offset[1:] == self.seg_offset[:-1] + self.seg_length[:-1]).all()
            assert self.seg_offset[-1] + self.seg_length[-1] == self.tokens.shape[0]
        for s in range(S):
            p = int(self.seg_parent[s])
            assert p < s, f"segment {s}: parent {p} must precede it"
            if p < 0:
                assert self.seg_depth[s] == 0
            else:
                assert self.seg_depth[s] == self.seg_depth[p] + self.seg_length[p]
                assert self.seg_tree[s] == self.seg_tree[p]
        T = self.num_trajectories
        assert self.traj_seg.shape == (T,) and self.traj_offset.shape == (T + 1,)
        lengths = self.seg_depth[self.traj_seg].astype(np.int64) + self.seg_length[self.traj_seg]
        assert (np.diff(self.traj_offset) == lengths).all()
        n_e = int(self.traj_offset[-1])
        assert self.loss_mask.shape == (n_e,) and self.advantages.shape == (n_e,)
