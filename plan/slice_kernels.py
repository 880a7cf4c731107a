"""Numba kernels of the slice check: one pass over each table where numpy needed several.

A trainer rank checks its slice before running it (`plan.slice_check`); at step scale a slice
holds ~20 MB of row tables, and the checks are memory-bound: each numpy expression is a pass over
cold memory plus a temporary. These kernels fuse the passes and return the first violating index
of each rule (-1: none); the callers keep the rules' order and error messages
(docs/design/plan-contract.md, "Three levels of checking").

Legend: R local rows, S segments, P log-prob entries, I imported rows.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from proto.harts.v1 import plan_pb2

#: StateSource kinds (plain ints: Numba freezes module globals into the kernels).
ZERO, LOCAL, IMPORTED = int(plan_pb2.StateSource.ZERO), int(plan_pb2.StateSource.LOCAL), int(plan_pb2.StateSource.IMPORTED)

#: `segment_rules` result slots, in the order the slice check reports them.
TILING, TREE, PARENT, NEGATIVE_DEPTH, DEPTH_STEP, CHILD_DEPTH, OCCURRENCE, DUPLICATED = range(8)


#: `call_bounds` codes (0: none).
BAD_ROW_RANGE, BAD_REPLAY_ROW, BAD_STATE_KIND, BAD_STATE_ID, BAD_EXPORT_STATE = range(1, 6)
#: `call_rules` codes (0: none).
(REPLAY_TOO_LONG, REPLAY_WITHOUT_REPLAY, START_NOT_REPLAY_DEPTH, START_NOT_ROW_DEPTH, START_UNALIGNED, ZERO_STATE_DEPTH,
 LOCAL_STATE_UNEXPORTED, EXPORT_DEPTH, EXPORTED_TWICE) = range(1, 10)


@njit(cache=True, nogil=True)
def outside(a, lo, hi):
    """Whether some element of the 1-D array `a` lies outside [lo, hi) (a vectorisable min/max pass)."""
    if a.shape[0] == 0:
        return False
    mn = mx = a[0]
    for i in range(a.shape[0]):
        mn = min(mn, a[i])
        mx = max(mx, a[i])
    return mn < lo or mx >= hi


@njit(cache=True, nogil=True)
def segment_rules(depth, occurrence, seg_start, seg_length, seg_parent, seg_tree, seg_duplicated, n_trees):
    """The row and segment rules of one microbatch in one pass over its rows.

    Returns int64 [8]: per rule slot (TILING ... OCCURRENCE) the first violating row or segment
    (TILING: 0), -1 where the rule holds; DUPLICATED holds the duplicated row count. After a tiling
    violation nothing else is checked (rows could lie outside their table).
    """
    out = np.full(8, -1, np.int64)
    R, S = depth.shape[0], seg_start.shape[0]
    end = 0
    for s in range(S):
        if seg_length[s] < 1 or seg_start[s] != end:
            out[TILING] = 0
            return out
        end += seg_length[s]
    if end != R:
        out[TILING] = 0
        return out
    n_dup = 0
    for s in range(S):
        if out[TREE] < 0 and (seg_tree[s] < 0 or seg_tree[s] >= n_trees):
            out[TREE] = s
        p = seg_parent[s]
        if p < -1 or p >= s:
            if out[PARENT] < 0:
                out[PARENT] = s
        elif p >= 0 and out[CHILD_DEPTH] < 0 and depth[seg_start[s]] != depth[seg_start[p] + seg_length[p] - 1] + 1:
            out[CHILD_DEPTH] = s
        lo, hi = seg_start[s], seg_start[s] + seg_length[s]
        dup = seg_duplicated[s] != 0
        if dup:
            n_dup += hi - lo
        for r in range(lo, hi):
            d = depth[r]
            if d < 0 and out[NEGATIVE_DEPTH] < 0:
                out[NEGATIVE_DEPTH] = r
            if r > lo and d != depth[r - 1] + 1 and out[DEPTH_STEP] < 0:
                out[DEPTH_STEP] = r
            if (occurrence[r] != 0 if dup else occurrence[r] < 1) and out[OCCURRENCE] < 0:
                out[OCCURRENCE] = r
    out[DUPLICATED] = n_dup
    return out


@njit(cache=True, nogil=True)
def logprob_rules(depth, lp_row, lp_pos, seg_start, seg_duplicated, any_duplicated):
    """(first entry on a duplicated row, first entry whose row is not at depth position - 1), -1: none.

    `lp_row` lies in [0, R) (decoded); segments tile the rows (checked before).
    """
    on_dup, bad_depth = -1, -1
    S = seg_start.shape[0]
    for i in range(lp_row.shape[0]):
        r = lp_row[i]
        if bad_depth < 0 and depth[r] != lp_pos[i] - 1:
            bad_depth = i
        if any_duplicated and on_dup < 0:
            lo, hi = 0, S  # the segment holding r: the last start <= r
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if seg_start[mid] <= r:
                    lo = mid
                else:
                    hi = mid
            if seg_duplicated[lo] != 0:
                on_dup = i
        if bad_depth >= 0 and (on_dup >= 0 or not any_duplicated):
            break
    return on_dup, bad_depth


@njit(cache=True, nogil=True)
def mark(rows, n):
    """bool [n]: True at every entry of `rows` (each in [0, n))."""
    out = np.zeros(n, np.bool_)
    for i in range(rows.shape[0]):
        out[rows[i]] = True
    return out


@njit(cache=True, nogil=True)
def first_unlisted(import_microbatch, import_row, exporter, listed):
    """First import from `exporter` whose row is not True in `listed`, or -1."""
    n = listed.shape[0]
    for i in range(import_row.shape[0]):
        if import_microbatch[i] == exporter:
            r = import_row[i]
            if r < 0 or r >= n or not listed[r]:
                return i
    return -1


@njit(cache=True, nogil=True)
def _mark_ids(t, seen):
    for i in range(t.shape[0]):
        seen[t[i]] = True


@njit(cache=True, nogil=True)
def exporters(import_microbatch, state_import_microbatch):
    """The distinct microbatch ids both import tables name, ascending; [min] if one is negative."""
    lo, hi = 0, -1
    if import_microbatch.shape[0]:
        lo, hi = min(lo, import_microbatch.min()), max(hi, import_microbatch.max())
    if state_import_microbatch.shape[0]:
        lo, hi = min(lo, state_import_microbatch.min()), max(hi, state_import_microbatch.max())
    if lo < 0:
        return np.full(1, lo, np.int64)
    seen = np.zeros(hi + 1, np.bool_)
    _mark_ids(import_microbatch, seen)
    _mark_ids(state_import_microbatch, seen)
    return np.flatnonzero(seen)


@njit(cache=True, nogil=True)
def call_bounds(row_start, row_end, kind, state, replay_offsets, replay_rows, export_seq, export_state, R, extended,
                num_states, Q):
    """Index bounds of a microbatch's linear-call sequences (all calls, flat): (code, sequence, value).

    Per sequence in order: kept rows inside [0, R), replay rows inside [0, extended), a known
    state kind, a state id inside its table; then exports into [0, num_states).
    """
    for n in range(row_start.shape[0]):
        if row_start[n] < 0 or row_end[n] <= row_start[n] or row_end[n] > R:
            return BAD_ROW_RANGE, n, 0
        for j in range(replay_offsets[n], replay_offsets[n + 1]):
            if replay_rows[j] < 0 or replay_rows[j] >= extended:
                return BAD_REPLAY_ROW, n, replay_rows[j]
        k = kind[n]
        if k != ZERO and k != LOCAL and k != IMPORTED:
            return BAD_STATE_KIND, n, k
        if (k == LOCAL and not 0 <= state[n] < num_states) or (k == IMPORTED and not 0 <= state[n] < Q):
            return BAD_STATE_ID, n, state[n]
    for e in range(export_state.shape[0]):
        if export_state[e] < 0 or export_state[e] >= num_states:
            return BAD_EXPORT_STATE, export_seq[e], export_state[e]
    return 0, 0, 0


@njit(cache=True, nogil=True)
def call_rules(c, row_start, row_end, start_depth, kind, state, replay_offsets, replay_rows, export_seq, export_depth,
               export_state, depth, C, replay, made):
    """The replay and state-flow rules of linear call `c` (`call_bounds`-checked): (code, sequence, value).

    `made` [num_states] holds the call that exported each state (-1: none yet); a LOCAL state must
    come from a strictly earlier call, and each id is exported once. Records this call's exports.
    """
    R = depth.shape[0]
    for n in range(row_start.shape[0]):
        n_rep = replay_offsets[n + 1] - replay_offsets[n]
        if replay and n_rep > C - 1:
            return REPLAY_TOO_LONG, n, n_rep
        if not replay and n_rep:
            return REPLAY_WITHOUT_REPLAY, n, n_rep
        sd = start_depth[n]
        if n_rep:
            first = replay_rows[replay_offsets[n]]
            if first < R and depth[first] != sd:
                return START_NOT_REPLAY_DEPTH, n, sd
        elif depth[row_start[n]] != sd:
            return START_NOT_ROW_DEPTH, n, sd
        if replay and sd % C:
            return START_UNALIGNED, n, sd
        if kind[n] == ZERO and sd != 0:
            return ZERO_STATE_DEPTH, n, sd
        if kind[n] == LOCAL and (made[state[n]] < 0 or made[state[n]] >= c):
            return LOCAL_STATE_UNEXPORTED, n, state[n]
    for e in range(export_seq.shape[0]):
        n = export_seq[e]
        sd, ed = start_depth[n], export_depth[e]
        end_depth = depth[row_end[n] - 1] + 1
        if not (sd < ed <= end_depth and ((ed - sd) % C == 0 or (not replay and ed == end_depth))):
            return EXPORT_DEPTH, n, ed
    for e in range(export_state.shape[0]):
        if made[export_state[e]] >= 0:
            return EXPORTED_TWICE, 0, export_state[e]
        made[export_state[e]] = c
    return 0, 0, 0


@njit(cache=True, nogil=True)
def first_uncovered(lo, hi, R):
    """First row of [0, R) not covered exactly once by the ranges [lo, hi), or -1."""
    order = np.argsort(lo, kind="mergesort")
    end = 0
    for n in order:
        if lo[n] != end:
            return min(end, R - 1)
        end = hi[n]
    return -1 if end == R else min(end, R - 1)


def warmup() -> None:
    """Compile (or load from numba's cache) every kernel for the array types the slice check passes:
    read-only int32/uint8 wire tables (`proto.arrays.unpack` views) and int64 call columns."""
    def wire(value, dtype):
        a = np.full(1, value, dtype)
        a.setflags(write=False)
        return a

    i32, one, u8, i64 = wire(0, np.int32), wire(1, np.int32), wire(0, np.uint8), np.zeros(1, np.int64)
    outside(i32, 0, 1)
    outside(wire(0, np.int64), 0, 1)
    outside(i64, 0, 1)
    segment_rules(i32, one, i32, one, wire(-1, np.int32), i32, u8, 1)
    logprob_rules(i32, i32, one, i32, u8, True)
    first_unlisted(i32, i32, 0, mark(i32, 1))
    exporters(i32, np.zeros(1, np.int32))
    first_unlisted(np.zeros(1, np.int32), np.zeros(1, np.int32), 0, mark(i32, 1))
    ends, offsets = i64 + 1, np.zeros(2, np.int64)
    call_bounds(i64, ends, i64, i64, offsets, i64[:0], i64[:0], i64[:0], 1, 1, 0, 0)
    call_rules(0, i64, ends, i64, i64, i64, offsets, i64[:0], i64[:0], i64[:0], i64[:0], i32, 1, True, i64[:0])
    first_uncovered(i64, ends, 1)
