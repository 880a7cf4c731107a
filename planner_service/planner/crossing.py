"""Windows across ranks on a lock-step schedule that stays as it is: duplicated rows imported instead.

    part = import_duplicates(forest, lockstep_partition)     # a Partition, or None: nothing to import

Where a microbatch m duplicates rows that a microbatch o keeps on another rank and o's window
encloses m's in the schedule, m imports them from o; phases, steps and stand-ins stay as they are,
and only m shrinks (docs/design/cross-rank.md, "When the planner uses them").
Legend: N_u forest tokens, M microbatches, S segments.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from planner_service.forest import Forest
from planner_service.planner.build_kernels import expand_ranges, token_index
from planner_service.planner.spec import Partition


def _tokens(forest: Forest, ranges: np.ndarray) -> np.ndarray:
    """int64 forest tokens of (segment, start, end) ranges."""
    rng = np.asarray(ranges, np.int64).reshape(-1, 3)
    if rng.shape[0] == 0:
        return np.zeros(0, np.int64)
    return expand_ranges(forest.seg_offset[rng[:, 0]] + rng[:, 1], rng[:, 2] - rng[:, 1])


def import_duplicates(forest: Forest, partition: Partition) -> Partition | None:
    """The lock-step `partition` with every microbatch that can import its duplicated root path
    from the microbatch keeping it on another rank doing so; None when none can.

    A microbatch m imports from o when o keeps rows m duplicates and o's window encloses m's in the
    schedule (o forwards in an earlier phase and closes in a later one): the exports travel at the
    end of the phase before m's forward and their gradients at the end of m's backward phase. m
    then imports its whole context from o (one parent per window), and with it what its own window
    children import through it, so every row above m's window subtree must be a row o holds (its
    own rows or their ancestors). Checked per microbatch, parents first; a microbatch that fails
    keeps its duplicated rows (docs/design/cross-rank.md).

    Args:
        forest: the step's prefix forest.
        partition: a lock-step partition (`phases` set) whose windows stay on their rank.
    """
    specs = partition.microbatches
    if partition.phases is None or not any(sp.dup_ranges.shape[0] for sp in specs):
        return None
    M = len(specs)
    seg, off, depth, pred = token_index(forest.seg_parent, forest.seg_offset, forest.seg_length, forest.seg_depth)
    kept_mb = np.full(forest.unique_tokens, -1, np.int64)
    kept = [_tokens(forest, sp.ranges) for sp in specs]
    for m, t in enumerate(kept):
        kept_mb[t] = m
    fwd, bwd = _step_indices(partition, M)
    tin, tout = _euler_tour(forest.seg_parent)
    wkids: list[list[int]] = [[] for _ in range(M)]
    for m, sp in enumerate(specs):
        if sp.parent >= 0 and sp.shared:
            wkids[sp.parent].append(m)

    def above(t: np.ndarray, a: int) -> np.ndarray:
        """bool: token t is token a or one of its ancestors."""
        st, sa = seg[t].astype(np.int64), int(seg[a])
        return np.where(st == sa, off[t] <= off[a], (tin[st] <= tin[sa]) & (tin[sa] < tout[st]))

    def needed(m: int) -> np.ndarray:
        """Sorted tokens just above m's window subtree once m drops its duplicated rows."""
        members, todo = [], [m]
        while todo:
            x = todo.pop()
            members.append(x)
            todo.extend(wkids[x])
        own = np.concatenate([kept[x] for x in members] + [_tokens(forest, specs[x].dup_ranges) for x in members if x != m])
        p = pred[own].astype(np.int64)
        p = p[p >= 0]
        return np.setdiff1d(p, own)

    out = list(specs)
    changed = False
    for m, sp in enumerate(specs):
        if not sp.dup_ranges.shape[0] or kept[m].shape[0] == 0:
            continue
        attach = needed(m)
        if attach.shape[0] == 0:
            continue
        a = int(attach[np.argmax(depth[attach])])  # the deepest: its keeper must hold all the others
        o = int(kept_mb[a])
        if specs[o].rank == sp.rank or not (fwd[o] < fwd[m] and bwd[m] < bwd[o]):
            continue
        if not (above(attach, a) | (kept_mb[attach] == o)).all():
            continue
        out[m] = dataclasses.replace(sp, parent=o, shared=True, dup_ranges=np.zeros((0, 3), np.int64))
        changed = True
    return dataclasses.replace(partition, microbatches=out) if changed else None


def _step_indices(partition: Partition, M: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 [M] each: the step (phase) of every microbatch's FORWARD and of its BACKWARD."""
    fwd = np.zeros(M, np.int64)
    bwd = np.zeros(M, np.int64)
    for steps in partition.rank_steps:
        for i, (kind, m) in enumerate(steps):
            if m >= 0:
                (fwd if kind == "F" else bwd)[m] = i
    return fwd, bwd


def _euler_tour(seg_parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Euler tour of the segment forest, int64 [S] each: s is an ancestor-or-self of x iff
    tin[s] <= tin[x] < tout[s]."""
    S = seg_parent.shape[0]
    kids: list[list[int]] = [[] for _ in range(S)]
    for x in range(S):
        if seg_parent[x] >= 0:
            kids[int(seg_parent[x])].append(x)
    tin = np.zeros(S, np.int64)
    tout = np.zeros(S, np.int64)
    clock = 0
    for root in np.flatnonzero(seg_parent < 0).tolist():
        stack = [(root, False)]
        while stack:
            x, done = stack.pop()
            if done:
                tout[x] = clock
                continue
            tin[x] = clock
            clock += 1
            stack.append((x, True))
            stack.extend((c, False) for c in reversed(kids[x]))
    return tin, tout
