"""The trajectory-expanded baseline's forest (cfg.sharing False): every trajectory its own tree.

    source = expand_forest(forest)

The baseline every comparison uses: docs/design/rollout-forest.md, "The expanded baseline".

Legend: T trajectories, N_e expanded positions.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from planner_service.forest import Forest


@njit(cache=True)
def _expand_tokens(tokens, seg_parent, seg_offset, seg_length, seg_depth, traj_seg, traj_offset):
    out = np.empty(traj_offset[-1], np.int32)
    for t in range(traj_seg.shape[0]):
        s = traj_seg[t]
        base = traj_offset[t]
        while s >= 0:
            a = base + seg_depth[s]
            o = seg_offset[s]
            for i in range(seg_length[s]):
                out[a + i] = tokens[o + i]
            s = seg_parent[s]
    return out


def expand_forest(forest: Forest) -> Forest:
    """The trajectory-expanded baseline's forest: every trajectory its own single-segment tree.

    Trajectory-space fields are shared with `forest` (not copied); tree i is named
    "<tree id>/<trajectory id>".
    """
    T = forest.num_trajectories
    lengths = forest.traj_length()
    tokens = _expand_tokens(
        forest.tokens, forest.seg_parent, forest.seg_offset, forest.seg_length, forest.seg_depth,
        forest.traj_seg, forest.traj_offset,
    )
    tree_of = forest.seg_tree[forest.traj_seg]
    return Forest(
        batch_id=forest.batch_id,
        vocab_size=forest.vocab_size,
        tokens=tokens,
        seg_parent=np.full(T, -1, np.int32),
        seg_offset=forest.traj_offset[:-1].astype(np.int64),
        seg_length=lengths.astype(np.int32),
        seg_depth=np.zeros(T, np.int32),
        seg_tree=np.arange(T, dtype=np.int32),
        tree_ids=[f"{forest.tree_ids[tree_of[t]]}/{forest.traj_ids[t]}" for t in range(T)],
        traj_ids=list(forest.traj_ids),
        traj_seg=np.arange(T, dtype=np.int32),
        traj_offset=forest.traj_offset,
        loss_mask=forest.loss_mask,
        advantages=forest.advantages,
        old_logprobs=forest.old_logprobs,
        ref_logprobs=forest.ref_logprobs,
        reward=forest.reward,
        weight=forest.weight,
        group_ids=list(forest.group_ids),
        policy_version=forest.policy_version,
    )
