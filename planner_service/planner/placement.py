"""Placement kernels: which rank keeps each unit of the unit forest, minimising the step's makespan.

    parts = cut_parts(...)         # Kundu-Misra over unit costs, each part with its duplicated root path
    lpt_parts(...); rank_closure(...); closure_costs(...); refine(...)

A part is a connected subtree of units one rank keeps; a part whose root is not a forest root also
needs its root path there, as duplicated rows. `placement_search.place_units` drives these kernels
(docs/design/planner.md, "Placement"); plain-Python oracles: `placement_ref.py`.
Legend: U units, P parts, W ranks, n units of all rank forests together.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from planner_service.planner.level1 import children_csr, group_by, stamp_path


@njit(cache=True)
def context_costs(unit_parent, w_dup):
    """float64 [U] cost of the root path strictly above each unit (preorder: parents first)."""
    U = unit_parent.shape[0]
    ctx = np.zeros(U, np.float64)
    for u in range(U):
        p = unit_parent[u]
        if p >= 0:
            ctx[u] = ctx[p] + w_dup[p]
    return ctx


@njit(cache=True)
def cut_parts(unit_parent, w, ctx, rc, cap):
    """Kundu-Misra greedy with duplicated prefixes: the fewest connected parts of cost <= cap.

    Args:
        unit_parent: int [U] the unit forest (preorder).
        w: float64 [U] cost of each unit when kept; ctx: float64 [U] cost of its duplicated root
            path (`context_costs`); rc: float64 [U] cost of the replay rows every kept child beyond
            the first adds at the unit's end (bounded replay at an unaligned branch).
        cap: part capacity (cost).

    Returns:
        cut bool [U] (True: the unit roots a part below another part), resid float64 [U] (cost of
        the unit's part of its part, without the prefix), bad int64 (-1, or a unit whose cost plus
        prefix exceeds cap even alone).
    """
    n = unit_parent.shape[0]
    off, kids = children_csr(unit_parent)
    resid = np.zeros(n, np.float64)
    cut = np.zeros(n, np.bool_)
    bad = np.int64(-1)
    for u in range(n - 1, -1, -1):
        lo = off[u]
        hi = off[u + 1]
        k = hi - lo
        total = w[u]
        for i in range(lo, hi):
            total += resid[kids[i]]
        extra = (k - 1) * rc[u] if k > 1 else 0.0
        if total + extra + ctx[u] > cap:
            order = np.argsort(-resid[kids[lo:hi]], kind="mergesort")
            j = 0
            while total + extra + ctx[u] > cap and j < k:
                c = kids[lo + order[j]]
                cut[c] = True
                total -= resid[c]
                j += 1
                extra = (k - j - 1) * rc[u] if k - j > 1 else 0.0
            if total + ctx[u] > cap and bad < 0:
                bad = u
        resid[u] = total + extra
    return cut, resid, bad


@njit(cache=True)
def rank_closure(unit_parent, unit_rank, world_size):
    """Every rank's forest: the units it keeps plus all their ancestors (duplicated there).

    Args:
        unit_parent: int [U] (preorder); unit_rank: int [U] rank keeping each unit.

    Returns:
        ru_unit int64 [n] (global unit), ru_rank int64 [n], ru_dup bool [n] (an ancestor kept by
        another rank), ru_parent int64 [n] (index into these arrays, -1 at a root), grouped by
        rank, units in preorder within a rank.
    """
    U = unit_parent.shape[0]
    by_rank, cnt = group_by(unit_rank, world_size)
    stamp = np.full(U, -1, np.int64)
    pos = np.empty(U, np.int64)
    mark = np.empty(U, np.int64)
    total = 0
    for r in range(world_size):  # pass 1: sizes
        m = 0
        for i in range(cnt[r], cnt[r + 1]):
            m, _ = stamp_path(unit_parent, by_rank[i], stamp, r, mark, m)
        total += m
    ru_unit = np.empty(total, np.int64)
    ru_rank = np.empty(total, np.int64)
    ru_dup = np.empty(total, np.bool_)
    ru_parent = np.empty(total, np.int64)
    stamp[:] = -1
    k = 0
    for r in range(world_size):
        m = 0
        for i in range(cnt[r], cnt[r + 1]):
            m, _ = stamp_path(unit_parent, by_rank[i], stamp, r, mark, m)
        units = np.sort(mark[:m])
        for j in range(m):
            pos[units[j]] = k + j
        for j in range(m):
            u = units[j]
            ru_unit[k + j] = u
            ru_rank[k + j] = r
            ru_dup[k + j] = unit_rank[u] != r
            p = unit_parent[u]
            ru_parent[k + j] = pos[p] if p >= 0 else -1
        k += m
    return ru_unit, ru_rank, ru_dup, ru_parent


@njit(cache=True)
def closure_costs(ru_unit, ru_rank, ru_dup, ru_parent, w, w_dup, rc, world_size):
    """Cost of every rank's forest: kept units at w, duplicated ones at w_dup, plus the replay
    rows (rc) of every child beyond the first at each branch of the rank's forest.

    Returns:
        cost float64 [W], dup float64 [W] (the duplicated units' share).
    """
    n = ru_unit.shape[0]
    cost = np.zeros(world_size, np.float64)
    dup = np.zeros(world_size, np.float64)
    nkids = np.zeros(n, np.int64)
    for i in range(n):
        p = ru_parent[i]
        if p >= 0:
            nkids[p] += 1
    for i in range(n):
        r = ru_rank[i]
        u = ru_unit[i]
        if ru_dup[i]:
            cost[r] += w_dup[u]
            dup[r] += w_dup[u]
        else:
            cost[r] += w[u]
        if nkids[i] > 1:
            cost[r] += (nkids[i] - 1) * rc[u]
    return cost, dup


@njit(cache=True)
def placement_costs(unit_parent, unit_rank, w, w_dup, rc, world_size):
    """`closure_costs` of every rank straight from unit_rank, without building the rank forests.

    Returns:
        cost float64 [W], dup float64 [W] (the duplicated units' share).
    """
    U = unit_parent.shape[0]
    by_rank, cnt = group_by(unit_rank, world_size)
    stamp = np.full(U, -1, np.int64)
    nkids = np.zeros(U, np.int64)
    buf = np.empty(U, np.int64)
    cost = np.zeros(world_size, np.float64)
    dup = np.zeros(world_size, np.float64)
    for r in range(world_size):
        m = 0
        for i in range(cnt[r], cnt[r + 1]):
            m, _ = stamp_path(unit_parent, by_rank[i], stamp, r, buf, m)
        for j in range(m):
            nkids[buf[j]] = 0
        for j in range(m):
            p = unit_parent[buf[j]]
            if p >= 0:
                nkids[p] += 1
        units = np.sort(buf[:m])  # preorder: the summation order of closure_costs
        for j in range(m):
            a = units[j]
            if unit_rank[a] == r:
                cost[r] += w[a]
            else:
                cost[r] += w_dup[a]
                dup[r] += w_dup[a]
            if nkids[a] > 1:
                cost[r] += (nkids[a] - 1) * rc[a]
    return cost, dup


@njit(cache=True)
def rank_cost(unit_parent, unit_rank, r, w, w_dup, rc, stamp, nkids, buf):
    """Cost of rank r's forest (`closure_costs` of one rank). stamp, nkids, buf: int64 [U] scratch;
    stamp must be all -1 and is left so."""
    U = unit_parent.shape[0]
    m = 0
    for u in range(U):
        if unit_rank[u] == r:
            m, _ = stamp_path(unit_parent, u, stamp, r, buf, m)
    cost = 0.0
    for j in range(m):
        nkids[buf[j]] = 0
    for j in range(m):
        a = buf[j]
        p = unit_parent[a]
        if p >= 0:
            nkids[p] += 1
    for j in range(m):
        a = buf[j]
        cost += w[a] if unit_rank[a] == r else w_dup[a]
    for j in range(m):
        a = buf[j]
        if nkids[a] > 1:
            cost += (nkids[a] - 1) * rc[a]
        stamp[a] = -1
    return cost


@njit(cache=True)
def subtree_sizes(unit_parent):
    """int64 [U] units in each unit's subtree; in preorder the subtree of u is u .. u + size - 1."""
    U = unit_parent.shape[0]
    size = np.ones(U, np.int64)
    for u in range(U - 1, -1, -1):
        p = unit_parent[u]
        if p >= 0:
            size[p] += size[u]
    return size


@njit(cache=True)
def refine(unit_parent, unit_rank, w, w_dup, rc, world_size, rounds, candidates, target):
    """Move subtrees from the busiest rank to the idlest while that lowers the makespan.

    Each round looks at every unit x the busiest rank keeps: moving the units of x's subtree that
    it keeps to the idlest rank takes their cost S(x) off the busiest rank and adds S(x) plus the
    part of x's root path the idlest rank does not hold yet (its duplicated prefix) to the idlest.
    Of the `candidates` moves with the smallest estimated max(busiest, idlest), the first (in
    estimate order) whose exact costs (`rank_cost` of both ranks after the move) lower the larger
    of the two below the busiest rank's cost is made. Splitting a tree this way duplicates the
    prefix of the cut edge on the other rank; moving a whole part moves a boundary segment.

    Args:
        unit_parent: int [U] the unit forest (preorder); unit_rank: int64 [U] (updated in place).
        w, w_dup, rc: unit costs kept, duplicated and per extra child's replay.
        rounds: most moves; candidates: moves scored exactly per round at most; target: stop
            once the busiest rank's cost is at most this.

    Returns:
        rank costs float64 [W], number of moves made.
    """
    U = unit_parent.shape[0]
    size = subtree_sizes(unit_parent)
    stamp = np.full(U, -1, np.int64)
    nkids = np.zeros(U, np.int64)
    buf = np.empty(U, np.int64)
    cost = np.zeros(world_size, np.float64)
    for r in range(world_size):
        cost[r] = rank_cost(unit_parent, unit_rank, r, w, w_dup, rc, stamp, nkids, buf)
    S = np.zeros(U, np.float64)
    held = np.zeros(U, np.bool_)
    moved = np.zeros(U, np.bool_)
    ctx_lo = np.zeros(U, np.float64)
    cand = np.empty(candidates, np.int64)
    cand_score = np.empty(candidates, np.float64)
    moves = 0
    for _ in range(rounds):
        hi = np.argmax(cost)
        lo = np.argmin(cost)
        if hi == lo or cost[hi] <= target:
            break
        # S: cost of each subtree's units kept by hi; held: units of lo's forest
        for u in range(U):
            S[u] = w[u] if unit_rank[u] == hi else 0.0
            held[u] = False
        for u in range(U - 1, -1, -1):
            p = unit_parent[u]
            if p >= 0:
                S[p] += S[u]
        for u in range(U):
            if unit_rank[u] == lo:
                a = u
                while a >= 0 and not held[a]:
                    held[a] = True
                    a = unit_parent[a]
        for u in range(U):
            p = unit_parent[u]
            ctx_lo[u] = 0.0 if p < 0 else ctx_lo[p] + (0.0 if held[p] else w_dup[p])
        n = 0
        for x in range(U):
            if unit_rank[x] != hi:
                continue
            est = max(cost[hi] - S[x], cost[lo] + S[x] + ctx_lo[x])
            if n < candidates:
                j = n
                n += 1
            elif est < cand_score[n - 1]:
                j = n - 1
            else:
                continue
            while j > 0 and cand_score[j - 1] > est:  # the list stays sorted by estimate
                cand_score[j] = cand_score[j - 1]
                cand[j] = cand[j - 1]
                j -= 1
            cand_score[j] = est
            cand[j] = x
        done = False
        for i in range(n):  # the first candidate, in estimate order, that really lowers the makespan
            x = cand[i]
            if cand_score[i] >= cost[hi]:
                break
            for u in range(x, x + size[x]):
                moved[u] = unit_rank[u] == hi
                if moved[u]:
                    unit_rank[u] = lo
            c_hi = rank_cost(unit_parent, unit_rank, hi, w, w_dup, rc, stamp, nkids, buf)
            c_lo = rank_cost(unit_parent, unit_rank, lo, w, w_dup, rc, stamp, nkids, buf)
            if max(c_hi, c_lo) < cost[hi] * (1.0 - 1e-9):
                cost[hi] = c_hi
                cost[lo] = c_lo
                moves += 1
                done = True
                break
            for u in range(x, x + size[x]):
                if moved[u]:
                    unit_rank[u] = hi
        if not done:
            break
    return cost, moves


@njit(cache=True)
def lp_row_flags(traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, loss_mask, all_positions, n_tokens):
    """uint8 [N_u] 1 for every forest token whose logits some log-prob entry reads (the token
    before a loss position of a trajectory through it; every non-final one with all_positions)."""
    flags = np.zeros(n_tokens, np.uint8)
    T = traj_seg.shape[0]
    L = 0
    for t in range(T):
        L = max(L, traj_offset[t + 1] - traj_offset[t])
    path_tok = np.full(L, -1, np.int64)
    cur = 0
    for t in range(T):
        s = traj_seg[t]
        while s >= 0:  # rewrite the path from the leaf up to the first segment shared with the previous one
            d = seg_depth[s]
            if d < cur and path_tok[d] == seg_offset[s]:
                break
            for j in range(seg_length[s]):
                path_tok[d + j] = seg_offset[s] + j
            s = seg_parent[s]
        cur = traj_offset[t + 1] - traj_offset[t]
        base = traj_offset[t]
        for i in range(1, cur):
            if all_positions or loss_mask[base + i] != 0:
                flags[path_tok[i - 1]] = 1
    return flags


@njit(cache=True)
def subtree_sums(unit_parent, w):
    """float64 [U] sum of w over each unit's subtree (preorder: children after parents)."""
    out = w.astype(np.float64)
    for u in range(unit_parent.shape[0] - 1, -1, -1):
        p = unit_parent[u]
        if p >= 0:
            out[p] += out[u]
    return out


@njit(cache=True)
def lpt_parts(unit_parent, part, part_root, part_resid, w_dup, ctx, world_size, fit=-1.0):
    """Longest processing time first over parts, each to the rank where it ends soonest counting
    only the prefix that rank does not hold yet (parts of one tree share their root paths).
    With `fit` >= 0, a part goes instead to the rank that adds the least duplicated prefix among
    those where it ends by `fit` (the soonest of them on a tie), if there is one: with more ranks
    than large trees, plain LPT spreads a tree's parts over idle ranks, each duplicating the root
    path, where packing them onto a rank that holds it would end the step no later.

    Args:
        unit_parent: int [U] (preorder); part: int64 [U] root unit of every unit's part.
        part_root: int64 [P] the part roots, in placement order (costliest first);
        part_resid: float64 [P] their costs without the prefix; w_dup: float64 [U]; ctx: float64
            [U] the whole prefix's cost (`context_costs`: what a rank holding none of the tree adds).
        fit: a step length to pack parts under (see above), or < 0 for plain LPT.

    Returns:
        rank int64 [P] per part (in the given order), load float64 [W] estimated rank costs.
    """
    U = unit_parent.shape[0]
    P = part_root.shape[0]
    W = world_size
    top = np.empty(U, np.int64)  # tree root of every unit
    for u in range(U):
        p = unit_parent[u]
        top[u] = u if p < 0 else top[p]
    index = np.full(U, -1, np.int64)  # placement position of every part root
    for i in range(P):
        index[part_root[i]] = i
    members, off = group_by(index[part], P)  # units of each part, contiguous
    held = np.zeros((W, U), np.bool_)
    load = np.zeros(W, np.float64)
    rank = np.empty(P, np.int64)
    for i in range(P):
        root = part_root[i]
        best = 0
        best_val = np.inf
        fit_rank = -1
        fit_miss = np.inf
        fit_val = np.inf
        for r in range(W):
            miss = ctx[root]
            a = unit_parent[root]
            if a >= 0 and held[r, top[root]]:
                miss = 0.0
                while a >= 0 and not held[r, a]:
                    miss += w_dup[a]
                    a = unit_parent[a]
            val = load[r] + part_resid[i] + miss
            if val < best_val:
                best_val = val
                best = r
            if val <= fit and (miss < fit_miss or (miss == fit_miss and val < fit_val)):
                fit_rank = r
                fit_miss = miss
                fit_val = val
        if fit_rank >= 0:
            best = fit_rank
            best_val = fit_val
        rank[i] = best
        load[best] = best_val
        a = unit_parent[root]
        while a >= 0 and not held[best, a]:
            held[best, a] = True
            a = unit_parent[a]
        for t in range(off[i], off[i + 1]):
            held[best, members[t]] = True
    return rank, load
