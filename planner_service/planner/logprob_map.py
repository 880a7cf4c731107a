"""Log-prob map of the plan builder: kernels and the step's entries grouped by microbatch.

    lp = logprob_map(forest, cfg, k, kept_mb, kept_row, M)    # LogprobMap: entries of microbatch m in bounds[m]:bounds[m+1]

Every trajectory position i >= 1 with a loss term (or every one, for log-prob export) gets one
entry: the row of token i-1 (its logits predict token i), the label token i, and the
trajectory-space fields at i (docs/design/plan-contract.md, "The log-prob map"). Each kernel has
a plain-Python twin (`*_ref`) or is checked against numpy in the tests.
Legend: T trajectories, N_e expanded positions, P log-prob entries, N_u forest tokens, M microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from numba import njit

from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig


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


@njit(cache=True)
def _update_path(t, traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, kept_mb, kept_row, tokens,
                 path_tok, path_mb, path_row, path_label, cur):
    """Make path_*[:n] describe trajectory t's tokens (n its length): forest token, keeping
    microbatch, local row there, token id. path_tok[:cur] holds the previous trajectory's, so only
    segments from the leaf up to the first one already on that path are rewritten (its ancestors
    are too). Returns n."""
    s = traj_seg[t]
    while s >= 0:
        d = seg_depth[s]
        if d < cur and path_tok[d] == seg_offset[s]:
            break
        for j in range(seg_length[s]):
            x = seg_offset[s] + j
            path_tok[d + j] = x
            path_mb[d + j] = kept_mb[x]
            path_row[d + j] = kept_row[x]
            path_label[d + j] = tokens[x]
        s = seg_parent[s]
    return traj_offset[t + 1] - traj_offset[t]


@njit(cache=True)
def lp_grouped(traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, loss_mask, all_positions,
               kept_mb, kept_row, tokens, M, advantages, old_logprobs, ref_logprobs):
    """Log-prob entries of every trajectory, grouped by microbatch (Numba).

    An entry is a trajectory position i >= 1 with loss_mask 1 (every i >= 1 when all_positions);
    it belongs to the microbatch keeping forest token i-1 (whose logits predict token i). Inside a
    microbatch entries are in (trajectory, position) order.

    Args:
        traj_offset, traj_seg, seg_*: the forest; loss_mask uint8 [N_e].
        kept_mb, kept_row: int64 [N_u] microbatch keeping every forest token and its local row there.
        tokens: int32 [N_u] token ids; M: number of microbatches.
        advantages, old_logprobs, ref_logprobs: float32 [N_e] trajectory-space fields (the
            log-prob ones may be empty: absent).

    Returns:
        bounds int64 [M+1]; per entry row, label, traj, pos int32 [P], loss_mask uint8 [P],
        advantage float32 [P], old and ref log-prob float32 [P] (or [0] when absent).
    """
    T = traj_seg.shape[0]
    L = 0
    for t in range(T):
        L = max(L, traj_offset[t + 1] - traj_offset[t])
    path_tok = np.empty(L, np.int64)
    path_mb = np.empty(L, np.int64)
    path_row = np.empty(L, np.int32)
    path_label = np.empty(L, np.int32)
    bounds = np.zeros(M + 1, np.int64)
    cur = 0
    for t in range(T):  # pass 1: count per microbatch
        cur = _update_path(t, traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, kept_mb, kept_row,
                           tokens, path_tok, path_mb, path_row, path_label, cur)
        base = traj_offset[t]
        for i in range(1, cur):  # branch-free: loss masks are close to random
            bounds[path_mb[i - 1] + 1] += 1 if all_positions else (loss_mask[base + i] != 0)
    for m in range(M):
        bounds[m + 1] += bounds[m]
    P = bounds[M]
    fill = bounds[:-1].copy()
    cur = 0
    has_old = old_logprobs.shape[0] > 0
    has_ref = ref_logprobs.shape[0] > 0
    mask = np.empty(P + 1, np.uint8)  # slot P takes the writes of skipped positions
    adv = np.empty(P + 1, np.float32)
    old = np.empty(P + 1 if has_old else 0, np.float32)
    ref = np.empty(P + 1 if has_ref else 0, np.float32)
    row = np.empty(P + 1, np.int32)
    label = np.empty(P + 1, np.int32)
    traj = np.empty(P + 1, np.int32)
    pos = np.empty(P + 1, np.int32)
    for t in range(T):  # pass 2: fill
        cur = _update_path(t, traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, kept_mb, kept_row,
                           tokens, path_tok, path_mb, path_row, path_label, cur)
        base = traj_offset[t]
        cur_m = -1
        k = 0
        for i in range(1, cur):
            m = path_mb[i - 1]
            if m != cur_m:  # runs of one microbatch: its fill position stays in a register
                if cur_m >= 0:
                    fill[cur_m] = k
                cur_m = m
                k = fill[m]
            keep = 1 if all_positions else np.int64(loss_mask[base + i] != 0)
            kk = k if keep else P
            k += keep
            mask[kk] = loss_mask[base + i]
            adv[kk] = advantages[base + i]
            if has_old:
                old[kk] = old_logprobs[base + i]
            if has_ref:
                ref[kk] = ref_logprobs[base + i]
            row[kk] = path_row[i - 1]
            label[kk] = path_label[i]
            traj[kk] = t
            pos[kk] = i
        if cur_m >= 0:
            fill[cur_m] = k
    return bounds, row[:P], label[:P], traj[:P], pos[:P], mask[:P], adv[:P], old[:P], ref[:P]


def lp_grouped_ref(traj_offset, traj_seg, seg_parent, seg_offset, seg_depth, seg_length, loss_mask, all_positions,
                   kept_mb, kept_row, tokens, M, advantages, old_logprobs, ref_logprobs):
    """Plain-Python twin of `lp_grouped` (per-microbatch lists; every trajectory's path rebuilt
    from its leaf segment)."""
    fields = [loss_mask, advantages] + [x for x in (old_logprobs, ref_logprobs) if len(x)]
    n = 4 + len(fields)
    cols: list[list[list]] = [[[] for _ in range(n)] for _ in range(M)]
    for t in range(len(traj_seg)):
        segs = []
        s = int(traj_seg[t])
        while s >= 0:
            segs.append(s)
            s = int(seg_parent[s])
        path = [x for s in reversed(segs) for x in range(int(seg_offset[s]), int(seg_offset[s]) + int(seg_length[s]))]
        base = int(traj_offset[t])
        for i in range(1, len(path)):
            if all_positions or loss_mask[base + i]:
                prev = path[i - 1]
                c = cols[int(kept_mb[prev])]
                vals = [int(kept_row[prev]), int(tokens[path[i]]), t, i] + [f[base + i] for f in fields]
                for col, v in zip(c, vals):
                    col.append(v)
    bounds = [0]
    for c in cols:
        bounds.append(bounds[-1] + len(c[0]))
    flat = [[v for c in cols for v in c[j]] for j in range(n)]
    out = [np.array(bounds, np.int64)] + [np.array(flat[j], np.int32) for j in range(4)]
    out += [np.array(flat[4], np.uint8), np.array(flat[5], np.float32)]
    k = 6
    for x in (old_logprobs, ref_logprobs):
        if len(x):
            out.append(np.array(flat[k], np.float32))
            k += 1
        else:
            out.append(np.zeros(0, np.float32))
    return tuple(out)


@dataclass(slots=True)
class LogprobMap:
    """The step's log-prob entries grouped by microbatch (`lp_grouped`)."""

    bounds: list[int]
    """Entries bounds[m]:bounds[m+1] belong to microbatch m."""
    columns: tuple
    """lp_grouped's output: bounds, row, label, traj, pos, loss mask, advantage, old, ref."""
    fields: tuple
    """(Microbatch field, dtype, column) of every log-prob field the plan carries."""


def logprob_map(forest: Forest, cfg: PlanConfig, k: SimpleNamespace, kept_mb, kept_row, M: int) -> LogprobMap:
    """Log-prob map, grouped by the microbatch keeping each entry's logits row."""
    none = np.zeros(0, np.float32)
    lp = k.lp_grouped(
        forest.traj_offset, forest.traj_seg, forest.seg_parent, forest.seg_offset, forest.seg_depth,
        forest.seg_length, forest.loss_mask, cfg.all_positions, kept_mb, kept_row, forest.tokens, M,
        forest.advantages, none if forest.old_logprobs is None else forest.old_logprobs,
        none if forest.ref_logprobs is None else forest.ref_logprobs,
    )
    fields = (
        ("lp_row", "int32", 1), ("lp_label", "int32", 2), ("lp_traj", "int32", 3), ("lp_pos", "int32", 4),
        ("lp_loss_mask", "uint8", 5), ("lp_advantage", "float32", 6),
    ) + (("lp_old_logprob", "float32", 7),) * (forest.old_logprobs is not None) + (
        ("lp_ref_logprob", "float32", 8),) * (forest.ref_logprobs is not None)
    return LogprobMap(bounds=lp[0].tolist(), columns=lp, fields=fields)

