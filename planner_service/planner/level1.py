"""Level 1 of the partitioner, Numba kernels over flat arrays: units, pieces, microbatches.

    units = build_units(seg_parent, seg_length, seg_depth, C)   # segments cut at chunk-aligned depths
    cut_pieces(...); first_fit_decreasing(...); balance_bins(...)

`cut_pieces` is Kundu and Misra's greedy (pieces that fit B), `first_fit_decreasing` packs pieces
into microbatches over a max segment tree, `balance_bins` spreads them for lock-step plans;
`children_csr`, `group_by`, `piece_roots`, `stamp_path` are helpers the other kernels share.
Plain-Python oracles: `partition_ref.py` (docs/design/planner.md, units and level 1).
Legend: S segments, U units, n items (pieces), m items of one group, P a power of two >= m.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def build_units(seg_parent, seg_length, seg_depth, chunk):
    """Cut segments at the chunk-aligned depths inside them.

    Args:
        seg_parent, seg_length, seg_depth: int [S] the forest's segment arrays (preorder).
        chunk: chunk size C.

    Returns:
        unit_seg int32 [U], unit_off int32 [U] (offset inside the segment), unit_len int32 [U],
        unit_depth int64 [U] (depth of the first token), unit_parent int64 [U] (-1 for a root).
    """
    S = seg_parent.shape[0]
    n = 0
    for s in range(S):
        d = np.int64(seg_depth[s])
        e = d + seg_length[s]
        first = (d // chunk + 1) * chunk
        n += 1
        if first < e:
            n += (e - 1 - first) // chunk + 1
    unit_seg = np.empty(n, np.int32)
    unit_off = np.empty(n, np.int32)
    unit_len = np.empty(n, np.int32)
    unit_depth = np.empty(n, np.int64)
    unit_parent = np.empty(n, np.int64)
    seg_last = np.empty(S, np.int64)
    u = 0
    for s in range(S):
        d = np.int64(seg_depth[s])
        L = np.int64(seg_length[s])
        p = seg_parent[s]
        prev = seg_last[p] if p >= 0 else -1
        o = np.int64(0)
        while o < L:
            nxt = ((d + o) // chunk + 1) * chunk - d
            if nxt > L:
                nxt = L
            unit_seg[u] = s
            unit_off[u] = o
            unit_len[u] = nxt - o
            unit_depth[u] = d + o
            unit_parent[u] = prev
            prev = u
            u += 1
            o = nxt
        seg_last[s] = prev
    return unit_seg, unit_off, unit_len, unit_depth, unit_parent


@njit(cache=True)
def children_csr(parent):
    """Children of every node, in increasing index order: (offsets int64 [n+1], children int64 [*])."""
    n = parent.shape[0]
    off = np.zeros(n + 1, np.int64)
    for u in range(n):
        p = parent[u]
        if p >= 0:
            off[p + 1] += 1
    for i in range(n):
        off[i + 1] += off[i]
    fill = off[:-1].copy()
    kids = np.empty(off[n], np.int64)
    for u in range(n):
        p = parent[u]
        if p >= 0:
            kids[fill[p]] = u
            fill[p] += 1
    return off, kids


@njit(cache=True)
def group_by(keys: np.ndarray, n: int):
    """Stable counting sort of int keys in [0, n): (order int64 [P], bounds int64 [n+1]) (Numba)."""
    bounds = np.zeros(n + 1, np.int64)
    for k in keys:
        bounds[k + 1] += 1
    for i in range(n):
        bounds[i + 1] += bounds[i]
    fill = bounds[:-1].copy()
    order = np.empty(keys.shape[0], np.int64)
    for i in range(keys.shape[0]):
        order[fill[keys[i]]] = i
        fill[keys[i]] += 1
    return order, bounds


@njit(cache=True)
def stamp_path(parent, a, stamp, key, buf, n):
    """Walk from node `a` towards its root, stamping nodes with `key` until one already carries it.

    The root-path walk of the context, closure and cost kernels: with one key per microbatch or
    rank, every node of the union of the walked paths is visited once per key.

    Args:
        parent: int [*] forest parents (-1 at a root); stamp: int64 [*] scratch, updated.
        buf: int64 [*] the newly stamped nodes are written to buf[n:], `a` first.

    Returns:
        (n plus the number of newly stamped nodes, the first node that already carried `key`, or
        -1 when the walk passed a root).
    """
    while a >= 0 and stamp[a] != key:
        stamp[a] = key
        buf[n] = a
        n += 1
        a = parent[a]
    return n, a


@njit(cache=True)
def root_cost(depth, parent, chunk, dup, replay):
    """Rows a piece rooted at a unit of `depth` adds besides its own: duplicated context (`dup`) or
    the replay rows [floor(depth/C)*C, depth) it imports (shared)."""
    if parent < 0:
        return 0
    if dup:
        return depth
    if replay:
        return depth % chunk
    return 0


@njit(cache=True)
def cut_pieces(unit_parent, unit_len, unit_depth, chunk, budget, dup, replay, force):
    """Kundu-Misra bottom-up greedy over the unit forest.

    Args:
        unit_parent, unit_len, unit_depth: int [U] the unit forest (preorder).
        chunk: chunk size C; budget: int64 [U] the piece capacity at each unit (B, or a lock-step
            plan's smaller capacity of the unit's rank forest; a piece's units share one).
        dup: piece roots carry their whole root path as context rows (no sharing windows).
        replay: bounded replay at unaligned branches (PlanConfig.replay).
        force: bool [U] units that must root a piece (cut from their parent whatever the sizes).

    Returns:
        cut bool [U] (True: the unit roots a piece below another piece), resid int64 [U] (rows of
        the unit's part of its piece: kept tokens plus replay at branches inside it), bad int64
        (-1, or a unit that cannot fit B even alone).
    """
    n = unit_parent.shape[0]
    off, kids = children_csr(unit_parent)
    resid = np.zeros(n, np.int64)
    cut = np.zeros(n, np.bool_)
    for u in range(n - 1, -1, -1):
        lo = off[u]
        hi = off[u + 1]
        k = 0
        total = np.int64(unit_len[u])
        for i in range(lo, hi):
            c = kids[i]
            if force[c]:
                cut[c] = True
            else:
                total += resid[c]
                k += 1
        br = (unit_depth[u] + unit_len[u]) % chunk if replay else 0
        rr = root_cost(unit_depth[u], unit_parent[u], chunk, dup, replay)
        extra = (k - 1) * br if k > 1 else 0
        cap = budget[u]
        if total + extra + rr > cap:
            keys = np.empty(k, np.int64)
            j = 0
            for i in range(lo, hi):
                c = kids[i]
                if not force[c]:
                    keys[j] = (cap - resid[c]) * n + c
                    j += 1
            order = np.argsort(keys)
            j = 0
            while total + extra + rr > cap and k > 0:
                c = keys[order[j]] % n
                cut[c] = True
                total -= resid[c]
                k -= 1
                j += 1
                extra = (k - 1) * br if k > 1 else 0
            if total + rr > cap:
                return cut, resid, np.int64(u)
        resid[u] = total + extra
    return cut, resid, np.int64(-1)


@njit(cache=True)
def piece_roots(unit_parent, cut):
    """Root unit of every unit's piece (preorder pass)."""
    n = unit_parent.shape[0]
    root = np.empty(n, np.int64)
    for u in range(n):
        p = unit_parent[u]
        root[u] = u if (p < 0 or cut[u]) else root[p]
    return root


@njit(cache=True)
def first_fit_decreasing(sizes, group_off, caps, opens):
    """First fit over items already sorted by (group, opens first, size descending, id).

    Args:
        sizes: int64 [n] item sizes, in packing order.
        group_off: int64 [G+1] items group_off[g]:group_off[g+1] form group g (packed separately).
        caps: int64 [G] bin capacity of each group.
        opens: bool [n] the item opens a new bin (never joins a bin opened before it); later items
            may still join its bin.

    Returns:
        bin int64 [n] global bin of each item (bins numbered group after group, in opening order),
        num_bins int64.
    """
    n = sizes.shape[0]
    out = np.empty(n, np.int64)
    base = np.int64(0)
    G = group_off.shape[0] - 1
    for g in range(G):
        a = group_off[g]
        b = group_off[g + 1]
        m = b - a
        if m == 0:
            continue
        P = 1
        while P < m:
            P *= 2
        tree = np.empty(2 * P, np.int64)
        tree[P:] = caps[g]
        for i in range(P - 1, 0, -1):
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
        used = np.int64(0)
        for i in range(a, b):
            size = sizes[i]
            if opens[i]:
                node = P + used
            else:
                node = 1
                while node < P:
                    node = 2 * node if tree[2 * node] >= size else 2 * node + 1
            leaf = node - P
            tree[node] -= size
            node //= 2
            while node >= 1:
                tree[node] = max(tree[2 * node], tree[2 * node + 1])
                node //= 2
            out[i] = base + leaf
            if leaf + 1 > used:
                used = leaf + 1
        base += used
    return out, base


@njit(cache=True)
def balance_bins(sizes, group_off, bins, cap):
    """Longest processing time first over the bins first_fit_decreasing opened, group by group:
    each item (sorted by size descending within its group) onto the least loaded of the group's
    bins (the lowest on a tie). A group whose balanced bins would exceed `cap`, or whose largest
    balanced bin would exceed first fit's largest, keeps its bins.

    Args:
        sizes: int64 [n] item sizes in packing order; group_off: int64 [G+1]; bins: int64 [n]
            first_fit_decreasing's bins (a group's bins are consecutive); cap: the hard capacity B.

    Returns:
        int64 [n] bins, each group's numbered in order of their first item.
    """
    out = bins.copy()
    for g in range(group_off.shape[0] - 1):
        a = group_off[g]
        b = group_off[g + 1]
        if b - a < 2:
            continue
        lo = bins[a]
        k = 0
        for i in range(a, b):
            lo = min(lo, bins[i])
            k = max(k, bins[i])
        k = k - lo + 1
        if k < 2:
            continue
        load = np.zeros(k, np.int64)
        heap = np.arange(k)  # bin indices, a min-heap on (load, index)
        fits = True
        for i in range(a, b):
            j = heap[0]
            if load[j] + sizes[i] > cap:
                fits = False
                break
            load[j] += sizes[i]
            out[i] = lo + j
            x = 0  # sift the root down
            while True:
                c = 2 * x + 1
                if c >= k:
                    break
                if c + 1 < k and (load[heap[c + 1]] < load[heap[c]] or (load[heap[c + 1]] == load[heap[c]] and heap[c + 1] < heap[c])):
                    c += 1
                if load[heap[c]] < load[heap[x]] or (load[heap[c]] == load[heap[x]] and heap[c] < heap[x]):
                    heap[c], heap[x] = heap[x], heap[c]
                    x = c
                else:
                    break
        ffd_load = np.zeros(k, np.int64)
        for i in range(a, b):
            ffd_load[bins[i] - lo] += sizes[i]
        if not fits or load.max() > ffd_load.max():  # LPT is not always better than first fit
            for i in range(a, b):
                out[i] = bins[i]
    return out
