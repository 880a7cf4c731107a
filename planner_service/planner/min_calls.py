"""Minimum sequential linear-attention calls and the order that realises it (docs/design/min-calls.md).

    n = min_calls(seg_parent, seg_depth, seg_length, C)               # the optimum, per segment in linear time
    packed = pack(seg_parent, seg_depth, seg_length, seg_attach, C)   # rows depth-first, continuing child first
    sched = forest_schedule(seg_parent, seg_depth, seg_length, C, replay=True)   # calls, sequences, states

Each Numba function has a plain-Python twin `*_ref` with the same contract (the test oracle);
`min_calls_chunk_tree_ref` is an independent oracle that builds the chunk tree explicitly.
Legend: S segments, numbered so that a parent precedes its children.
"""
from __future__ import annotations

import sys

import numpy as np
from numba import njit


@njit(cache=True)
def _insert_top2(a1: int, a2: int, v: int) -> tuple[int, int]:
    if v > a1:
        return v, a1
    if v > a2:
        return a1, v
    return a1, a2


@njit(cache=True)
def segment_top2(seg_parent: np.ndarray, seg_depth: np.ndarray, seg_length: np.ndarray, chunk: int):
    """Top two f-values of M(s) for every segment (Numba).

    Args:
        seg_parent: int32 [S] parent segment, -1 for a root; parents precede children.
        seg_depth: int32 [S] depth of the first token.
        seg_length: int32 [S] number of tokens (>= 1).
        chunk: chunk size C.

    Returns:
        (top1, top2): int32 [S] each; top2 is 0 when M(s) has a single value.
    """
    S = seg_parent.shape[0]
    u1 = np.zeros(S, np.int32)
    u2 = np.zeros(S, np.int32)
    top1 = np.zeros(S, np.int32)
    top2 = np.zeros(S, np.int32)
    for s in range(S - 1, -1, -1):
        if u1[s] == 0:
            m1, m2 = 1, 0
        else:
            d = seg_depth[s]
            e = d + seg_length[s]
            if e % chunk != 0 and d // chunk == e // chunk:
                m1, m2 = u1[s], u2[s]
            else:
                m1, m2 = max(u1[s], u2[s] + 1), 0
        top1[s] = m1
        top2[s] = m2
        p = seg_parent[s]
        if p >= 0:
            a1, a2 = _insert_top2(u1[p], u2[p], m1)
            a1, a2 = _insert_top2(a1, a2, m2)
            u1[p] = a1
            u2[p] = a2
    return top1, top2


def segment_top2_ref(seg_parent, seg_depth, seg_length, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Plain-Python twin of `segment_top2`: keeps the whole multiset M(s), then its top two."""
    S = len(seg_parent)
    children: list[list[int]] = [[] for _ in range(S)]
    for s in range(S):
        if seg_parent[s] >= 0:
            children[int(seg_parent[s])].append(s)
    multiset: list[list[int]] = [[] for _ in range(S)]
    for s in reversed(range(S)):
        if not children[s]:
            multiset[s] = [1]
            continue
        union = sorted((v for c in children[s] for v in multiset[c]), reverse=True)
        d = int(seg_depth[s])
        e = d + int(seg_length[s])
        if e % chunk and d // chunk == e // chunk:
            multiset[s] = union
        else:
            second = union[1] if len(union) > 1 else 0
            multiset[s] = [max(union[0], second + 1)]
    top1 = np.array([m[0] for m in multiset], np.int32)
    top2 = np.array([m[1] if len(m) > 1 else 0 for m in multiset], np.int32)
    return top1, top2


def min_calls(seg_parent, seg_depth, seg_length, chunk: int) -> int:
    """Minimum number of sequential calls for a forest whose roots all start in call 1 (Numba)."""
    seg_parent = np.ascontiguousarray(seg_parent, np.int32)
    if seg_parent.shape[0] == 0:
        return 0
    top1, _ = segment_top2(
        seg_parent, np.ascontiguousarray(seg_depth, np.int32), np.ascontiguousarray(seg_length, np.int32), chunk
    )
    return int(top1[seg_parent < 0].max())


def min_calls_chunk_tree_ref(seg_parent, seg_depth, seg_length, chunk: int) -> int:
    """Independent oracle: build the chunk tree explicitly and evaluate f on it.

    A chunk node is named by its last row on its path (segment, offset). Roots may start at any
    depth d (window pieces): their first chunk is the partial chunk [d, (floor(d/C)+1)C).
    """
    S = len(seg_parent)
    if S == 0:
        return 0
    has_child = [False] * S
    for s in range(S):
        if seg_parent[s] >= 0:
            has_child[int(seg_parent[s])] = True
    children: dict[tuple, set] = {}
    roots: set = set()
    for leaf in range(S):
        if has_child[leaf]:
            continue
        path = []  # (depth, segment, offset), root first
        s = leaf
        while s >= 0:
            path.extend((int(seg_depth[s]) + o, s, o) for o in reversed(range(int(seg_length[s]))))
            s = int(seg_parent[s])
        path.reverse()
        first_depth = path[0][0]
        prev = None
        for k in range(first_depth // chunk, path[-1][0] // chunk + 1):
            last_depth = min((k + 1) * chunk, path[-1][0] + 1) - 1
            node = (k,) + path[last_depth - first_depth][1:]
            if prev is None:
                roots.add(node)
            else:
                children.setdefault(prev, set()).add(node)
            prev = node

    memo: dict[tuple, int] = {}

    def f(v) -> int:
        if v not in memo:
            vals = sorted((f(c) for c in children.get(v, ())), reverse=True)
            if not vals:
                memo[v] = 1
            else:
                memo[v] = max(vals[0], (vals[1] if len(vals) > 1 else 0) + 1)
        return memo[v]

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    return max(f(r) for r in roots)


@njit(cache=True)
def continuing_order(seg_parent: np.ndarray, top1: np.ndarray):
    """Depth-first preorder of segments, each segment's children by decreasing top1 (Numba).

    Ties keep segment index order. Roots are visited in index order.

    Args:
        seg_parent: int32 [S] parents precede children.
        top1: int32 [S] from `segment_top2`.

    Returns:
        (order, continues): int32 [S] segments in preorder; uint8 [S] 1 where a segment is the
        first-visited child of its parent (it continues the parent's sequence).
    """
    S = seg_parent.shape[0]
    count = np.zeros(S + 1, np.int64)
    for s in range(S):
        count[seg_parent[s] + 1] += 1
    start = np.zeros(S + 2, np.int64)
    for i in range(S + 1):
        start[i + 1] = start[i] + count[i]
    fill = start[:-1].copy()
    kids = np.empty(S, np.int32)
    for s in range(S):
        slot = seg_parent[s] + 1
        kids[fill[slot]] = s
        fill[slot] += 1
    # Stable insertion sort of each parent's children by decreasing top1 (roots stay in order).
    for p in range(1, S + 1):
        for i in range(start[p] + 1, start[p + 1]):
            v = kids[i]
            j = i - 1
            while j >= start[p] and top1[kids[j]] < top1[v]:
                kids[j + 1] = kids[j]
                j -= 1
            kids[j + 1] = v
    continues = np.zeros(S, np.uint8)
    for p in range(1, S + 1):
        if start[p + 1] > start[p]:
            continues[kids[start[p]]] = 1
    order = np.empty(S, np.int32)
    stack = np.empty(S, np.int32)
    n = 0
    top = 0
    for i in range(start[1] - 1, start[0] - 1, -1):
        stack[top] = kids[i]
        top += 1
    while top > 0:
        top -= 1
        s = stack[top]
        order[n] = s
        n += 1
        for i in range(start[s + 2] - 1, start[s + 1] - 1, -1):
            stack[top] = kids[i]
            top += 1
    return order, continues


def continuing_order_ref(seg_parent, top1) -> tuple[np.ndarray, np.ndarray]:
    """Plain-Python twin of `continuing_order` (recursive-style walk with sorted())."""
    S = len(seg_parent)
    children: list[list[int]] = [[] for _ in range(S)]
    roots = []
    for s in range(S):
        (children[int(seg_parent[s])] if seg_parent[s] >= 0 else roots).append(s)
    continues = np.zeros(S, np.uint8)
    order: list[int] = []
    stack = list(reversed(roots))
    while stack:
        s = stack.pop()
        order.append(s)
        kids = sorted(children[s], key=lambda c: (-int(top1[c]), c))
        if kids:
            continues[kids[0]] = 1
        stack.extend(reversed(kids))
    return np.array(order, np.int32), continues


@njit(cache=True)
def chain_end(seg_start: np.ndarray, seg_length: np.ndarray, first_child: np.ndarray) -> np.ndarray:
    """int32 [S] end row of each segment's continuing chain (segments in packed preorder).

    Args:
        seg_start, seg_length: int32 [S] packed rows of each segment (preorder numbering).
        first_child: int32 [S] the continuing child of each segment, -1 for a leaf.
    """
    S = seg_start.shape[0]
    out = np.empty(S, np.int32)
    for s in range(S - 1, -1, -1):
        c = first_child[s]
        out[s] = seg_start[s] + seg_length[s] if c < 0 else out[c]
    return out


@njit(cache=True)
def schedule(
    seg_start: np.ndarray,
    seg_length: np.ndarray,
    seg_parent: np.ndarray,
    seg_continues: np.ndarray,
    row_parent: np.ndarray,
    row_depth: np.ndarray,
    state_after: np.ndarray,
    chunk: int,
    replay: bool,
):
    """Sequences and calls of one packed local forest (Numba).

    Rows 0..R-1 are local (packed depth-first, continuing child first); rows >= R are imported
    (extended rows). Every sequence owns a contiguous range of local rows.

    Args:
        seg_start, seg_length, seg_parent: int32 [S] local segments in packed preorder.
        seg_continues: uint8 [S] 1 where the segment continues its parent's sequence.
        row_parent: int32 [R + I] predecessor extended row on the path, -1 at depth 0.
        row_depth: int32 [R + I] depth of each extended row.
        state_after: uint8 [R] rows after which some consumer outside this forest needs the
            state (only used with replay=False, to split sequences at unaligned export depths).
        chunk: chunk size C.
        replay: True for bounded replay from chunk-aligned states; False for the ablation.

    Returns:
        seq_start, seq_end, seq_depth, seq_init, seq_call: int32 [Q] owned row range, start depth
        (first replay row's, else first owned row's), extended row whose after-state is the initial
        state (-1 = zero state), 0-based call index; replay_offsets int64 [Q+1] and replay_rows
        int32 [*] (depth order); seq_of_row int32 [R].
    """
    S = seg_start.shape[0]
    R = state_after.shape[0]
    first_child = np.full(S, -1, np.int32)
    for s in range(S):
        if seg_continues[s] == 1:
            first_child[seg_parent[s]] = s
    ends = chain_end(seg_start, seg_length, first_child)
    need = state_after.copy()
    if not replay:
        for s in range(S):
            if seg_continues[s] == 0 and seg_parent[s] >= 0:
                p = seg_parent[s]
                need[seg_start[p] + seg_length[p] - 1] = 1
    cap = 2 * S + R + 1
    seq_start = np.empty(cap, np.int32)
    seq_end = np.empty(cap, np.int32)
    seq_depth = np.empty(cap, np.int32)
    seq_init = np.empty(cap, np.int32)
    seq_call = np.empty(cap, np.int32)
    replay_offsets = np.zeros(cap + 1, np.int64)
    replay_rows = np.empty(S * max(chunk - 1, 1) + 1, np.int32)
    seq_of_row = np.full(R, -1, np.int32)
    q = 0
    nrep = 0
    for h in range(S):
        if seg_continues[h] == 1:
            continue
        r = seg_start[h]
        end = ends[h]
        d = row_depth[r]
        if replay:
            b = (d // chunk) * chunk
            x = r
            for i in range(d - b):
                x = row_parent[x]
                replay_rows[nrep + d - b - 1 - i] = x
            nrep += d - b
            init = row_parent[x] if b > 0 else -1
            depth0 = b
        else:
            init = row_parent[r]
            depth0 = d
        replay_offsets[q + 1] = nrep
        call = 0 if (init < 0 or init >= R) else seq_call[seq_of_row[init]] + 1
        # Own rows r..end-1; without replay, split where an unaligned export is needed.
        lo = r
        for y in range(r, end):
            seq_of_row[y] = q
            if (not replay) and y + 1 < end and need[y] == 1 and (row_depth[y] + 1 - depth0) % chunk != 0:
                seq_start[q] = lo
                seq_end[q] = y + 1
                seq_depth[q] = depth0
                seq_init[q] = init
                seq_call[q] = call
                q += 1
                replay_offsets[q + 1] = nrep
                lo = y + 1
                init = y
                depth0 = row_depth[y] + 1
                call = call + 1
        seq_start[q] = lo
        seq_end[q] = end
        seq_depth[q] = depth0
        seq_init[q] = init
        seq_call[q] = call
        q += 1
    return (
        seq_start[:q].copy(),
        seq_end[:q].copy(),
        seq_depth[:q].copy(),
        seq_init[:q].copy(),
        seq_call[:q].copy(),
        replay_offsets[: q + 1].copy(),
        replay_rows[:nrep].copy(),
        seq_of_row,
    )


def schedule_ref(
    seg_start, seg_length, seg_parent, seg_continues, row_parent, row_depth, state_after, chunk: int, replay: bool
):
    """Plain-Python twin of `schedule` (same contract, lists and dicts)."""
    S = len(seg_start)
    R = len(state_after)
    kids: dict[int, int] = {int(seg_parent[s]): s for s in range(S) if seg_continues[s]}

    def owned_end(s: int) -> int:
        while s in kids:
            s = kids[s]
        return int(seg_start[s] + seg_length[s])

    need = set(int(y) for y in np.flatnonzero(state_after))
    if not replay:
        for s in range(S):
            if not seg_continues[s] and seg_parent[s] >= 0:
                p = int(seg_parent[s])
                need.add(int(seg_start[p] + seg_length[p] - 1))
    seqs = []  # (start, end, depth, init, call, replay list)
    seq_of_row = [-1] * R
    for h in range(S):
        if seg_continues[h]:
            continue
        r = int(seg_start[h])
        d = int(row_depth[r])
        reps: list[int] = []
        if replay:
            b = d - d % chunk
            x = r
            while int(row_depth[x]) > b:
                x = int(row_parent[x])
                reps.insert(0, x)
            init = int(row_parent[x]) if b > 0 else -1
            depth0 = b
        else:
            init = int(row_parent[r])
            depth0 = d
        call = 0 if init < 0 or init >= R else seqs[seq_of_row[init]][4] + 1
        lo = r
        end = owned_end(h)
        for y in range(r, end):
            seq_of_row[y] = len(seqs)
            aligned = (int(row_depth[y]) + 1 - depth0) % chunk == 0
            if not replay and y + 1 < end and y in need and not aligned:
                seqs.append((lo, y + 1, depth0, init, call, reps))
                reps = []
                lo, init, depth0, call = y + 1, y, int(row_depth[y]) + 1, call + 1
        seqs.append((lo, end, depth0, init, call, reps))
    col = lambda i: np.array([s[i] for s in seqs], np.int32)  # noqa: E731
    offsets = np.concatenate([[0], np.cumsum([len(s[5]) for s in seqs])]).astype(np.int64)
    flat = np.array([x for s in seqs for x in s[5]], np.int32)
    return col(0), col(1), col(2), col(3), col(4), offsets, flat, np.array(seq_of_row, np.int32)


def pack(seg_parent, seg_depth, seg_length, seg_attach, chunk: int, *, use_numba: bool = True) -> dict:
    """Pack a local forest depth-first, continuing child first, and lay out its rows.

    Args:
        seg_parent: int32 [S] local parent, -1 for a root; parents precede children.
        seg_depth, seg_length: int32 [S].
        seg_attach: int32 [S] for roots, the imported row (0..I-1) that precedes the root's first
            row on its path, -1 when the root starts at depth 0 (ignored for non-roots).
        chunk: chunk size C.
        use_numba: False runs the plain-Python twins (tests).

    Returns:
        dict with `order` int32 [S] (packed position -> input segment), and, in packed order,
        `seg_start`, `seg_length`, `seg_parent`, `seg_continues`, `seg_depth`, `top1`; per local
        row `row_seg` (packed segment), `row_depth`, `row_parent` (extended rows, R + attach for
        an imported predecessor); `num_rows` R.
    """
    seg_parent = np.ascontiguousarray(seg_parent, np.int32)
    seg_depth = np.ascontiguousarray(seg_depth, np.int32)
    seg_length = np.ascontiguousarray(seg_length, np.int32)
    seg_attach = np.ascontiguousarray(seg_attach, np.int32)
    top2_fn, order_fn = (segment_top2, continuing_order) if use_numba else (segment_top2_ref, continuing_order_ref)
    top1, _ = top2_fn(seg_parent, seg_depth, seg_length, chunk)
    order, continues = order_fn(seg_parent, top1)
    rows_fn = pack_rows if use_numba else pack_rows_ref
    p_start, p_length, p_parent, p_continues, p_depth, p_top1, row_seg, row_depth, row_parent = rows_fn(
        order, continues, top1, seg_parent, seg_depth, seg_length, seg_attach
    )
    return {
        "order": order,
        "seg_start": p_start,
        "seg_length": p_length,
        "seg_parent": p_parent,
        "seg_continues": p_continues,
        "seg_depth": p_depth,
        "top1": p_top1,
        "row_seg": row_seg,
        "row_depth": row_depth,
        "row_parent": row_parent,
        "num_rows": int(row_seg.shape[0]),
    }


@njit(cache=True)
def pack_rows(order, continues, top1, seg_parent, seg_depth, seg_length, seg_attach):
    """Segment and row tables of a packed local forest (Numba; the layout step of `pack`).

    Args:
        order: int32 [S] packed position -> input segment; continues uint8 [S], top1 int32 [S]
            per input segment; seg_parent, seg_depth, seg_length, seg_attach: int32 [S] as in `pack`.

    Returns:
        in packed order, int32/uint8 [S] seg_start, seg_length, seg_parent, seg_continues (uint8),
        seg_depth, top1; int32 [R] row_seg, row_depth, row_parent (R + attach for an imported
        predecessor).
    """
    S = order.shape[0]
    pos = np.empty(S, np.int32)
    for i in range(S):
        pos[order[i]] = i
    p_start = np.empty(S, np.int32)
    p_length = np.empty(S, np.int32)
    p_parent = np.empty(S, np.int32)
    p_continues = np.empty(S, np.uint8)
    p_depth = np.empty(S, np.int32)
    p_top1 = np.empty(S, np.int32)
    R = 0
    for i in range(S):
        s = order[i]
        p_start[i] = R
        p_length[i] = seg_length[s]
        p_parent[i] = pos[seg_parent[s]] if seg_parent[s] >= 0 else -1
        p_continues[i] = continues[s]
        p_depth[i] = seg_depth[s]
        p_top1[i] = top1[s]
        R += seg_length[s]
    row_seg = np.empty(R, np.int32)
    row_depth = np.empty(R, np.int32)
    row_parent = np.empty(R, np.int32)
    for i in range(S):
        a = p_start[i]
        p = p_parent[i]
        if p >= 0:
            first_pred = p_start[p] + p_length[p] - 1
        elif seg_attach[order[i]] >= 0:
            first_pred = R + seg_attach[order[i]]
        else:
            first_pred = -1
        for j in range(p_length[i]):
            row_seg[a + j] = i
            row_depth[a + j] = p_depth[i] + j
            row_parent[a + j] = first_pred if j == 0 else a + j - 1
    return p_start, p_length, p_parent, p_continues, p_depth, p_top1, row_seg, row_depth, row_parent


def pack_rows_ref(order, continues, top1, seg_parent, seg_depth, seg_length, seg_attach):
    """Plain-Python twin of `pack_rows`."""
    order = [int(x) for x in order]
    pos = {s: i for i, s in enumerate(order)}
    p_start, p_length, p_parent, p_cont, p_depth, p_top1 = [], [], [], [], [], []
    R = 0
    for s in order:
        p_start.append(R)
        p_length.append(int(seg_length[s]))
        p_parent.append(pos[int(seg_parent[s])] if seg_parent[s] >= 0 else -1)
        p_cont.append(int(continues[s]))
        p_depth.append(int(seg_depth[s]))
        p_top1.append(int(top1[s]))
        R += int(seg_length[s])
    row_seg, row_depth, row_parent = [], [], []
    for i, s in enumerate(order):
        p = p_parent[i]
        if p >= 0:
            first_pred = p_start[p] + p_length[p] - 1
        elif seg_attach[s] >= 0:
            first_pred = R + int(seg_attach[s])
        else:
            first_pred = -1
        for j in range(p_length[i]):
            row_seg.append(i)
            row_depth.append(p_depth[i] + j)
            row_parent.append(first_pred if j == 0 else p_start[i] + j - 1)
    i32 = lambda v: np.array(v, np.int32)  # noqa: E731
    return (i32(p_start), i32(p_length), i32(p_parent), np.array(p_cont, np.uint8), i32(p_depth), i32(p_top1),
            i32(row_seg), i32(row_depth), i32(row_parent))


def forest_schedule(seg_parent, seg_depth, seg_length, chunk: int, *, replay: bool = True, use_numba: bool = True) -> dict:
    """Schedule a whole forest as one microbatch (every root at depth 0) and summarise it.

    Returns:
        dict: `calls` (number of sequential calls), `replay_tokens`, `states` (distinct handed-over
        states), `sequences`, plus the raw `pack` and `schedule` outputs under `packed`/`sched`.
    """
    S = len(seg_parent)
    packed = pack(seg_parent, seg_depth, seg_length, np.full(S, -1, np.int32), chunk, use_numba=use_numba)
    fn = schedule if use_numba else schedule_ref
    sched = fn(
        packed["seg_start"], packed["seg_length"], packed["seg_parent"], packed["seg_continues"],
        packed["row_parent"], packed["row_depth"], np.zeros(packed["num_rows"], np.uint8), chunk, replay,
    )
    seq_init = sched[3]
    return {
        "calls": int(sched[4].max()) + 1 if len(sched[4]) else 0,
        "replay_tokens": int(len(sched[6])),
        "states": int(len(np.unique(seq_init[seq_init >= 0]))),
        "sequences": int(len(sched[0])),
        "packed": packed,
        "sched": sched,
    }
