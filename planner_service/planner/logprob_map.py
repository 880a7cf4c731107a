"""Log-prob map kernels of the plan builder (DESIGN §4.4, §5.6).

Every trajectory position i >= 1 with a loss term (or every one, for log-prob export) gets one
entry: the row of token i-1 (its logits predict token i) and the label token i, with the
trajectory-space fields at i. These kernels walk the forest once over flat arrays; each has a
plain-Python twin (`*_ref`) or is trivially checked against numpy in the tests.

Legend: T trajectories, N_e expanded positions, P log-prob entries.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from planner_service.forest import Forest


@njit(cache=True)
def lp_entries(traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, loss_mask, all_positions):
    """Log-prob entries of every trajectory (Numba).

    An entry is a position i >= 1 with loss_mask 1 (every i >= 1 when all_positions).

    Returns:
        g int64 [P] global trajectory-space index, traj int64 [P], pos int64 [P], prev_tok and
        tok int64 [P]: the forest tokens at positions i-1 and i.
    """
    T = traj_seg.shape[0]
    n = 0
    for t in range(T):
        for x in range(traj_offset[t] + 1, traj_offset[t + 1]):
            if all_positions or loss_mask[x] != 0:
                n += 1
    g = np.empty(n, np.int64)
    traj = np.empty(n, np.int64)
    pos = np.empty(n, np.int64)
    prev_tok = np.empty(n, np.int64)
    tok = np.empty(n, np.int64)
    L = 0
    for t in range(T):
        L = max(L, traj_offset[t + 1] - traj_offset[t])
    path_tok = np.empty(L, np.int64)
    k = 0
    for t in range(T):
        s = traj_seg[t]
        while s >= 0:  # forest token at every depth of the path
            for j in range(seg_length[s]):
                path_tok[seg_depth[s] + j] = seg_offset[s] + j
            s = seg_parent[s]
        base = traj_offset[t]
        for i in range(1, traj_offset[t + 1] - base):
            if all_positions or loss_mask[base + i] != 0:
                g[k] = base + i
                traj[k] = t
                pos[k] = i
                prev_tok[k] = path_tok[i - 1]
                tok[k] = path_tok[i]
                k += 1
    return g, traj, pos, prev_tok, tok


@njit(cache=True)
def loss_per_trajectory(traj_offset: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """int64 [T] loss terms per trajectory: loss_mask summed over positions 1..L-1, the positions
    that have a log-prob (position 0 has no previous token, so its mask bit is no loss term and no
    denominator's) (Numba)."""
    T = traj_offset.shape[0] - 1
    out = np.zeros(T, np.int64)
    for t in range(T):
        for x in range(traj_offset[t] + 1, traj_offset[t + 1]):
            out[t] += loss_mask[x]
    return out


def lp_entries_ref(forest: Forest, all_positions: bool):
    """Plain-Python twin of `lp_entries` (same outputs)."""
    out = [[], [], [], [], []]
    for t in range(forest.num_trajectories):
        path = []
        for s in forest.path(t):
            o = int(forest.seg_offset[s])
            path.extend(range(o, o + int(forest.seg_length[s])))
        base = int(forest.traj_offset[t])
        for i in range(1, len(path)):
            if all_positions or forest.loss_mask[base + i]:
                for col, v in zip(out, (base + i, t, i, path[i - 1], path[i])):
                    col.append(v)
    return tuple(np.array(c, np.int64) for c in out)
