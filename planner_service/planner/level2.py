"""Level 2 of the partitioner, Numba kernels over flat arrays: edge costs, window exports, order.

    ctx, ctx_replay = context_cost(roots_off, roots, unit_parent, unit_len, unit_depth, C, replay)
    attn, conv, kern, states = window_export_counts(...)    # upper bounds per recomputed window
    order = dfs_order(...)                                   # per rank, depth-first over the window forest

Also `window_groups`, `subtree_costs`, `live_stack` and `lpt_place` (placement without windows).
Plain-Python oracles: `partition_ref.py` (docs/design/planner.md, level 2).
Legend: U units, M microbatches, G window groups, W ranks.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from planner_service.planner.level1 import children_csr, stamp_path


@njit(cache=True)
def context_cost(roots_off, roots, unit_parent, unit_len, unit_depth, chunk, replay):
    """Duplicated context of every microbatch.

    Args:
        roots_off: int64 [M+1], roots: int64 [*] piece-root units of each microbatch.
        unit_parent, unit_len, unit_depth: int [U] the unit forest.
        chunk: C; replay: count bounded replay at the branch points of the context tree.

    Returns:
        ctx int64 [M] context rows (0 for a microbatch of forest-root pieces only), ctx_replay int64 [M].
    """
    M = roots_off.shape[0] - 1
    n = unit_parent.shape[0]
    stamp = np.full(n, -1, np.int64)
    nchild = np.zeros(n, np.int64)
    ctx = np.zeros(M, np.int64)
    ctx_replay = np.zeros(M, np.int64)
    visited = np.empty(n, np.int64)
    for m in range(M):
        nv = 0
        for i in range(roots_off[m], roots_off[m + 1]):
            first = nv
            nv, hit = stamp_path(unit_parent, unit_parent[roots[i]], stamp, m, visited, nv)
            for j in range(first, nv):  # the path's new units: one child on it so far
                nchild[visited[j]] = 1
                ctx[m] += unit_len[visited[j]]
            if hit >= 0:
                nchild[hit] += 1
        if replay:
            for j in range(nv):
                a = visited[j]
                if nchild[a] > 1:
                    ctx_replay[m] += (nchild[a] - 1) * ((unit_depth[a] + unit_len[a]) % chunk)
    return ctx, ctx_replay


@njit(cache=True)
def window_groups(mb_parent, mb_shared):
    """Window group of every microbatch: the id of its window root (parents precede children)."""
    M = mb_parent.shape[0]
    group = np.empty(M, np.int64)
    for m in range(M):
        p = mb_parent[m]
        group[m] = group[p] if (p >= 0 and mb_shared[m]) else m
    return group


@njit(cache=True)
def subtree_costs(mb_parent, mb_shared, rows):
    """Rows of each microbatch's window subtree (itself and its window descendants)."""
    M = mb_parent.shape[0]
    sub = rows.astype(np.float64)
    for m in range(M - 1, -1, -1):
        p = mb_parent[m]
        if p >= 0 and mb_shared[m]:
            sub[p] += sub[m]
    return sub


@njit(cache=True)
def lpt_place(costs_sorted, world_size):
    """Assign items (sorted by cost descending) to the least-loaded rank, lowest rank on ties.

    Returns:
        rank int64 [G] per item (in the given order), load float64 [W].
    """
    G = costs_sorted.shape[0]
    load = np.zeros(world_size, np.float64)
    rank = np.empty(G, np.int64)
    for g in range(G):
        best = 0
        for r in range(1, world_size):
            if load[r] < load[best]:
                best = r
        rank[g] = best
        load[best] += costs_sorted[g]
    return rank, load


@njit(cache=True)
def live_stack(mb_parent, mb_shared, rows, live_cost):
    """Live rows while each microbatch runs: its rows plus its open window ancestors' live costs.

    Microbatch ids are topological (a parent precedes its children).

    Returns:
        live int64 [M], anc int64 [M] (the ancestors' part).
    """
    M = mb_parent.shape[0]
    anc = np.zeros(M, np.int64)
    live = np.empty(M, np.int64)
    for m in range(M):
        p = mb_parent[m]
        if p >= 0 and mb_shared[m]:
            anc[m] = anc[p] + live_cost[p]
        live[m] = anc[m] + rows[m]
    return live, anc


@njit(cache=True)
def dfs_order(mb_parent, mb_shared, mb_rank, world_size):
    """Execution steps of every rank: depth-first over the window forest, roots and children by id.

    Returns:
        step_rank int64 [2M], step_kind int8 [2M] (0 forward, 1 backward), step_mb int64 [2M],
        grouped by rank (rank 0's steps first), each rank's steps in execution order.
    """
    M = mb_parent.shape[0]
    wparent = np.full(M, -1, np.int64)
    for m in range(M):
        if mb_parent[m] >= 0 and mb_shared[m]:
            wparent[m] = mb_parent[m]
    off, kids = children_csr(wparent)
    n = 2 * M
    step_rank = np.empty(n, np.int64)
    step_kind = np.empty(n, np.int8)
    step_mb = np.empty(n, np.int64)
    stack_m = np.empty(M, np.int64)
    stack_i = np.empty(M, np.int64)
    # window roots grouped by rank, by id within a rank (counting sort)
    first = np.zeros(world_size + 1, np.int64)
    for m in range(M):
        if wparent[m] < 0:
            first[mb_rank[m] + 1] += 1
    for r in range(world_size):
        first[r + 1] += first[r]
    fill = first[:-1].copy()
    roots = np.empty(first[world_size], np.int64)
    for m in range(M):
        if wparent[m] < 0:
            roots[fill[mb_rank[m]]] = m
            fill[mb_rank[m]] += 1
    k = 0
    for r in range(world_size):
        for j in range(first[r], first[r + 1]):
            root = roots[j]
            top = 0
            stack_m[0] = root
            stack_i[0] = off[root]
            step_rank[k] = r
            step_kind[k] = 0
            step_mb[k] = root
            k += 1
            while top >= 0:
                m = stack_m[top]
                i = stack_i[top]
                if i < off[m + 1]:
                    stack_i[top] = i + 1
                    c = kids[i]
                    top += 1
                    stack_m[top] = c
                    stack_i[top] = off[c]
                    step_rank[k] = r
                    step_kind[k] = 0
                    step_mb[k] = c
                    k += 1
                else:
                    step_rank[k] = r
                    step_kind[k] = 1
                    step_mb[k] = m
                    k += 1
                    top -= 1
    return step_rank[:k], step_kind[:k], step_mb[:k]


@njit(cache=True)
def _owner_step(mb, cur, frozen, mb_parent, mb_shared):
    """Advance the owner walk to a unit kept (or duplicated) by microbatch `mb`: the owner is mb
    while the walk is still inside the window chain, else the chain member whose duplicated edge
    holds the rest of the path as local rows. Returns (owner, frozen)."""
    if frozen:
        return cur, True
    while cur != mb:
        if not mb_shared[cur]:
            return cur, True
        cur = mb_parent[cur]
    return cur, False


@njit(cache=True)
def window_export_counts(roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent, mb_shared, group,
                         chunk, conv_kernel, replay):
    """Upper bounds of what each window parent exports of its own rows, per kind (memory model).

    For every shared microbatch c and every piece root below an anchor unit a (the predecessor's
    unit), the rows c's consumers read above the piece root, attributed to the microbatch that
    computes them (the window ancestor where they are local rows, or the ancestor whose
    duplicated edge holds them): ATTN every row of the root path; CONV the K-1 rows above; KERNEL
    the replay rows [floor(d/C) C, d) of a piece root at depth d; one state at the chunk boundary
    it starts from (d itself with replay off). Each window group is handled on its own, with the
    rows of a root path, and the conv/replay rows and states of an anchor, counted once per group
    (overlaps between anchors are counted twice: an upper bound of plan.window_exports).

    Args:
        roots_off: int64 [M+1], roots: int64 [*] piece-root units of each microbatch.
        unit_parent, unit_len, unit_depth: the unit forest; unit_mb int64 [U] its microbatch.
        mb_parent, mb_shared: the microbatch forest; group: int64 [M] window group ids.

    Returns:
        attn, conv, kernel, states: int64 [M] counts per exporter.
    """
    M = roots_off.shape[0] - 1
    n = unit_parent.shape[0]
    attn = np.zeros(M, np.int64)
    conv = np.zeros(M, np.int64)
    kern = np.zeros(M, np.int64)
    states = np.zeros(M, np.int64)
    s_attn = np.full(n, -1, np.int64)
    s_anchor = np.full(n, -1, np.int64)
    s_state = np.full(n, -1, np.int64)
    order = np.argsort(group, kind="mergesort")
    for j in range(M):
        c = order[j]
        if mb_parent[c] < 0 or not mb_shared[c]:
            continue
        g = group[c]
        for i in range(roots_off[c], roots_off[c + 1]):
            a = unit_parent[roots[i]]
            if a < 0:
                continue
            d = unit_depth[roots[i]]
            # ATTN: the whole root path (stop where this group already walked)
            cur, frozen, u = c, False, a
            while u >= 0 and s_attn[u] != g:
                s_attn[u] = g
                cur, frozen = _owner_step(unit_mb[u], cur, frozen, mb_parent, mb_shared)
                attn[cur] += unit_len[u]
                u = unit_parent[u]
            if s_anchor[a] == g:
                continue
            s_anchor[a] = g
            # CONV: the K-1 rows above the piece root
            need = conv_kernel - 1
            cur, frozen, u = c, False, a
            while need > 0 and u >= 0:
                cur, frozen = _owner_step(unit_mb[u], cur, frozen, mb_parent, mb_shared)
                take = min(need, unit_len[u])
                conv[cur] += take
                need -= take
                u = unit_parent[u]
            # KERNEL rows [b, d) and the state at b (replay), or the state at d (no replay)
            b = (d // chunk) * chunk if replay else d
            cur, frozen, u = c, False, a
            while u >= 0:
                cur, frozen = _owner_step(unit_mb[u], cur, frozen, mb_parent, mb_shared)
                lo = unit_depth[u]
                hi = lo + unit_len[u]
                if hi > b:
                    kern[cur] += hi - max(lo, b)
                if b > 0 and lo <= b - 1 < hi:
                    if s_state[u] != g:
                        s_state[u] = g
                        states[cur] += 1
                    break
                if lo < b or b == 0 and lo == 0:
                    break
                u = unit_parent[u]
    return attn, conv, kern, states
