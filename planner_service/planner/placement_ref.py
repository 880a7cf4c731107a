"""Plain-Python oracles of the placement kernels (`placement.py`): same signatures and results,
written for reading (lists, sets, recursion-free walks). Tests compare both on seeded random
forests; `partition(..., impl="ref")` runs the whole placement on them (docs/design/planner.md).
"""
from __future__ import annotations

import numpy as np

from planner_service.planner.partition_ref import _children


def context_costs(unit_parent, w_dup):
    """See `placement.context_costs`: sum of w_dup over the strict ancestors."""
    out = []
    for u in range(len(unit_parent)):
        total, a = 0.0, int(unit_parent[u])
        path = []
        while a >= 0:
            path.append(float(w_dup[a]))
            a = int(unit_parent[a])
        for x in reversed(path):  # root first: the same float additions as the kernel
            total += x
        out.append(total)
    return np.array(out, np.float64)


def cut_parts(unit_parent, w, ctx, rc, cap):
    """See `placement.cut_parts`: keep children while the part fits, cut the costliest first."""
    n = len(unit_parent)
    kids = _children(unit_parent)
    resid = [0.0] * n
    cut = [False] * n
    bad = -1
    for u in reversed(range(n)):
        kept = sorted(kids[u], key=lambda c: -resid[c])  # stable: ties keep index order
        total = float(w[u])
        for c in kids[u]:
            total += resid[c]

        def extra(k: int) -> float:
            return (k - 1) * float(rc[u]) if k > 1 else 0.0

        j = 0
        while total + extra(len(kept) - j) + float(ctx[u]) > cap and j < len(kept):
            cut[kept[j]] = True
            total -= resid[kept[j]]
            j += 1
        if total + float(ctx[u]) > cap and bad < 0:
            bad = u
        resid[u] = total + extra(len(kept) - j)
    return np.array(cut, np.bool_), np.array(resid, np.float64), bad


def rank_closure(unit_parent, unit_rank, world_size):
    """See `placement.rank_closure`: per rank, the set of kept units and their ancestors."""
    cols: list[list] = [[], [], [], []]
    for r in range(world_size):
        units: set[int] = set()
        for u in range(len(unit_parent)):
            if int(unit_rank[u]) == r:
                a = u
                while a >= 0 and a not in units:
                    units.add(a)
                    a = int(unit_parent[a])
        ordered = sorted(units)
        pos = {u: len(cols[0]) + j for j, u in enumerate(ordered)}
        for u in ordered:
            p = int(unit_parent[u])
            for col, v in zip(cols, (u, r, int(unit_rank[u]) != r, pos[p] if p >= 0 else -1)):
                col.append(v)
    return (np.array(cols[0], np.int64), np.array(cols[1], np.int64), np.array(cols[2], np.bool_),
            np.array(cols[3], np.int64))


def closure_costs(ru_unit, ru_rank, ru_dup, ru_parent, w, w_dup, rc, world_size):
    """See `placement.closure_costs`."""
    cost = [0.0] * world_size
    dup = [0.0] * world_size
    nkids = [0] * len(ru_unit)
    for p in ru_parent:
        if p >= 0:
            nkids[int(p)] += 1
    for i, u in enumerate(ru_unit):
        r, u = int(ru_rank[i]), int(u)
        if ru_dup[i]:
            cost[r] += float(w_dup[u])
            dup[r] += float(w_dup[u])
        else:
            cost[r] += float(w[u])
        if nkids[i] > 1:
            cost[r] += (nkids[i] - 1) * float(rc[u])
    return np.array(cost, np.float64), np.array(dup, np.float64)


def rank_cost(unit_parent, unit_rank, r, w, w_dup, rc, stamp=None, nkids=None, buf=None):
    """See `placement.rank_cost` (the scratch arrays are not needed here)."""
    order: list[int] = []  # the kernel's summation order: kept units by index, each walked upwards
    seen: set[int] = set()
    for u in range(len(unit_parent)):
        if int(unit_rank[u]) == r:
            a = u
            while a >= 0 and a not in seen:
                seen.add(a)
                order.append(a)
                a = int(unit_parent[a])
    nk = {a: 0 for a in order}
    for a in order:
        if int(unit_parent[a]) >= 0:
            nk[int(unit_parent[a])] += 1
    cost = 0.0
    for a in order:
        cost += float(w[a]) if int(unit_rank[a]) == r else float(w_dup[a])
    for a in order:
        if nk[a] > 1:
            cost += (nk[a] - 1) * float(rc[a])
    return cost


def subtree_sizes(unit_parent):
    """See `placement.subtree_sizes`."""
    kids = _children(unit_parent)
    size = [1] * len(unit_parent)
    for u in reversed(range(len(unit_parent))):
        size[u] += sum(size[c] for c in kids[u])
    return np.array(size, np.int64)


def refine(unit_parent, unit_rank, w, w_dup, rc, world_size, rounds, candidates, target):
    """See `placement.refine`: the same moves, scored by walking explicit subtree and path sets."""
    U = len(unit_parent)
    kids = _children(unit_parent)

    def subtree(x: int) -> list[int]:
        out, todo = [], [x]
        while todo:
            u = todo.pop()
            out.append(u)
            todo.extend(kids[u])
        return sorted(out)

    def ancestors(u: int) -> list[int]:
        out, a = [], int(unit_parent[u])
        while a >= 0:
            out.append(a)
            a = int(unit_parent[a])
        return out

    cost = [rank_cost(unit_parent, unit_rank, r, w, w_dup, rc) for r in range(world_size)]
    moves = 0
    for _ in range(rounds):
        hi, lo = int(np.argmax(cost)), int(np.argmin(cost))
        if hi == lo or cost[hi] <= target:
            break
        held = set()
        for u in range(U):
            if int(unit_rank[u]) == lo:
                held.add(u)
                held.update(ancestors(u))
        ests = []
        for x in range(U):
            if int(unit_rank[x]) != hi:
                continue
            S = _masked_subtree_sum(unit_parent, kids, unit_rank, hi, w, x)
            ctx = 0.0
            for a in reversed(ancestors(x)):  # root first, like the kernel's running sum
                ctx += 0.0 if a in held else float(w_dup[a])
            ests.append((max(cost[hi] - S, cost[lo] + S + ctx), x))
        ests.sort(key=lambda e: e[0])  # stable: equal estimates keep unit order
        done = False
        for est, x in ests[:candidates]:
            if est >= cost[hi]:
                break
            moved = [u for u in subtree(x) if int(unit_rank[u]) == hi]
            unit_rank[moved] = lo
            c_hi = rank_cost(unit_parent, unit_rank, hi, w, w_dup, rc)
            c_lo = rank_cost(unit_parent, unit_rank, lo, w, w_dup, rc)
            if max(c_hi, c_lo) < cost[hi] * (1.0 - 1e-9):
                cost[hi], cost[lo] = c_hi, c_lo
                moves += 1
                done = True
                break
            unit_rank[moved] = hi
        if not done:
            break
    return np.array(cost, np.float64), moves


def _masked_subtree_sum(unit_parent, kids, unit_rank, r, w, x) -> float:
    """Sum of w over the units of x's subtree that rank r keeps, added as the kernel does (each
    unit's own cost, then its children's sums from the last child back)."""
    sums: dict[int, float] = {}
    for u in sorted(_descendants(kids, x), reverse=True):  # children (larger ids) first
        s = float(w[u]) if int(unit_rank[u]) == r else 0.0
        for c in reversed(kids[u]):
            s += sums[c]
        sums[u] = s
    return sums[x]


def _descendants(kids, x: int) -> list[int]:
    out, todo = [], [x]
    while todo:
        u = todo.pop()
        out.append(u)
        todo.extend(kids[u])
    return out


def lp_row_flags(traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, loss_mask, all_positions, n_tokens):
    """See `placement.lp_row_flags`: walk every trajectory's path from scratch."""
    flags = [0] * n_tokens
    for t in range(len(traj_seg)):
        path: list[int] = []
        s = int(traj_seg[t])
        while s >= 0:
            path = list(range(int(seg_offset[s]), int(seg_offset[s]) + int(seg_length[s]))) + path
            s = int(seg_parent[s])
        base = int(traj_offset[t])
        for i in range(1, len(path)):
            if all_positions or loss_mask[base + i]:
                flags[path[i - 1]] = 1
    return np.array(flags, np.uint8)


def subtree_sums(unit_parent, w):
    """See `placement.subtree_sums`: add every unit to each of its ancestors."""
    kids = _children(unit_parent)
    out = [0.0] * len(unit_parent)
    for u in reversed(range(len(unit_parent))):
        total = float(w[u])
        for c in reversed(kids[u]):  # the kernel adds children from the last one
            total += out[c]
        out[u] = total
    return np.array(out, np.float64)


def placement_costs(unit_parent, unit_rank, w, w_dup, rc, world_size):
    """See `placement.placement_costs`: `closure_costs` of `rank_closure`."""
    return closure_costs(*rank_closure(unit_parent, unit_rank, world_size), w, w_dup, rc, world_size)


def lpt_parts(unit_parent, part, part_root, part_resid, w_dup, ctx, world_size, fit=-1.0):
    """See `placement.lpt_parts`: per rank the set of units its forest holds."""
    held: list[set[int]] = [set() for _ in range(world_size)]
    load = [0.0] * world_size
    ranks = []
    members: dict[int, list[int]] = {}
    for u, root in enumerate(part):
        members.setdefault(int(root), []).append(u)
    for i, root in enumerate(part_root):
        root = int(root)
        path = []  # strict ancestors, nearest first
        a = int(unit_parent[root])
        while a >= 0:
            path.append(a)
            a = int(unit_parent[a])
        top = path[-1] if path else root
        vals, misses = [], []
        for r in range(world_size):
            miss = float(ctx[root])
            if path and top in held[r]:
                miss = 0.0
                for a in path:  # the kernel's order: nearest ancestor first, stop at a held one
                    if a in held[r]:
                        break
                    miss += float(w_dup[a])
            misses.append(miss)
            vals.append(load[r] + float(part_resid[i]) + miss)
        fits = [r for r in range(world_size) if vals[r] <= fit]
        best = min(fits, key=lambda r: (misses[r], vals[r], r)) if fits else min(range(world_size), key=lambda r: (vals[r], r))
        ranks.append(best)
        load[best] = vals[best]
        held[best].update(path)
        held[best].update(members[root])
    return np.array(ranks, np.int64), np.array(load, np.float64)
