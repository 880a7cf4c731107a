"""Plain-Python oracles of the partitioner kernels (`level1.py`, `level2.py`).

Same signatures and results as the Numba kernels, written for reading rather than speed: lists,
dicts and `sorted`. Tests compare both on seeded random forests; `partition(..., impl="ref")` runs
the whole partitioner on them (the benchmark's baseline; docs/design/planner.md).
"""
from __future__ import annotations

import numpy as np


def build_units(seg_parent, seg_length, seg_depth, chunk):
    """See `level1.build_units`."""
    units = []  # (seg, off, len, depth, parent)
    last_of = {}
    for s in range(len(seg_parent)):
        d, L, p = int(seg_depth[s]), int(seg_length[s]), int(seg_parent[s])
        prev = last_of[p] if p >= 0 else -1
        cuts = [o for o in range(1, L) if (d + o) % chunk == 0]
        for a, b in zip([0] + cuts, cuts + [L]):
            units.append((s, a, b - a, d + a, prev))
            prev = len(units) - 1
        last_of[s] = prev
    cols = list(zip(*units)) if units else [[]] * 5
    return (
        np.array(cols[0], np.int32),
        np.array(cols[1], np.int32),
        np.array(cols[2], np.int32),
        np.array(cols[3], np.int64),
        np.array(cols[4], np.int64),
    )


def _children(parent) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(parent))]
    for u, p in enumerate(parent):
        if p >= 0:
            kids[int(p)].append(u)
    return kids


def root_cost(depth, parent, chunk, dup, replay):
    """See `level1.root_cost`."""
    if parent < 0:
        return 0
    if dup:
        return int(depth)
    return int(depth) % chunk if replay else 0


def cut_pieces(unit_parent, unit_len, unit_depth, chunk, budget, dup, replay, force):
    """See `level1.cut_pieces`: keep children while the piece fits, cut the largest first."""
    n = len(unit_parent)
    kids = _children(unit_parent)
    resid = [0] * n
    cut = [False] * n
    for u in reversed(range(n)):
        branch = (int(unit_depth[u]) + int(unit_len[u])) % chunk if replay else 0
        rr = root_cost(unit_depth[u], unit_parent[u], chunk, dup, replay)
        for c in kids[u]:
            if force[c]:
                cut[c] = True
        kept = sorted((c for c in kids[u] if not force[c]), key=lambda c: (-resid[c], c))

        def size(ks):
            return int(unit_len[u]) + sum(resid[c] for c in ks) + max(len(ks) - 1, 0) * branch

        while kept and size(kept) + rr > budget[u]:
            cut[kept.pop(0)] = True
        if size(kept) + rr > budget[u]:
            return np.array(cut, np.bool_), np.array(resid, np.int64), u
        resid[u] = size(kept)
    return np.array(cut, np.bool_), np.array(resid, np.int64), -1


def piece_roots(unit_parent, cut):
    """See `level1.piece_roots`."""
    root = []
    for u, p in enumerate(unit_parent):
        root.append(u if (p < 0 or cut[u]) else root[int(p)])
    return np.array(root, np.int64)


def first_fit_decreasing(sizes, group_off, caps, opens):
    """See `level1.first_fit_decreasing`: scan the open bins left to right."""
    out = []
    base = 0
    for g in range(len(group_off) - 1):
        free: list[int] = []
        for i in range(int(group_off[g]), int(group_off[g + 1])):
            size = int(sizes[i])
            for b, room in enumerate(free):
                if room >= size and not opens[i]:
                    break
            else:
                free.append(int(caps[g]))
                b = len(free) - 1
            free[b] -= size
            out.append(base + b)
        base += len(free)
    return np.array(out, np.int64), base


def _path_up(unit_parent, u):
    while u >= 0:
        yield u
        u = int(unit_parent[u])


def context_cost(roots_off, roots, unit_parent, unit_len, unit_depth, chunk, replay):
    """See `level2.context_cost`: the union of the pieces' root paths, and replay at its branches."""
    M = len(roots_off) - 1
    ctx = [0] * M
    ctx_replay = [0] * M
    for m in range(M):
        nchild: dict[int, int] = {}
        for r in roots[roots_off[m] : roots_off[m + 1]]:
            for a in _path_up(unit_parent, int(unit_parent[r])):
                seen = a in nchild
                nchild[a] = nchild.get(a, 0) + 1
                if seen:
                    break
        ctx[m] = sum(int(unit_len[a]) for a in nchild)
        if replay:
            ctx_replay[m] = sum((k - 1) * ((int(unit_depth[a]) + int(unit_len[a])) % chunk) for a, k in nchild.items())
    return np.array(ctx, np.int64), np.array(ctx_replay, np.int64)


def window_groups(mb_parent, mb_shared):
    """See `level2.window_groups`: follow window edges up to the root."""
    out = []
    for m in range(len(mb_parent)):
        c = m
        while mb_parent[c] >= 0 and mb_shared[c]:
            c = int(mb_parent[c])
        out.append(c)
    return np.array(out, np.int64)


def subtree_costs(mb_parent, mb_shared, rows):
    """See `level2.subtree_costs`: add every microbatch's rows to all its window ancestors."""
    sub = [float(r) for r in rows]
    for m in range(len(mb_parent)):
        c = m
        while mb_parent[c] >= 0 and mb_shared[c]:
            c = int(mb_parent[c])
            sub[c] += float(rows[m])
    return np.array(sub, np.float64)


def lpt_place(costs_sorted, world_size):
    """See `level2.lpt_place`."""
    load = [0.0] * world_size
    rank = []
    for cost in costs_sorted:
        best = min(range(world_size), key=lambda r: (load[r], r))
        rank.append(best)
        load[best] += float(cost)
    return np.array(rank, np.int64), np.array(load, np.float64)


def live_stack(mb_parent, mb_shared, rows, live_cost):
    """See `level2.live_stack`: walk every microbatch's window ancestors."""
    M = len(mb_parent)
    anc = []
    for m in range(M):
        total, p, c = 0, int(mb_parent[m]), m
        while p >= 0 and mb_shared[c]:
            total += int(live_cost[p])
            c, p = p, int(mb_parent[p])
        anc.append(total)
    live = [a + int(r) for a, r in zip(anc, rows)]
    return np.array(live, np.int64), np.array(anc, np.int64)


def dfs_order(mb_parent, mb_shared, mb_rank, world_size):
    """See `level2.dfs_order`: recursive depth-first walk."""
    M = len(mb_parent)
    wparent = [int(mb_parent[m]) if (mb_parent[m] >= 0 and mb_shared[m]) else -1 for m in range(M)]
    kids = _children(wparent)
    steps: list[tuple[int, int, int]] = []

    def visit(m: int, r: int) -> None:
        steps.append((r, 0, m))
        for c in kids[m]:
            visit(c, r)
        steps.append((r, 1, m))

    for r in range(world_size):
        for m in range(M):
            if wparent[m] < 0 and mb_rank[m] == r:
                visit(m, r)
    cols = list(zip(*steps)) if steps else [[]] * 3
    return np.array(cols[0], np.int64), np.array(cols[1], np.int8), np.array(cols[2], np.int64)


def window_export_counts(roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent, mb_shared, group,
                         chunk, conv_kernel, replay):
    """See `level2.window_export_counts`: walk every piece root's path, owner by owner, with
    explicit per-group sets of walked units and anchors."""
    M = len(roots_off) - 1
    out = {k: [0] * M for k in ("attn", "conv", "kern", "states")}
    walked: dict[int, set] = {}
    anchors: dict[int, set] = {}
    state_units: dict[int, set] = {}

    def path_with_owners(c: int, a: int):
        """(unit, owner) from the anchor up to the root."""
        chain = []
        x = c
        while x >= 0:
            chain.append(x)
            if not mb_shared[x]:
                break
            x = int(mb_parent[x])
        dup_holder = chain[-1] if not mb_shared[chain[-1]] else None
        u = a
        while u >= 0:
            mb = int(unit_mb[u])
            owner = mb if mb in chain and (dup_holder is None or chain.index(mb) <= chain.index(dup_holder)) else dup_holder
            yield u, owner
            if owner == dup_holder and mb != dup_holder:
                for v in _path_up(unit_parent, int(unit_parent[u])):
                    yield v, dup_holder
                return
            u = int(unit_parent[u])

    for c in sorted(range(M), key=lambda m: (int(group[m]), m)):
        if mb_parent[c] < 0 or not mb_shared[c]:
            continue
        g = int(group[c])
        for r in roots[roots_off[c] : roots_off[c + 1]]:
            a = int(unit_parent[r])
            if a < 0:
                continue
            d = int(unit_depth[r])
            seen = walked.setdefault(g, set())
            for u, o in path_with_owners(c, a):
                if u in seen:
                    break
                seen.add(u)
                out["attn"][o] += int(unit_len[u])
            if a in anchors.setdefault(g, set()):
                continue
            anchors[g].add(a)
            need = conv_kernel - 1
            for u, o in path_with_owners(c, a):
                if need <= 0:
                    break
                take = min(need, int(unit_len[u]))
                out["conv"][o] += take
                need -= take
            b = (d // chunk) * chunk if replay else d
            for u, o in path_with_owners(c, a):
                lo, hi = int(unit_depth[u]), int(unit_depth[u]) + int(unit_len[u])
                out["kern"][o] += max(0, hi - max(lo, b))
                if b > 0 and lo <= b - 1 < hi:
                    if u not in state_units.setdefault(g, set()):
                        state_units[g].add(u)
                        out["states"][o] += 1
                    break
                if lo < b or lo == 0:
                    break
    return tuple(np.array(out[k], np.int64) for k in ("attn", "conv", "kern", "states"))


def balance_bins(sizes, group_off, bins, cap):
    """See `level1.balance_bins`: the least loaded bin by a scan (lowest index on a tie)."""
    out = [int(x) for x in bins]
    for g in range(len(group_off) - 1):
        a, b = int(group_off[g]), int(group_off[g + 1])
        if b - a < 2:
            continue
        lo, hi = min(out[a:b]), max(out[a:b])
        load = [0] * (hi - lo + 1)
        if len(load) < 2:
            continue
        assign = []
        for i in range(a, b):
            j = min(range(len(load)), key=lambda j: (load[j], j))
            if load[j] + int(sizes[i]) > cap:
                assign = None
                break
            load[j] += int(sizes[i])
            assign.append(lo + j)
        ffd_load = [0] * len(load)
        for i in range(a, b):
            ffd_load[int(bins[i]) - lo] += int(sizes[i])
        if assign is not None and max(load) <= max(ffd_load):
            out[a:b] = assign
    return np.array(out, np.int64)
