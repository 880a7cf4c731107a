"""The oracle validator's row rules: conv and attention ancestry, and the linear-attention schedule.

    check_ancestry(mb, st.pred[m], params.conv_kernel)
    check_linear(mb, st, params, states_of)     # states_of: microbatch -> {state: (depth, identity)}

Both run on rows resolved by `oracle_rows.StepRows` (exporters first; docs/design/min-calls.md).
Legend: R local rows,
I imported rows, S segments, K conv kernel, C chunk size.
"""
from __future__ import annotations

import numpy as np

from proto.harts.v1 import plan_pb2
from plan.microbatch import PlanValidationError
from plan.oracle_rows import CheckedMicrobatch, StepRows


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")


def check_ancestry(mb: CheckedMicrobatch, pred: np.ndarray, K: int) -> None:
    """Conv ancestors and attention ranges of every row and segment, as the resolved predecessors give them."""
    R = mb.R
    cur = pred[:R].copy()
    for j in range(K - 2, -1, -1):
        if not np.array_equal(mb.conv[:, j], cur):
            r = int(np.flatnonzero(mb.conv[:, j] != cur)[0])
            _fail(f"{mb.where}.conv_ancestors[{r}, {j}]", f"expected {int(cur[r])}, got {int(mb.conv[r, j])}")
        cur = np.where(cur >= 0, pred[np.maximum(cur, 0)], -1)
    def canonical(ranges) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for a, b in ranges:
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    got = [canonical(mb.attn_ranges[mb.attn_offsets[s] : mb.attn_offsets[s + 1]].tolist()) for s in range(mb.S)]
    chains: dict[int, list[tuple[int, int]]] = {}
    for s in range(mb.S):
        p = int(mb.seg_parent[s])
        if p >= 0:
            a = int(mb.seg_start[p])
            want = canonical(got[p] + [(a, a + int(mb.seg_length[p]))])
        else:
            x = int(pred[mb.seg_start[s]])
            if x not in chains:
                rows = []
                y = x
                while y >= 0:
                    rows.append(y)
                    y = int(pred[y])
                chains[x] = canonical((r, r + 1) for r in reversed(rows))
            want = chains[x]
        if got[s] != want:
            _fail(f"{mb.where}.attn_ranges", f"segment {s}: expected its ancestor rows {want[:4]}..., got {got[s][:4]}...")


def check_linear(mb: CheckedMicrobatch, st: StepRows, params: plan_pb2.PlanParams, states_of: dict[int, dict[int, tuple[int, int]]]) -> None:
    """Sequences: contiguous owned ranges, replay chains, aligned starts, states available in time."""
    w, R, C = mb.where, mb.R, params.chunk_size
    pred, depth, ident = st.pred[mb.id], st.edepth[mb.id], st.ident[mb.id]
    owned = np.zeros(R, np.int64)
    exported: dict[int, tuple[int, int, int]] = {}  # state -> (call, depth, extended row before it)
    replay_total = 0
    for ci, call in enumerate(mb.msg.linear_calls):
        decoded = mb.arrays.linear_calls[ci]
        for qi, seq in enumerate(call.sequences):
            where = f"{w}.linear_calls[{ci}].sequences[{qi}]"
            reps = decoded.replay_rows[decoded.replay_offsets[qi] : decoded.replay_offsets[qi + 1]]
            if not 0 <= seq.row_start < seq.row_end <= R:
                _fail(where, f"expected 0 <= row_start < row_end <= {R}, got [{seq.row_start}, {seq.row_end})")
            if params.replay and len(reps) > C - 1:
                _fail(f"{where}.replay_rows", f"expected <= C-1 = {C - 1} rows, got {len(reps)}")
            if not params.replay and len(reps):
                _fail(f"{where}.replay_rows", f"expected none with replay off, got {len(reps)}")
            if ((reps < 0) | (reps >= R + mb.I)).any():
                _fail(f"{where}.replay_rows", f"expected extended rows in [0, {R + mb.I})")
            replay_total += len(reps)
            chain = np.concatenate([reps.astype(np.int64), np.arange(seq.row_start, seq.row_end)])
            if (pred[chain[1:]] != chain[:-1]).any():
                _fail(where, "expected replay rows then the range to be consecutive rows of one path")
            if depth[chain[0]] != seq.start_depth:
                _fail(f"{where}.start_depth", f"expected {int(depth[chain[0]])} (depth of its first row), got {seq.start_depth}")
            if params.replay and seq.start_depth % C:
                _fail(f"{where}.start_depth", f"expected a multiple of C = {C} with replay on, got {seq.start_depth}")
            owned[seq.row_start : seq.row_end] += 1
            before = int(pred[chain[0]])
            src = seq.init_state
            if src.kind == plan_pb2.StateSource.ZERO:
                if seq.start_depth != 0:
                    _fail(f"{where}.init_state", f"zero state at depth {seq.start_depth}, expected depth 0")
            elif src.kind == plan_pb2.StateSource.LOCAL:
                got = exported.get(src.state)
                if got is None:
                    _fail(f"{where}.init_state", f"local state {src.state} is not exported by an earlier call")
                if got[1] != seq.start_depth or got[2] != before:
                    _fail(f"{where}.init_state", f"state {src.state} is the state at depth {got[1]} of another path, expected depth {seq.start_depth} on this one")
            else:
                if not 0 <= src.state < len(mb.msg.state_imports):
                    _fail(f"{where}.init_state", f"expected an index into state_imports (< {len(mb.msg.state_imports)}), got {src.state}")
                imp = mb.msg.state_imports[src.state]
                table = states_of.get(imp.microbatch)
                if table is None or imp.state not in table:
                    _fail(f"{w}.state_imports[{src.state}]", f"microbatch {imp.microbatch} does not export state {imp.state} "
                          f"earlier (on this rank, or across a cross edge)")
                if imp.state not in set(st.mbs[imp.microbatch].export_states.tolist()):
                    _fail(f"{w}.state_imports[{src.state}]", f"state {imp.state} is not in microbatch {imp.microbatch}'s export_states")
                e_depth, e_ident = table[imp.state]
                if e_depth != seq.start_depth or before < 0 or ident[before] != e_ident:
                    _fail(f"{where}.init_state", f"imported state is at depth {e_depth} of another path, expected depth {seq.start_depth} on this one")
            end_depth = int(depth[seq.row_end - 1]) + 1
            for ex in seq.exports:
                if not seq.start_depth < ex.depth <= end_depth:
                    _fail(f"{where}.exports", f"expected a depth in ({seq.start_depth}, {end_depth}], got {ex.depth}")
                aligned = (ex.depth - seq.start_depth) % C == 0
                if not (aligned or (not params.replay and ex.depth == end_depth)):
                    _fail(f"{where}.exports", f"state at depth {ex.depth} is not at a chunk boundary of the sequence")
                if ex.state in exported or not 0 <= ex.state < mb.msg.num_states:
                    _fail(f"{where}.exports", f"state id {ex.state} repeated or outside [0, {mb.msg.num_states})")
                k = ex.depth - seq.start_depth - 1
                exported[ex.state] = (ci, ex.depth, int(chain[k]))
        # a state is readable only by later calls: register after the whole call
    if (owned != 1).any():
        r = int(np.flatnonzero(owned != 1)[0])
        _fail(f"{w}.linear_calls", f"expected every local row in exactly one sequence range, row {r} is in {int(owned[r])}")
    if len(exported) != mb.msg.num_states:
        _fail(f"{w}.num_states", f"expected {len(exported)} (exported states), got {mb.msg.num_states}")
    if replay_total != mb.msg.replay_tokens:
        _fail(f"{w}.replay_tokens", f"expected {replay_total}, got {mb.msg.replay_tokens}")
    states_of[mb.id] = {s: (d, int(ident[r])) for s, (_, d, r) in exported.items()}
    for s in mb.export_states.tolist():
        if s not in exported:
            _fail(f"{w}.export_states", f"state {s} is not exported by any sequence")
    for ci, call in enumerate(mb.msg.linear_calls):  # local states must come from strictly earlier calls
        for seq in call.sequences:
            if seq.init_state.kind == plan_pb2.StateSource.LOCAL and exported[seq.init_state.state][0] >= ci:
                _fail(f"{w}.linear_calls[{ci}]", f"reads local state {seq.init_state.state} produced in call {exported[seq.init_state.state][0]}")
