"""Numba kernels of the plan builder over flat arrays, each with a plain-Python twin (`*_ref`).

    k = build._KERNELS["numba"]        # or ["ref"]: the twins, same arguments, same arrays
    ranges = k.attn_ranges(...)        # local_segments, attn_ranges, conv_ancestors, *_occurrence, ...

A twin loops over Python ints and lists (no numpy vector ops) and returns the same arrays, so both
builder modes give byte-identical plans (tests/planner_service/test_plan_builder.py). The log-prob
map's kernels are in `logprob_map.py` (docs/design/planner.md, "The builder").
Legend: S segments, R local rows, I imported rows, K conv kernel, T trajectories, N_u forest tokens.
"""
from __future__ import annotations

import numpy as np
from numba import njit


# ---------------------------------------------------------------------------------------------
# Per-token index and token ranges.


@njit(cache=True)
def token_index(seg_parent, seg_offset, seg_length, seg_depth):
    """Segment, offset in it, depth and path predecessor (-1 at depth 0) of every forest token.

    Segments tile the tokens in order (seg_offset is the running sum of seg_length).

    Returns:
        seg, off, depth, pred: int32 [N_u] (the wire contract's row and depth width; half the
        memory traffic of int64 at full scale).
    """
    S = seg_parent.shape[0]
    n = 0
    for s in range(S):
        n += seg_length[s]
    seg = np.empty(n, np.int32)
    off = np.empty(n, np.int32)
    depth = np.empty(n, np.int32)
    pred = np.empty(n, np.int32)
    x = 0
    for s in range(S):
        p = seg_parent[s]
        first_pred = seg_offset[p] + seg_length[p] - 1 if p >= 0 else -1
        for j in range(seg_length[s]):
            o = x - seg_offset[s]
            seg[x] = s
            off[x] = o
            depth[x] = seg_depth[s] + o
            pred[x] = x - 1 if o > 0 else first_pred
            x += 1
    return seg, off, depth, pred


def token_index_ref(seg_parent, seg_offset, seg_length, seg_depth):
    """Plain-Python twin of `token_index`."""
    cols: list[list[int]] = [[], [], [], []]
    x = 0
    for s in range(len(seg_parent)):
        p = int(seg_parent[s])
        first_pred = int(seg_offset[p]) + int(seg_length[p]) - 1 if p >= 0 else -1
        for _ in range(int(seg_length[s])):
            o = x - int(seg_offset[s])
            for col, v in zip(cols, (s, o, int(seg_depth[s]) + o, x - 1 if o > 0 else first_pred)):
                col.append(v)
            x += 1
    return tuple(np.array(c, np.int32) for c in cols)


@njit(cache=True)
def expand_ranges(start, length):
    """int64 [sum(length)] the tokens start[i] .. start[i] + length[i] - 1 of every range, in order."""
    n = 0
    for i in range(start.shape[0]):
        n += length[i]
    out = np.empty(n, np.int64)
    k = 0
    for i in range(start.shape[0]):
        for j in range(length[i]):
            out[k] = start[i] + j
            k += 1
    return out


def expand_ranges_ref(start, length):
    """Plain-Python twin of `expand_ranges`."""
    return np.array([x for a, n in zip(start, length) for x in range(int(a), int(a) + int(n))], np.int64)


# ---------------------------------------------------------------------------------------------
# Local segments of one microbatch.


@njit(cache=True)
def local_segments(toks, dup, tok_seg, tok_pred, ctx_tok, shared):
    """Runs of consecutive tokens of one forest segment and one duplication flag, linked to parents.

    Args:
        toks: int64 [n] the microbatch's rows as forest tokens, sorted; dup: uint8 [n] 1 for a
            duplicated context row.
        tok_seg, tok_pred: int64 [N_u] forest segment and path predecessor of every forest token.
        ctx_tok: int64 [I] sorted context tokens (imported when `shared`).
        shared: the microbatch is a sharing-window child (roots may attach to imported rows).

    Returns:
        first int64 [S], length int64 [S], seg_dup uint8 [S], parent int32 [S] (local segment,
        -1), attach int32 [S] (context index of an imported predecessor, -1), bad int64 (-1, or
        a segment whose predecessor is neither local nor imported).
    """
    n = toks.shape[0]
    S = 0
    for i in range(n):
        if i == 0 or toks[i] != toks[i - 1] + 1 or tok_seg[toks[i]] != tok_seg[toks[i - 1]] or dup[i] != dup[i - 1]:
            S += 1
    first = np.empty(S, np.int64)
    length = np.zeros(S, np.int64)
    seg_dup = np.empty(S, np.uint8)
    last = np.empty(S, np.int64)
    k = -1
    for i in range(n):
        if i == 0 or toks[i] != toks[i - 1] + 1 or tok_seg[toks[i]] != tok_seg[toks[i - 1]] or dup[i] != dup[i - 1]:
            k += 1
            first[k] = toks[i]
            seg_dup[k] = dup[i]
        length[k] += 1
        last[k] = toks[i]
    parent = np.full(S, -1, np.int32)
    attach = np.full(S, -1, np.int32)
    I = ctx_tok.shape[0]
    for i in range(S):
        p = tok_pred[first[i]]
        if p < 0:
            continue
        j = np.searchsorted(last, p)
        if j < S and last[j] == p:
            parent[i] = j
            continue
        if shared:
            j = np.searchsorted(ctx_tok, p)
            if j < I and ctx_tok[j] == p:
                attach[i] = j
                continue
        return first, length, seg_dup, parent, attach, np.int64(i)
    return first, length, seg_dup, parent, attach, np.int64(-1)


def local_segments_ref(toks, dup, tok_seg, tok_pred, ctx_tok, shared):
    """Plain-Python twin of `local_segments`."""
    toks, dup = [int(x) for x in toks], [int(x) for x in dup]
    first: list[int] = []
    length: list[int] = []
    seg_dup: list[int] = []
    last_pos: dict[int, int] = {}
    prev = None
    for t, d in zip(toks, dup):
        if prev is None or t != prev[0] + 1 or int(tok_seg[t]) != int(tok_seg[prev[0]]) or d != prev[1]:
            first.append(t)
            length.append(0)
            seg_dup.append(d)
        length[-1] += 1
        prev = (t, d)
    for i, (a, n) in enumerate(zip(first, length)):
        last_pos[a + n - 1] = i
    ctx_pos = {int(t): j for j, t in enumerate(ctx_tok)} if shared else {}
    S = len(first)
    parent, attach = [-1] * S, [-1] * S
    bad = -1
    for i in range(S):
        p = int(tok_pred[first[i]])
        if p < 0:
            continue
        if p in last_pos:
            parent[i] = last_pos[p]
        elif p in ctx_pos:
            attach[i] = ctx_pos[p]
        else:
            bad = i
            break
    return (np.array(first, np.int64), np.array(length, np.int64), np.array(seg_dup, np.uint8),
            np.array(parent, np.int32), np.array(attach, np.int32), bad)


@njit(cache=True)
def local_rows_layout(order, first, seg_dup_in, row_seg, seg_start, tok_seg, tok_off, kept_row):
    """Forest identity of every packed segment and local row; records in kept_row (int64 [N_u])
    the local row of every kept (not duplicated) forest token.

    Args:
        order: int32 [S] packed position -> local segment; first int64 [S] and seg_dup_in uint8 [S]
            per local segment (`local_segments`); row_seg int32 [R], seg_start int32 [S] (packed).
        tok_seg, tok_off: int64 [N_u] forest segment and offset in it of every forest token.

    Returns:
        seg_forest int32 [S], seg_forest_offset int32 [S], seg_dup uint8 [S] (packed order),
        local_tok int64 [R] forest token of every local row.
    """
    S = order.shape[0]
    R = row_seg.shape[0]
    seg_forest = np.empty(S, np.int32)
    seg_off = np.empty(S, np.int32)
    seg_dup = np.empty(S, np.uint8)
    p_first = np.empty(S, np.int64)
    for i in range(S):
        f = first[order[i]]
        p_first[i] = f
        seg_forest[i] = tok_seg[f]
        seg_off[i] = tok_off[f]
        seg_dup[i] = seg_dup_in[order[i]]
    local_tok = np.empty(R, np.int64)
    for r in range(R):
        i = row_seg[r]
        local_tok[r] = p_first[i] + r - seg_start[i]
        if seg_dup[i] == 0:
            kept_row[local_tok[r]] = r
    return seg_forest, seg_off, seg_dup, local_tok


def local_rows_layout_ref(order, first, seg_dup_in, row_seg, seg_start, tok_seg, tok_off, kept_row):
    """Plain-Python twin of `local_rows_layout`."""
    p_first = [int(first[i]) for i in order]
    seg_forest = [int(tok_seg[f]) for f in p_first]
    seg_off = [int(tok_off[f]) for f in p_first]
    seg_dup = [int(seg_dup_in[i]) for i in order]
    starts = [int(x) for x in seg_start]
    local_tok = [p_first[i] + r - starts[i] for r, i in enumerate(int(x) for x in row_seg)]
    for r, i in enumerate(int(x) for x in row_seg):
        if seg_dup[i] == 0:
            kept_row[local_tok[r]] = r
    return (np.array(seg_forest, np.int32), np.array(seg_off, np.int32), np.array(seg_dup, np.uint8),
            np.array(local_tok, np.int64))


@njit(cache=True)
def ext_parent_depth(row_parent, row_depth, imp_tok, tok_pred, tok_depth):
    """int32 [R + I] predecessor extended row and depth of every extended row: the R local rows,
    then the I imported context tokens (sorted), whose predecessors are imported too."""
    R = row_parent.shape[0]
    I = imp_tok.shape[0]
    parent = np.empty(R + I, np.int32)
    depth = np.empty(R + I, np.int32)
    for r in range(R):
        parent[r] = row_parent[r]
        depth[r] = row_depth[r]
    for i in range(I):
        p = tok_pred[imp_tok[i]]
        if p < 0:
            parent[R + i] = -1
        elif i > 0 and imp_tok[i - 1] == p:  # the usual case: the previous token of a segment
            parent[R + i] = R + i - 1
        else:
            parent[R + i] = R + np.searchsorted(imp_tok, p)
        depth[R + i] = tok_depth[imp_tok[i]]
    return parent, depth


def ext_parent_depth_ref(row_parent, row_depth, imp_tok, tok_pred, tok_depth):
    """Plain-Python twin of `ext_parent_depth`."""
    R = len(row_parent)
    index = {int(t): i for i, t in enumerate(imp_tok)}
    parent = [int(x) for x in row_parent]
    depth = [int(x) for x in row_depth]
    for t in imp_tok:
        p = int(tok_pred[t])
        parent.append(R + index[p] if p >= 0 else -1)
        depth.append(int(tok_depth[t]))
    return np.array(parent, np.int32), np.array(depth, np.int32)


@njit(cache=True)
def sorted_union(rows, n):
    """int64 sorted distinct values of `rows` (all in [0, n)), in O(len(rows) + n)."""
    seen = np.zeros(n, np.bool_)
    k = 0
    for r in rows:
        if not seen[r]:
            seen[r] = True
            k += 1
    out = np.empty(k, np.int64)
    j = 0
    for r in range(n):
        if seen[r]:
            out[j] = r
            j += 1
    return out


def sorted_union_ref(rows, n: int):
    """Plain-Python twin of `sorted_union`."""
    return np.array(sorted({int(r) for r in rows}), np.int64)


# ---------------------------------------------------------------------------------------------
# Attention ancestry.


@njit(cache=True)
def _imported_runs(x, ext_parent, buf, out, k):
    """Runs of consecutive rows on the path ending at extended row x, root first: written as
    [start, end) pairs into out[k:] (a 1-row `out` only counts them); returns k plus the count.
    `buf` is scratch space of at least the path's length."""
    n = 0
    y = x
    while y >= 0:
        buf[n] = y
        n += 1
        y = ext_parent[y]
    i = n - 1
    while i >= 0:  # buf[n-1] is the root-most row
        a = buf[i]
        j = i
        while j > 0 and buf[j - 1] == buf[j] + 1:
            j -= 1
        if out.shape[0] > 1:
            out[k, 0] = a
            out[k, 1] = buf[j] + 1
        k += 1
        i = j - 1
    return k


@njit(cache=True)
def attn_ranges(seg_start, seg_length, seg_parent, row_parent, ext_parent):
    """Compact ancestor ranges of every packed segment.

    A segment with a local parent attends to its parent's ranges plus the parent's rows (merged
    into the last range when adjacent); a root attends to the runs of its imported path.

    Args:
        seg_start, seg_length, seg_parent: int32 [S] packed local segments (parents first).
        row_parent: int32 [R + I] and ext_parent: int32 [R + I] extended-row predecessors.

    Returns:
        offsets int32 [S+1], ranges int32 [n, 2] half-open extended-row ranges.
    """
    S = seg_start.shape[0]
    cnt = np.zeros(S, np.int64)
    last_end = np.full(S, -1, np.int64)
    buf = np.empty(ext_parent.shape[0] + 1, np.int64)
    dummy = np.empty((1, 2), np.int32)
    for s in range(S):
        p = seg_parent[s]
        if p >= 0:
            lo = seg_start[p]
            cnt[s] = cnt[p] if (cnt[p] > 0 and last_end[p] == lo) else cnt[p] + 1
            last_end[s] = lo + seg_length[p]
            continue
        x = row_parent[seg_start[s]]
        if x >= 0:
            cnt[s] = _imported_runs(x, ext_parent, buf, dummy, 0)
            last_end[s] = x + 1
    offsets = np.zeros(S + 1, np.int32)
    for s in range(S):
        offsets[s + 1] = offsets[s] + cnt[s]
    out = np.empty((max(offsets[S], 2), 2), np.int32)
    for s in range(S):
        k = offsets[s]
        p = seg_parent[s]
        if p >= 0:
            a = offsets[p]
            for i in range(cnt[p]):
                out[k + i, 0] = out[a + i, 0]
                out[k + i, 1] = out[a + i, 1]
            lo = seg_start[p]
            if cnt[s] == cnt[p]:
                out[k + cnt[p] - 1, 1] = lo + seg_length[p]
            else:
                out[k + cnt[p], 0] = lo
                out[k + cnt[p], 1] = lo + seg_length[p]
            continue
        x = row_parent[seg_start[s]]
        if x >= 0:
            _imported_runs(x, ext_parent, buf, out, k)
    return offsets, out[: offsets[S]].copy()


def attn_ranges_ref(seg_start, seg_length, seg_parent, row_parent, ext_parent):
    """Plain-Python twin of `attn_ranges` (lists of tuples per segment, imported paths cached)."""
    S = len(seg_start)
    per_seg: list[list[tuple[int, int]]] = [[] for _ in range(S)]
    imported: dict[int, list[tuple[int, int]]] = {}
    for s in range(S):
        p = int(seg_parent[s])
        if p >= 0:
            lo, hi = int(seg_start[p]), int(seg_start[p]) + int(seg_length[p])
            out = list(per_seg[p])
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
            per_seg[s] = out
            continue
        x = int(row_parent[int(seg_start[s])])
        if x < 0:
            continue
        if x not in imported:
            rows = []
            y = x
            while y >= 0:
                rows.append(y)
                y = int(ext_parent[y])
            rows.reverse()
            runs: list[tuple[int, int]] = []
            for y in rows:
                if runs and runs[-1][1] == y:
                    runs[-1] = (runs[-1][0], y + 1)
                else:
                    runs.append((y, y + 1))
            imported[x] = runs
        per_seg[s] = imported[x]
    offsets = [0]
    for r in per_seg:
        offsets.append(offsets[-1] + len(r))
    flat = [v for r in per_seg for pair in r for v in pair]
    return np.array(offsets, np.int32), np.array(flat, np.int32).reshape(-1, 2)


# ---------------------------------------------------------------------------------------------
# Conv ancestry.


@njit(cache=True)
def conv_ancestors(ext_parent, R, K):
    """int32 [R, K-1] the K-1 predecessors of each local row, oldest first, -1 padded."""
    w = max(K - 1, 0)
    out = np.full((R, w), -1, np.int32)
    for r in range(R):
        y = ext_parent[r]
        j = w - 1
        while j >= 0 and y >= 0:
            out[r, j] = y
            y = ext_parent[y]
            j -= 1
    return out


def conv_ancestors_ref(ext_parent, R: int, K: int):
    """Plain-Python twin of `conv_ancestors`."""
    w = max(K - 1, 0)
    rows = []
    for r in range(R):
        row = [-1] * w
        y = int(ext_parent[r])
        j = w - 1
        while j >= 0 and y >= 0:
            row[j] = y
            y = int(ext_parent[y])
            j -= 1
        rows.append(row)
    return np.array(rows, np.int32).reshape(R, w)


# ---------------------------------------------------------------------------------------------
# Occurrence counts.


@njit(cache=True)
def subtree_occurrence(traj_seg, seg_parent):
    """int64 [S] trajectories ending in each forest segment's subtree (parents precede children)."""
    S = seg_parent.shape[0]
    occ = np.zeros(S, np.int64)
    for t in range(traj_seg.shape[0]):
        occ[traj_seg[t]] += 1
    for s in range(S - 1, -1, -1):
        p = seg_parent[s]
        if p >= 0:
            occ[p] += occ[s]
    return occ


def subtree_occurrence_ref(traj_seg, seg_parent):
    """Plain-Python twin of `subtree_occurrence`."""
    occ = [0] * len(seg_parent)
    for s in traj_seg:
        occ[int(s)] += 1
    for s in range(len(seg_parent) - 1, -1, -1):
        p = int(seg_parent[s])
        if p >= 0:
            occ[p] += occ[s]
    return np.array(occ, np.int64)


@njit(cache=True)
def row_occurrence(row_seg, seg_forest, seg_dup, occ_seg):
    """int32 [R] occurrence of every local row: its forest segment's, 0 for duplicated rows."""
    R = row_seg.shape[0]
    out = np.empty(R, np.int32)
    for r in range(R):
        s = row_seg[r]
        out[r] = 0 if seg_dup[s] == 1 else occ_seg[seg_forest[s]]
    return out


def row_occurrence_ref(row_seg, seg_forest, seg_dup, occ_seg):
    """Plain-Python twin of `row_occurrence`."""
    return np.array([0 if int(seg_dup[s]) == 1 else int(occ_seg[seg_forest[s]]) for s in row_seg], np.int32)
