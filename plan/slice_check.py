"""Linear-time check of one rank's plan slice: what a trainer verifies before running it.

    decoded = check_slice(slice_)     # DecodedSlice, or PlanValidationError naming the field
    decoded = check_decoded(decode_rank(header, rank))   # the same in two steps (the executor's "check")

The invariants the executor relies on to index safely and to run every row, state and window
exactly once, on the slice decoded once; the rules, and what only `plan.validator` checks:
docs/design/plan-contract.md ("Three levels of checking"). Fused Numba passes: `plan.slice_kernels`.
Legend: R local rows, I imported rows, S segments, N sequences of a call, M microbatches of the rank.
"""
from __future__ import annotations

import numpy as np

from proto.harts.v1 import plan_pb2
from plan.cross_edges import check_rank_edges, remote_imports
from plan.microbatch import MicrobatchArrays, PlanValidationError
from plan.decode import DecodedSlice, decode_rank
from plan.header import check_header
from plan.phases import check_rank_phases
from plan.slice_kernels import (
    CHILD_DEPTH, DEPTH_STEP, DUPLICATED, EXPORT_DEPTH, EXPORTED_TWICE, LOCAL_STATE_UNEXPORTED, NEGATIVE_DEPTH, OCCURRENCE,
    PARENT, REPLAY_TOO_LONG, REPLAY_WITHOUT_REPLAY, START_NOT_REPLAY_DEPTH, START_NOT_ROW_DEPTH, START_UNALIGNED, TILING,
    TREE, ZERO_STATE_DEPTH, call_rules, exporters, first_uncovered, first_unlisted, logprob_rules, mark, segment_rules)

__all__ = ["DecodedSlice", "check_decoded", "check_rank", "check_slice"]


def _fail(where: str, msg: str):
    raise PlanValidationError(f"{where}: {msg}")


def check_slice(slice_: plan_pb2.PlanSlice) -> DecodedSlice:
    """Check one rank's slice (docs/design/plan-contract.md) and return its decoded arrays.

    Raises:
        PlanValidationError: the first violated rule, naming the microbatch and field.
    """
    check_header(slice_.header)
    return check_rank(slice_.header, slice_.rank)


def check_rank(header: plan_pb2.PlanHeader, rank: plan_pb2.RankPlan) -> DecodedSlice:
    """`check_slice` of one RankPlan under an already checked header (a whole Plan's ranks).

    A rank plan without steps runs FORWARD m, BACKWARD m per microbatch in order.
    """
    return check_decoded(decode_rank(header, rank))


def check_decoded(d: DecodedSlice) -> DecodedSlice:
    """The slice check's rules on a decoded rank slice (`plan.decode.decode_rank`); returns it.

    Raises:
        PlanValidationError: the first violated rule, naming the microbatch and field.
    """
    header, params, arrays = d.header, d.header.params, d.microbatches
    index = {a.id: i for i, a in enumerate(arrays)}
    for a in arrays:
        _check_microbatch(a, params, len(header.tree_ids))
    where = f"rank {d.rank}"
    if params.lockstep:  # one step per phase, before the order rules index the real ones
        check_rank_phases(where, d.phases, [(k, i, s) for (k, i), s in zip(d.steps, d.standins)],
                          [a.recompute for a in arrays])
    elif any(d.standins):
        i = next(i for i, k in enumerate(d.standins) if k)
        _fail(f"{where}.steps[{i}]", f"expected standin 0 in a free plan (params.lockstep false), got {d.standins[i]}")
    _check_order(arrays, index, d.steps, where, skip_standins=bool(params.lockstep), remote=remote_imports(d.edges, d.rank))
    check_rank_edges(header, d.rank, d.edges, arrays, index, d.steps)
    return d


def _check_microbatch(a: MicrobatchArrays, params: plan_pb2.PlanParams, n_trees: int) -> None:
    w, R = a.where, a.num_rows
    if R + a.replay_tokens > params.microbatch_tokens:
        _fail(w, f"computed rows {R + a.replay_tokens} exceed microbatch_tokens {params.microbatch_tokens}")
    if a.num_imports and not params.windows:
        _fail(f"{w}.import_row", "expected no imports with windows off")
    found = segment_rules(a.depth, a.occurrence, a.seg_start, a.seg_length, a.seg_parent, a.seg_tree, a.seg_duplicated,
                          n_trees)
    if found[TILING] >= 0:
        _fail(f"{w}.seg_start", "expected segments to tile rows [0, num_rows) in order")
    if found[TREE] >= 0:
        _fail(f"{w}.seg_tree", f"expected indices into header.tree_ids (< {n_trees})")
    if found[PARENT] >= 0:
        s = int(found[PARENT])
        _fail(f"{w}.seg_parent[{s}]", f"expected -1 or a preceding segment, got {int(a.seg_parent[s])}")
    if found[NEGATIVE_DEPTH] >= 0:
        _fail(f"{w}.depth", "expected depths >= 0")
    if found[DEPTH_STEP] >= 0:
        _fail(f"{w}.depth", "expected consecutive depths inside every segment")
    if found[CHILD_DEPTH] >= 0:
        _fail(f"{w}.depth", f"expected segment {int(found[CHILD_DEPTH])} to start one below its parent's last row")
    n_dup = int(found[DUPLICATED])
    if n_dup != a.duplicated_tokens:
        _fail(f"{w}.duplicated_tokens", f"expected {n_dup}, got {a.duplicated_tokens}")
    if found[OCCURRENCE] >= 0:
        _fail(f"{w}.occurrence", "expected 0 on duplicated rows and >= 1 on kept rows")
    depth = a.depth
    _check_calls(a, params, depth)
    if a.num_logprobs:
        on_duplicated, i = logprob_rules(depth, a.lp_row, a.lp_pos, a.seg_start, a.seg_duplicated, n_dup > 0)
        if on_duplicated >= 0:
            _fail(f"{w}.lp_row", "expected kept rows, got a duplicated context row")
        if i >= 0:
            _fail(f"{w}.lp_row[{i}]", f"expected a row at depth {int(a.lp_pos[i]) - 1} (position - 1), got depth {int(depth[a.lp_row[i]])}")
        if params.logprob_positions == plan_pb2.LOGPROB_POSITIONS_LOSS and (a.lp_loss_mask != 1).any():
            _fail(f"{w}.lp_loss_mask", "expected only loss positions (mask 1) in a loss-positions plan")


def _check_calls(a: MicrobatchArrays, params: plan_pb2.PlanParams, depth: np.ndarray) -> None:
    """Sequences of every linear-attention call: coverage, replay, starts, state flow."""
    w, R, C = a.where, a.num_rows, params.chunk_size
    made = np.full(a.num_states, -1, np.int64)  # the call that exported each state
    for ci, call in enumerate(a.linear_calls):
        code, q, value = call_rules(ci, call.row_start, call.row_end, call.start_depth, call.init_kind, call.init_state,
                                    call.replay_offsets, call.replay_rows, call.export_seq, call.export_depth,
                                    call.export_state, depth, C, bool(params.replay), made)
        if code:
            _fail(*_CALL_RULES[code](f"{w}.linear_calls[{ci}]", q, value, C, int(depth[call.row_start[q]])))
    starts = [c.row_start for c in a.linear_calls]
    row = first_uncovered(np.concatenate(starts) if starts else np.zeros(0, np.int64),
                          np.concatenate([c.row_end for c in a.linear_calls]) if starts else np.zeros(0, np.int64), R)
    if row >= 0:
        _fail(f"{w}.linear_calls", f"expected every local row in exactly one sequence range, row {row} is not")
    replay_total = sum(int(c.replay_rows.shape[0]) for c in a.linear_calls)
    if replay_total != a.replay_tokens:
        _fail(f"{w}.replay_tokens", f"expected {replay_total}, got {a.replay_tokens}")
    if a.num_states and (made < 0).any():
        _fail(f"{w}.num_states", f"state {int(np.flatnonzero(made < 0)[0])} of num_states {a.num_states} is never exported")
    if a.export_states.size and (made[a.export_states] < 0).any():
        _fail(f"{w}.export_states", "expected states that some sequence exports")


#: call_rules code -> (field, message) of the violation.
_CALL_RULES = {
    REPLAY_TOO_LONG: lambda w, q, v, C, depth_of_first: (f"{w}.sequences[{q}].replay_rows", f"expected <= C-1 = {C - 1} rows, got {v}"),
    REPLAY_WITHOUT_REPLAY: lambda w, q, v, C, depth_of_first: (f"{w}.sequences[{q}].replay_rows", "expected none with replay off"),
    START_NOT_REPLAY_DEPTH: lambda w, q, v, C, depth_of_first: (f"{w}.sequences[{q}].start_depth", "expected the depth of its first replay row"),
    START_NOT_ROW_DEPTH: lambda w, q, v, C, depth_of_first: (f"{w}.sequences[{q}].start_depth", f"expected {depth_of_first} (depth of its first row), got {v}"),
    START_UNALIGNED: lambda w, q, v, C, depth_of_first: (f"{w}.sequences[{q}].start_depth", f"expected a multiple of C = {C} with replay on, got {v}"),
    ZERO_STATE_DEPTH: lambda w, q, v, C, depth_of_first: (f"{w}.sequences[{q}].init_state", f"zero state at depth {v}, expected depth 0"),
    LOCAL_STATE_UNEXPORTED: lambda w, q, v, C, depth_of_first: (w, f"reads local state {v} that no earlier call exported"),
    EXPORT_DEPTH: lambda w, q, v, C, depth_of_first: (f"{w}.sequences[{q}].exports", "expected state depths at chunk boundaries inside the sequence"),
    EXPORTED_TWICE: lambda w, q, v, C, depth_of_first: (f"{w}.exports", "state id exported twice"),
}


def _check_order(arrays: list[MicrobatchArrays], index: dict[int, int], steps: list[tuple[int, int]], where: str,
                 *, skip_standins: bool = False, remote: set[tuple[int, int]] = frozenset()) -> None:
    """Forward once then backward once, properly nested; imports only from open windows or, for the
    (exporter, importer) pairs in `remote`, from another rank (stand-ins, index -1, skipped in a
    lock-step plan)."""
    M = len(arrays)
    state = np.zeros(M, np.int8)  # 0 not run, 1 open, 2 done
    stack: list[int] = []
    listed: dict[tuple[int, str], np.ndarray] = {}  # (exporter, "rows" / "states") -> its export mask
    for i, (kind, k) in enumerate(steps):
        if skip_standins and k == -1:
            continue
        if not 0 <= k < M:
            _fail(f"{where}.steps[{i}]", f"expected an index < {M}, got {k}")
        a = arrays[k]
        if kind == plan_pb2.ExecStep.FORWARD:
            if state[k]:
                _fail(f"{where}.steps[{i}]", f"microbatch {a.id} forwarded twice")
            _check_imports(a, arrays, index, state, listed, remote)
            state[k] = 1
            stack.append(k)
        else:
            if state[k] != 1:
                _fail(f"{where}.steps[{i}]", f"backward of microbatch {a.id} without one prior forward")
            if stack[-1] != k:
                _fail(f"{where}.steps[{i}]", f"backward of {a.id} is not depth-first (open: {[arrays[j].id for j in stack]})")
            stack.pop()
            state[k] = 2
    if (state != 2).any():
        _fail(f"{where}.steps", f"microbatch {arrays[int(np.flatnonzero(state != 2)[0])].id} is not forwarded and backwarded exactly once")


def _check_imports(a: MicrobatchArrays, arrays: list[MicrobatchArrays], index: dict[int, int], state: np.ndarray,
                   listed: dict[tuple[int, str], np.ndarray], remote: set[tuple[int, int]]) -> None:
    w = a.where
    for e in exporters(a.import_microbatch, a.state_import_microbatch).tolist():
        k = index.get(e, -1)
        if k < 0 and (e, a.id) in remote:  # a window across ranks: its edge's rules (plan.cross_edges)
            continue
        if k < 0 or state[k] != 1:
            _fail(w, f"imports from microbatch {e}, which is not an open window on this rank")
        ex = arrays[k]
        rows = listed.get((k, "rows"))
        if rows is None:
            rows = listed[k, "rows"] = mark(ex.export_rows, ex.num_rows + ex.num_imports)
        i = first_unlisted(a.import_microbatch, a.import_row, e, rows)
        if i >= 0:
            _fail(f"{w}.import_row[{i}]", f"row {int(a.import_row[i])} is not listed in microbatch {e}'s export_rows")
        states = listed.get((k, "states"))
        if states is None:
            states = listed[k, "states"] = mark(ex.export_states, ex.num_states)
        q = first_unlisted(a.state_import_microbatch, a.state_import_state, e, states)
        if q >= 0:
            _fail(f"{w}.state_imports[{q}]", f"state {int(a.state_import_state[q])} is not in microbatch {e}'s export_states")
