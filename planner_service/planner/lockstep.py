"""Lock-step schedules: one global sequence of phases for all ranks (docs/design/lockstep.md).

    caps = equal_count_caps(counts, W, B, C, n)     # per rank forest: the capacity that packs into <= n microbatches
    sch = schedule(align_phases, mb_rank, wparent, cost, priority, forced, full, win, exports,
                   budget, W, power, rec_open, small_fill)       # Schedule, or None when the order stalls

`align_phases` builds the phases one at a time: every rank keeps its depth-first window rules and
picks its order online; `lockstep_ref.align_phases_ref` is its plain-Python twin. Linear in phases
x ranks plus O(M log M) for the per-rank heaps. Legend: M microbatches, W ranks, P phases.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from plan.phases import FORWARD_SHARE
from planner_service.planner.level1 import children_csr

#: Phase kinds as the kernels write them (plan_pb2.PhaseKind values).
FORWARD, BACKWARD, RECOMPUTE = 0, 1, 2
#: A voluntary recompute may cost this factor more than the phase's slowest forced recompute.
VOLUNTARY_SLACK = 1.3
#: Rank weights (remaining / largest remaining) ** p tried by the partitioner.
WEIGHT_POWERS = (1, 16)


@njit(cache=True)
def _ipow(x, p):
    out = 1.0
    for _ in range(p):
        out *= x
    return out


@njit(cache=True)
def _before(a, b, key):
    return key[a] > key[b] or (key[a] == key[b] and a < b)


@njit(cache=True)
def _heap_push(heap, base, size, m, key):
    i = size
    heap[base + i] = m
    while i > 0:
        j = (i - 1) // 2
        if not _before(heap[base + i], heap[base + j], key):
            break
        heap[base + i], heap[base + j] = heap[base + j], heap[base + i]
        i = j
    return size + 1


@njit(cache=True)
def _heap_pop(heap, base, size, key):
    size -= 1
    heap[base] = heap[base + size]
    i = 0
    while True:
        a = 2 * i + 1
        if a >= size:
            break
        if a + 1 < size and _before(heap[base + a + 1], heap[base + a], key):
            a += 1
        if not _before(heap[base + a], heap[base + i], key):
            break
        heap[base + i], heap[base + a] = heap[base + a], heap[base + i]
        i = a
    return size


@njit(cache=True)
def _subtree_needs(off, kids, full, win, exports):
    """int64 [M] the live bytes each window subtree needs on top of the open windows (the deepest
    stack of it: windows as they are), and the same with every window of it recomputed."""
    need = full.copy()
    need_rec = full.copy()
    for m in range(full.shape[0] - 1, -1, -1):
        top = 0
        top_rec = 0
        for i in range(off[m], off[m + 1]):
            top = max(top, need[kids[i]])
            top_rec = max(top_rec, need_rec[kids[i]])
        need[m] = max(full[m], win[m] + top)
        need_rec[m] = max(full[m], exports[m] + top_rec)
    return need, need_rec


@njit(cache=True)
def _pick_forward(h, s, t, off, kids, next_kid, opened, need, need_rec, open_bytes, budget, may_rec, small_fill):
    """What a rank opens in a FORWARD phase (docs/design/lockstep.md): (microbatch or -1, opened
    graph-less). h / s: its available microbatch of highest priority / smallest need (-1: none);
    t: its top window (-1: none); may_rec: it may open h graph-less (rec_open and the slack);
    next_kid (advanced past opened children) belongs to the rank's windows."""
    if h >= 0:
        if open_bytes + need[h] <= budget:
            return h, False
        if small_fill and open_bytes + need[s] <= budget:
            return s, False
        if may_rec and open_bytes + need_rec[h] <= budget:
            return h, True
    if t >= 0:  # the top window's next child fits (as it, or recomputed)
        while next_kid[t] < off[t + 1] and opened[kids[next_kid[t]]]:
            next_kid[t] += 1
        if next_kid[t] < off[t + 1]:
            m = kids[next_kid[t]]
            return m, open_bytes + need[m] > budget
    return -1, False


@njit(cache=True)
def _phase_kind(act, weight, pool):
    """The kind (0 FORWARD, 1 BACKWARD, 2 RECOMPUTE) whose able ranks (act[kind, r] >= 0) weigh
    most, BACKWARD only if every other rank holds a FORWARD stand-in (pool); ties BACKWARD,
    RECOMPUTE, FORWARD; -1 when no rank can run anything."""
    best = -1
    best_score = 0.0
    for kind in (1, 2, 0):
        score = 0.0
        able = 0
        paired = True
        for r in range(weight.shape[0]):
            if act[kind, r] >= 0:
                score += weight[r]
                able += 1
            elif kind == 1 and pool[r] == 0:
                paired = False
        if able and paired and (best < 0 or score > best_score):
            best = kind
            best_score = score
    return best


@njit(cache=True)
def align_phases(mb_rank, wparent, cost, priority, forced, full, win, exports, budget, world_size, power, vslack,
                 rec_open, small_fill):
    """Phases and every rank's steps (docs/design/lockstep.md, "How phases are built").

    Args:
        mb_rank: int64 [M] rank of each microbatch; wparent: int64 [M] its sharing-window parent
            (same rank, smaller id) or -1.
        cost: float64 [M] microbatch costs; priority: float64 [M] which available microbatch a
            rank opens first (the largest; e.g. its window subtree's cost); forced: bool [M] marked
            recompute (memory).
        full, win: int64 [M] live bytes while it runs, and as an open window; exports: int64 [M]
            its bytes as a recomputed open window; budget: M in bytes.
        power: int weight exponent p; vslack: VOLUNTARY_SLACK; rec_open: a rank whose next
            microbatch does not fit the memory left may open it graph-less (recomputed) if its
            remaining work stays below the slowest rank's; small_fill: when the highest-priority
            available microbatch does not fit, open the one that needs the least memory if it fits.

    Returns:
        phases int8 [P]; step_phase int64 [2M] and step_mb int64 [2M] the phase of every real
        step (phase order, ranks in order within a phase); voluntary bool [M] microbatches
        recomputed though not forced; the lock-step makespan (float64).
    """
    M = mb_rank.shape[0]
    W = world_size
    share = FORWARD_SHARE
    off, kids = children_csr(wparent)  # every dependent, on any rank
    lparent = wparent.copy()  # the window parent on the same rank (a window across ranks starts a local stack)
    for m in range(M):
        if wparent[m] >= 0 and mb_rank[wparent[m]] != mb_rank[m]:
            lparent[m] = -1
    loff, lkids = children_csr(lparent)
    sub = priority
    need, need_rec = _subtree_needs(loff, lkids, full, win, exports)
    count = np.zeros(W + 1, np.int64)
    rem = np.zeros(W, np.float64)
    for m in range(M):
        count[mb_rank[m] + 1] += 1
        rem[mb_rank[m]] += share * cost[m] + (cost[m] if forced[m] else (1.0 - share) * cost[m])
    for r in range(W):
        count[r + 1] += count[r]
    heap = np.empty(M, np.int64)  # available microbatches of each rank, highest priority first
    hsize = np.zeros(W, np.int64)
    small = np.empty(M, np.int64)  # ... and smallest need first
    ssize = np.zeros(W, np.int64)
    neg_need = -need.astype(np.float64)
    stack = np.empty(M, np.int64)
    sp = np.zeros(W, np.int64)
    for m in range(M):
        if wparent[m] < 0:
            r = mb_rank[m]
            hsize[r] = _heap_push(heap, count[r], hsize[r], m, sub)
            ssize[r] = _heap_push(small, count[r], ssize[r], m, neg_need)
    left = off[1:] - off[:-1]
    opened = np.zeros(M, np.bool_)
    is_rec = forced.copy()
    rec_act = np.zeros(W, np.bool_)
    next_kid = loff[:-1].copy()
    open_bytes = np.zeros(W, np.int64)
    pool = np.zeros(W, np.int64)
    phases = np.empty(3 * M + 1, np.int8)
    step_phase = np.empty(2 * M, np.int64)
    step_mb = np.empty(2 * M, np.int64)
    act = np.full((3, W), -1, np.int64)
    c = np.zeros((3, W), np.float64)
    weight = np.zeros(W, np.float64)
    P = 0
    n_steps = 0
    makespan = 0.0
    while n_steps < 2 * M and P < 3 * M + 1:
        crit = 0.0
        for r in range(W):
            crit = max(crit, rem[r])
        for r in range(W):
            weight[r] = _ipow(rem[r] / crit, power) if crit > 0 else 1.0
        cap = 0.0
        for r in range(W):
            act[0, r] = act[1, r] = act[2, r] = -1
            c[0, r] = c[1, r] = c[2, r] = 0.0
            while hsize[r] > 0 and opened[heap[count[r]]]:  # opened through the other heap or as a next child
                hsize[r] = _heap_pop(heap, count[r], hsize[r], sub)
            while ssize[r] > 0 and opened[small[count[r]]]:
                ssize[r] = _heap_pop(small, count[r], ssize[r], neg_need)
            m, rec_act[r] = _pick_forward(
                heap[count[r]] if hsize[r] > 0 else -1, small[count[r]] if ssize[r] > 0 else -1,
                stack[count[r] + sp[r] - 1] if sp[r] > 0 else -1, loff, lkids, next_kid, opened, need, need_rec,
                open_bytes[r], budget, rec_open and rem[r] + share * cost[heap[count[r]]] <= crit if hsize[r] > 0 else False,
                small_fill)
            if m >= 0:
                act[0, r] = m
                c[0, r] = share * cost[m]
            if sp[r] > 0:
                t = stack[count[r] + sp[r] - 1]
                if left[t] == 0:
                    if is_rec[t]:
                        act[2, r] = t
                        c[2, r] = cost[t]
                        cap = max(cap, cost[t])
                    else:
                        act[1, r] = t
                        c[1, r] = (1.0 - share) * cost[t]
        for r in range(W):  # voluntary recompute beside the phase's forced ones
            t = act[1, r]
            if t >= 0 and cap > 0 and cost[t] <= vslack * cap and rem[r] + share * cost[t] <= crit:
                act[2, r] = t
                c[2, r] = cost[t]
        kind = _phase_kind(act, weight, pool)
        phase_cost = 0.0
        if kind < 0 and (act >= 0).sum() == 0:  # every rank waits for another: a schedule this order cannot finish
            break
        if kind < 0:  # nothing can run: an all-stand-in FORWARD phase pairs later BACKWARD stand-ins
            phases[P] = 0
            for r in range(W):
                pool[r] += 1
            P += 1
            continue
        phases[P] = kind
        for r in range(W):
            m = act[kind, r]
            if m < 0:
                if kind == 0:
                    pool[r] += 1
                elif kind == 1:
                    pool[r] -= 1
                continue
            phase_cost = max(phase_cost, c[kind, r])
            step_phase[n_steps] = P
            step_mb[n_steps] = m
            n_steps += 1
            base = count[r]
            if kind == 0:
                opened[m] = True
                for i in range(off[m], off[m + 1]):  # its dependents become available on their ranks
                    rk = mb_rank[kids[i]]
                    hsize[rk] = _heap_push(heap, count[rk], hsize[rk], kids[i], sub)
                    ssize[rk] = _heap_push(small, count[rk], ssize[rk], kids[i], neg_need)
                stack[base + sp[r]] = m
                sp[r] += 1
                rem[r] -= share * cost[m]
                if rec_act[r] and not is_rec[m]:  # recomputed from now: its close runs the forward again
                    is_rec[m] = True
                    rem[r] += share * cost[m]
                open_bytes[r] += exports[m] if is_rec[m] else win[m]
            else:
                sp[r] -= 1
                open_bytes[r] -= exports[m] if is_rec[m] else win[m]
                if wparent[m] >= 0:
                    left[wparent[m]] -= 1
                if kind == 2 and not is_rec[m]:  # recomputed by choice at its close
                    is_rec[m] = True
                    rem[r] -= (1.0 - share) * cost[m]
                else:
                    rem[r] -= cost[m] if kind == 2 else (1.0 - share) * cost[m]
        makespan += phase_cost
        P += 1
    voluntary = is_rec & ~forced
    return phases[:P], step_phase[:n_steps], step_mb[:n_steps], voluntary, makespan


@dataclass(slots=True, kw_only=True)
class Schedule:
    """A lock-step schedule of the partition's microbatches."""

    phases: np.ndarray
    """uint8 [P] PhaseKind of every phase."""
    rank_steps: list[list[tuple[str, int]]]
    """Per rank, P steps ("F" | "B", microbatch id), microbatch -1 for a stand-in."""
    voluntary: np.ndarray
    """bool [M] microbatches to mark recompute (closed in a RECOMPUTE phase by choice)."""
    makespan: float
    """The lock-step makespan under the costs the schedule was aligned with."""


def schedule(align, mb_rank, wparent, cost, priority, forced, full, win, exports, budget: int, world_size: int,
             power: int, rec_open: bool, small_fill: bool) -> Schedule | None:
    """Align the phases (`align`: align_phases or its twin) and lay out every rank's steps.

    Returns None when the order stalls with every rank waiting for another (possible only with
    windows across ranks, whose importer and exporter wait for each other's phases)."""
    M = mb_rank.shape[0]
    phases, step_phase, step_mb, voluntary, makespan = align(
        np.asarray(mb_rank, np.int64), np.asarray(wparent, np.int64), np.asarray(cost, np.float64),
        np.asarray(priority, np.float64),
        np.asarray(forced, np.bool_), np.asarray(full, np.int64), np.asarray(win, np.int64),
        np.asarray(exports, np.int64), int(budget), world_size, power, VOLUNTARY_SLACK, rec_open, small_fill)
    if step_mb.shape[0] != 2 * M:
        wp, rk = np.asarray(wparent), np.asarray(mb_rank)
        if not ((wp >= 0) & (rk[np.maximum(wp, 0)] != rk)).any():  # the phase bound 3M + 1 holds (align_phases)
            raise AssertionError(f"lock-step alignment placed {step_mb.shape[0]} of {2 * M} steps in {phases.shape[0]} phases")
        return None
    P = phases.shape[0]
    grid = np.full((world_size, P), -1, np.int64)
    grid[np.asarray(mb_rank)[step_mb], step_phase] = step_mb
    kinds = np.where(phases == FORWARD, "F", "B").tolist()
    rank_steps = [list(zip(kinds, row)) for row in grid.tolist()]
    return Schedule(phases=phases.astype(np.uint8), rank_steps=rank_steps, voluntary=voluntary, makespan=float(makespan))


def equal_count_caps(counts, world_size: int, budget: int, chunk: int, n: int) -> np.ndarray:
    """int64 [W] per rank, the smallest capacity (to ~1.5%, <= budget) at which `counts(caps)`
    (int64 [W] microbatches per rank at capacities caps) stays <= n.

    Bisection on every rank at once (a rank's count depends on its own capacity only); a
    capacity below 2C is never tried (a unit plus its replay rows may need 2C - 1 rows).
    """
    hi = np.full(world_size, budget, np.int64)
    lo = np.full(world_size, 2 * chunk - 1, np.int64)
    while True:
        open_ = hi - lo > np.maximum(chunk, hi // 64)
        if not open_.any():
            return hi
        mid = np.where(open_, (lo + hi) // 2, hi)
        ok = counts(mid) <= n
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid, lo)
