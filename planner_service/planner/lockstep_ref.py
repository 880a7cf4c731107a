"""Plain-Python twin of `lockstep.align_phases` (per-rank lists and heapq).

    phases, step_phase, step_mb, voluntary, makespan = align_phases_ref(*the arguments of align_phases)

Same arguments, same arrays, same bits (tests/builder_helpers.py compares the two on every
lock-step plan the tests build; docs/design/lockstep.md). Legend: M microbatches, W ranks, P phases.
"""
from __future__ import annotations

import heapq

import numpy as np

from plan.phases import FORWARD_SHARE


def _ipow_ref(x: float, p: int) -> float:
    """Plain-Python twin of `lockstep._ipow`: the same multiplications, so the same bits."""
    out = 1.0
    for _ in range(p):
        out *= x
    return out


class _Aligner:
    """Every rank's state while the phases are built: available microbatches (heaps by priority
    and by memory need), the stack of open windows, open bytes, remaining cost, stand-in pool."""

    def __init__(self, mb_rank, wparent, cost, priority, forced, full, win, exports, budget, world_size):
        M, W = len(mb_rank), world_size
        self.mb_rank, self.wparent, self.cost, self.win, self.exports = mb_rank, wparent, cost, win, exports
        self.budget, self.W, self.share = budget, W, FORWARD_SHARE
        kids: list[list[int]] = [[] for _ in range(M)]
        for m in range(M):
            if wparent[m] >= 0:
                kids[int(wparent[m])].append(m)
        self.kids = kids
        self.local = [[k for k in kids[m] if mb_rank[k] == mb_rank[m]] for m in range(M)]
        self.sub = [float(x) for x in priority]
        need = [int(x) for x in full]
        need_rec = [int(x) for x in full]
        for m in reversed(range(M)):
            need[m] = max(int(full[m]), int(win[m]) + max((need[k] for k in self.local[m]), default=0))
            need_rec[m] = max(int(full[m]), int(exports[m]) + max((need_rec[k] for k in self.local[m]), default=0))
        self.need, self.need_rec = need, need_rec
        share = self.share
        self.rem = [0.0] * W
        for m in range(M):
            self.rem[int(mb_rank[m])] += share * cost[m] + (cost[m] if forced[m] else (1.0 - share) * cost[m])
        self.heaps: list[list[tuple[float, int]]] = [[] for _ in range(W)]
        self.smalls: list[list[tuple[int, int]]] = [[] for _ in range(W)]
        for m in range(M):
            if wparent[m] < 0:
                self._make_available(m)
        self.stacks: list[list[int]] = [[] for _ in range(W)]
        self.left = [len(k) for k in kids]
        self.opened = [False] * M
        self.is_rec = [bool(x) for x in forced]
        self.open_bytes, self.pool = [0] * W, [0] * W

    def _make_available(self, m: int) -> None:
        heapq.heappush(self.heaps[int(self.mb_rank[m])], (-self.sub[m], m))
        heapq.heappush(self.smalls[int(self.mb_rank[m])], (self.need[m], m))

    def _forward_pick(self, r: int, crit: float, rec_open: bool, small_fill: bool) -> tuple[int | None, bool]:
        """The microbatch rank r would open in a FORWARD phase (None: none) and whether graph-less."""
        heaps, smalls, opened, budget = self.heaps[r], self.smalls[r], self.opened, self.budget
        while heaps and opened[heaps[0][1]]:
            heapq.heappop(heaps)
        while smalls and opened[smalls[0][1]]:
            heapq.heappop(smalls)
        m, rec = None, False
        if heaps:
            h = heaps[0][1]
            if self.open_bytes[r] + self.need[h] <= budget:
                m = h
            elif small_fill and self.open_bytes[r] + self.need[smalls[0][1]] <= budget:
                m = smalls[0][1]
            elif (rec_open and self.open_bytes[r] + self.need_rec[h] <= budget
                  and self.rem[r] + self.share * self.cost[h] <= crit):
                m, rec = h, True
        if m is None and self.stacks[r]:
            waiting = [k for k in self.local[self.stacks[r][-1]] if not opened[k]]
            if waiting:
                m = waiting[0]
                rec = self.open_bytes[r] + self.need[m] > budget
        return m, rec

    def actions(self, crit: float, vslack: float, rec_open: bool, small_fill: bool):
        """Per phase kind (0 FORWARD, 1 BACKWARD, 2 RECOMPUTE), each rank's (microbatch, step
        cost) or None, and per rank whether its FORWARD would open graph-less."""
        W, share, cost = self.W, self.share, self.cost
        acts = {0: [None] * W, 1: [None] * W, 2: [None] * W}
        rec_act = [False] * W
        cap = 0.0
        for r in range(W):
            m, rec_act[r] = self._forward_pick(r, crit, rec_open, small_fill)
            if m is not None:
                acts[0][r] = (m, share * cost[m])
            stack = self.stacks[r]
            if stack and self.left[stack[-1]] == 0:
                t = stack[-1]
                if self.is_rec[t]:
                    acts[2][r] = (t, float(cost[t]))
                    cap = max(cap, float(cost[t]))
                else:
                    acts[1][r] = (t, (1.0 - share) * cost[t])
        for r in range(W):  # voluntary recomputation
            if acts[1][r] is not None:
                t = acts[1][r][0]
                if cap > 0 and cost[t] <= vslack * cap and self.rem[r] + share * cost[t] <= crit:
                    acts[2][r] = (t, float(cost[t]))
        return acts, rec_act

    def best_kind(self, acts, weight: list[float]) -> int:
        """The phase kind whose able ranks weigh most (-1: none possible)."""
        best, best_score = -1, 0.0
        for kind in (1, 2, 0):  # ties: BACKWARD, RECOMPUTE, FORWARD
            able = [r for r in range(self.W) if acts[kind][r] is not None]
            paired = kind != 1 or all(self.pool[r] > 0 for r in range(self.W) if acts[1][r] is None)
            score = 0.0
            for r in able:
                score += weight[r]
            if able and paired and (best < 0 or score > best_score):
                best, best_score = kind, score
        return best

    def run_phase(self, kind: int, acts, rec_act, phase: int, steps: list[tuple[int, int]]) -> float:
        """Every rank's step of one phase of `kind` (appended to `steps`); returns the phase's cost."""
        phase_cost = 0.0
        for r in range(self.W):
            a = acts[kind][r]
            if a is None:
                self.pool[r] += 1 if kind == 0 else -1 if kind == 1 else 0
                continue
            m, cm = a
            phase_cost = max(phase_cost, cm)
            steps.append((phase, m))
            if kind == 0:
                self._open(r, m, rec_act[r])
            else:
                self._close(r, m, kind)
        return phase_cost

    def _open(self, r: int, m: int, rec: bool) -> None:
        share, cost, is_rec = self.share, self.cost, self.is_rec
        self.opened[m] = True
        for k in self.kids[m]:
            self._make_available(k)
        self.stacks[r].append(m)
        self.rem[r] -= share * cost[m]
        if rec and not is_rec[m]:
            is_rec[m] = True
            self.rem[r] += share * cost[m]
        self.open_bytes[r] += int(self.exports[m] if is_rec[m] else self.win[m])

    def _close(self, r: int, m: int, kind: int) -> None:
        share, cost, is_rec = self.share, self.cost, self.is_rec
        self.stacks[r].pop()
        self.open_bytes[r] -= int(self.exports[m] if is_rec[m] else self.win[m])
        if self.wparent[m] >= 0:
            self.left[int(self.wparent[m])] -= 1
        if kind == 2 and not is_rec[m]:
            is_rec[m] = True
            self.rem[r] -= (1.0 - share) * cost[m]
        else:
            self.rem[r] -= cost[m] if kind == 2 else (1.0 - share) * cost[m]


def align_phases_ref(mb_rank, wparent, cost, priority, forced, full, win, exports, budget, world_size, power, vslack,
                     rec_open, small_fill):
    """Plain-Python twin of `lockstep.align_phases` (per-rank lists and heapq)."""
    M = len(mb_rank)
    al = _Aligner(mb_rank, wparent, cost, priority, forced, full, win, exports, budget, world_size)
    phases: list[int] = []
    steps: list[tuple[int, int]] = []
    makespan = 0.0
    while len(steps) < 2 * M and len(phases) < 3 * M + 1:
        crit = max(al.rem)
        weight = [_ipow_ref(x / crit, power) if crit > 0 else 1.0 for x in al.rem]
        acts, rec_act = al.actions(crit, vslack, rec_open, small_fill)
        best = al.best_kind(acts, weight)
        if best < 0 and not any(a is not None for kind in acts for a in acts[kind]):
            break  # every rank waits for another
        if best < 0:
            phases.append(0)
            al.pool = [x + 1 for x in al.pool]
            continue
        phases.append(best)
        makespan += al.run_phase(best, acts, rec_act, len(phases) - 1, steps)
    voluntary = np.array(al.is_rec, np.bool_) & ~np.asarray(forced, np.bool_)
    return (np.array(phases, np.int8), np.array([p for p, _ in steps], np.int64), np.array([m for _, m in steps], np.int64),
            voluntary, makespan)
