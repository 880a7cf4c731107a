"""Linear-time check of one rank's plan slice: what a trainer verifies before running it.

    decoded = check_slice(slice_)     # DecodedSlice, or PlanValidationError naming the field

`proto.plan_validator.validate_plan` is the independent, complete checker (token chains through
prefix hashes, exact conv and attention ancestries, kept-token coverage, stats, live-memory stack)
and stays the test oracle; it costs up to 10x the planning time on full-scale steps. A trainer
rank only needs the invariants its executor relies on to index safely and to run every row, state
and window exactly once, and it needs the decoded arrays anyway. So this check decodes every
microbatch once (`proto.plan_decode.decode_microbatch`: lengths, index bounds, vocabulary) and
adds, each in time linear in the slice:

- header: version, chunk size, parameters, trajectory table and normalisers;
- per microbatch: computed rows within `microbatch_tokens`; `duplicated_tokens` and
  `replay_tokens` equal to what the tables say; segments tile the rows in order, parents precede
  children, depths are consecutive within a segment and continue from the parent's last row;
  occurrence 0 exactly on duplicated rows; no imports without windows;
- linear-attention calls: every local row in exactly one sequence range; replay within C-1 rows
  (none with replay off); aligned starts with replay on, depth 0 for a zero state, the first row's
  depth as `start_depth`; exported states unique, within the table, at chunk boundaries of their
  sequence and read (LOCAL) only by strictly later calls; every state exported;
- windows: every import names a microbatch of this rank that is open (forwarded, not yet
  backwarded) when the importer runs, an extended row or state that exporter lists in
  `export_rows` / `export_states`;
- execution order: each microbatch forwarded once then backwarded once, properly nested;
- log-prob map: rows kept (not duplicated context) at depth `position - 1`, loss positions only
  in a loss-positions plan.

What it does not check (validate_plan does): that token chains, conv ancestors and attention
ranges reproduce the trajectories, that states come from the right path, the live-memory stack.

Legend: R local rows, I imported rows, S segments, N sequences of a call, M microbatches of the rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto.harts.v1 import plan_pb2
from proto.plan_decode import LOCAL, ZERO, MicrobatchArrays, PlanValidationError, decode_microbatch
from proto.plan_validator import check_header

__all__ = ["DecodedSlice", "check_rank", "check_slice"]


def _fail(where: str, msg: str):
    raise PlanValidationError(f"{where}: {msg}")


@dataclass(slots=True, kw_only=True)
class DecodedSlice:
    """A checked rank slice: the header and every microbatch decoded once, in RankPlan order."""

    header: plan_pb2.PlanHeader
    rank: int
    microbatches: list[MicrobatchArrays]
    """In `RankPlan.microbatches` order (what ExecStep.microbatch indexes)."""
    steps: list[tuple[int, int]]
    """(kind, index into `microbatches`) per execution step: ExecStep.FORWARD / BACKWARD."""

    def by_id(self) -> dict[int, MicrobatchArrays]:
        return {a.id: a for a in self.microbatches}


def check_slice(slice_: plan_pb2.PlanSlice) -> DecodedSlice:
    """Check one rank's slice (see the module docstring) and return its decoded arrays.

    Raises:
        PlanValidationError: the first violated rule, naming the microbatch and field.
    """
    check_header(slice_.header)
    return check_rank(slice_.header, slice_.rank)


def check_rank(header: plan_pb2.PlanHeader, rank: plan_pb2.RankPlan) -> DecodedSlice:
    """`check_slice` of one RankPlan under an already checked header (a whole Plan's ranks).

    A rank plan without steps runs FORWARD m, BACKWARD m per microbatch in order.
    """
    params = header.params
    arrays: list[MicrobatchArrays] = []
    index: dict[int, int] = {}
    for mb in rank.microbatches:
        if mb.id in index:
            _fail(f"rank {rank.rank}.microbatches", f"microbatch id {mb.id} appears twice")
        a = decode_microbatch(mb, params)
        _check_microbatch(a, params, len(header.tree_ids))
        index[mb.id] = len(arrays)
        arrays.append(a)
    steps = [(int(s.kind), int(s.microbatch)) for s in rank.steps] or [
        (k, i) for i in range(len(arrays)) for k in (plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD)]
    _check_order(arrays, index, steps, f"rank {rank.rank}")
    return DecodedSlice(header=header, rank=int(rank.rank), microbatches=arrays, steps=steps)


def _check_microbatch(a: MicrobatchArrays, params: plan_pb2.PlanParams, n_trees: int) -> None:
    w, R, S = a.where, a.num_rows, a.num_segments
    if R + a.replay_tokens > params.microbatch_tokens:
        _fail(w, f"computed rows {R + a.replay_tokens} exceed microbatch_tokens {params.microbatch_tokens}")
    if a.num_imports and not params.windows:
        _fail(f"{w}.import_row", "expected no imports with windows off")
    start = a.seg_start.astype(np.int64)
    length = a.seg_length.astype(np.int64)
    parent = a.seg_parent.astype(np.int64)
    if S and (int(length.min()) < 1 or start[0] != 0 or (start[1:] != start[:-1] + length[:-1]).any()) \
            or int(length.sum()) != R:
        _fail(f"{w}.seg_start", "expected segments to tile rows [0, num_rows) in order")
    if S and (int(a.seg_tree.min()) < 0 or int(a.seg_tree.max()) >= n_trees):
        _fail(f"{w}.seg_tree", f"expected indices into header.tree_ids (< {n_trees})")
    bad = np.flatnonzero((parent < -1) | (parent >= np.arange(S)))
    if bad.size:
        _fail(f"{w}.seg_parent[{int(bad[0])}]", f"expected -1 or a preceding segment, got {int(parent[bad[0]])}")
    depth = a.depth  # int32 [R]; row passes stay in int32 and few: this check must cost little
    if R and int(depth.min()) < 0:
        _fail(f"{w}.depth", "expected depths >= 0")
    if R > 1:
        step = np.diff(depth) == 1
        step[start[1:] - 1] = True  # a segment's first row may start anywhere
        if not step.all():
            _fail(f"{w}.depth", "expected consecutive depths inside every segment")
    kid = np.flatnonzero(parent >= 0)
    last_of_parent = start[parent[kid]] + length[parent[kid]] - 1
    bad = kid[depth[start[kid]] != depth[last_of_parent] + 1]
    if bad.size:
        _fail(f"{w}.depth", f"expected segment {int(bad[0])} to start one below its parent's last row")
    seg_dup = a.seg_duplicated.astype(np.bool_)
    n_dup = int(length[seg_dup].sum())
    if n_dup != a.duplicated_tokens:
        _fail(f"{w}.duplicated_tokens", f"expected {n_dup}, got {a.duplicated_tokens}")
    if S:
        occ_min = np.minimum.reduceat(a.occurrence, start)
        occ_max = np.maximum.reduceat(a.occurrence, start)
        if (occ_max[seg_dup] != 0).any() or (occ_min[~seg_dup] < 1).any():
            _fail(f"{w}.occurrence", "expected 0 on duplicated rows and >= 1 on kept rows")
    _check_calls(a, params, depth)
    if a.num_logprobs:
        r = a.lp_row
        if n_dup and seg_dup[np.searchsorted(start, r, side="right") - 1].any():
            _fail(f"{w}.lp_row", "expected kept rows, got a duplicated context row")
        bad = np.flatnonzero(depth[r] != a.lp_pos - 1)
        if bad.size:
            i = int(bad[0])
            _fail(f"{w}.lp_row[{i}]", f"expected a row at depth {int(a.lp_pos[i]) - 1} (position - 1), got depth {int(depth[r[i]])}")
        if params.logprob_positions == plan_pb2.LOGPROB_POSITIONS_LOSS and (a.lp_loss_mask != 1).any():
            _fail(f"{w}.lp_loss_mask", "expected only loss positions (mask 1) in a loss-positions plan")


def _check_calls(a: MicrobatchArrays, params: plan_pb2.PlanParams, depth: np.ndarray) -> None:
    """Sequences of every linear-attention call: coverage, replay, starts, state flow."""
    w, R, C = a.where, a.num_rows, params.chunk_size
    starts, ends = [], []
    export_call = np.full(a.num_states, -1, np.int64)
    replay_total = 0
    for ci, call in enumerate(a.linear_calls):
        where = f"{w}.linear_calls[{ci}]"
        n_rep = np.diff(call.replay_offsets)
        replay_total += int(n_rep.sum())
        if call.num_sequences == 0:
            continue
        if params.replay and int(n_rep.max()) > C - 1:
            q = int(np.argmax(n_rep))
            _fail(f"{where}.sequences[{q}].replay_rows", f"expected <= C-1 = {C - 1} rows, got {int(n_rep[q])}")
        if not params.replay and n_rep.any():
            _fail(f"{where}.sequences[{int(np.flatnonzero(n_rep)[0])}].replay_rows", "expected none with replay off")
        starts.append(call.row_start)
        ends.append(call.row_end)
        first = np.where(n_rep > 0, -1, call.row_start)
        has_rep = np.flatnonzero(n_rep > 0)
        sd = call.start_depth
        if has_rep.size:  # the first replay row's depth (extended rows: local depth, or an import's)
            rows = call.replay_rows[call.replay_offsets[has_rep]]
            local = rows < R
            bad = has_rep[local][depth[rows[local]] != sd[has_rep[local]]]
            if bad.size:
                _fail(f"{where}.sequences[{int(bad[0])}].start_depth", "expected the depth of its first replay row")
        bad = np.flatnonzero((first >= 0) & (depth[np.maximum(first, 0)] != sd))
        if bad.size:
            q = int(bad[0])
            _fail(f"{where}.sequences[{q}].start_depth", f"expected {int(depth[first[q]])} (depth of its first row), got {int(sd[q])}")
        if params.replay and (sd % C).any():
            q = int(np.flatnonzero(sd % C)[0])
            _fail(f"{where}.sequences[{q}].start_depth", f"expected a multiple of C = {C} with replay on, got {int(sd[q])}")
        bad = np.flatnonzero((call.init_kind == ZERO) & (sd != 0))
        if bad.size:
            _fail(f"{where}.sequences[{int(bad[0])}].init_state", f"zero state at depth {int(sd[bad[0]])}, expected depth 0")
        local = np.flatnonzero(call.init_kind == LOCAL)
        if local.size:  # readable only once an earlier call exported it
            made = export_call[call.init_state[local]]
            bad = local[(made < 0) | (made >= ci)]
            if bad.size:
                _fail(f"{where}", f"reads local state {int(call.init_state[bad[0]])} that no earlier call exported")
        if call.export_seq.size:
            es = call.export_seq
            end_depth = depth[call.row_end[es] - 1] + 1
            ed = call.export_depth
            ok = (ed > sd[es]) & (ed <= end_depth) & (((ed - sd[es]) % C == 0) | (~np.bool_(params.replay) & (ed == end_depth)))
            if not ok.all():
                q = int(es[np.flatnonzero(~ok)[0]])
                _fail(f"{where}.sequences[{q}].exports", "expected state depths at chunk boundaries inside the sequence")
            st = call.export_state
            if (export_call[st] >= 0).any():
                _fail(f"{where}.exports", "state id exported twice")
            export_call[st] = ci
            if st.shape[0] > 1 and int(np.bincount(st).max()) > 1:
                _fail(f"{where}.exports", "state id exported twice")
    # the sequence ranges partition [0, R): sorted by start, each begins where the previous ends
    lo = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    hi = np.concatenate(ends) if ends else np.zeros(0, np.int64)
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if R and (lo.shape[0] == 0 or lo[0] != 0 or hi[-1] != R or (lo[1:] != hi[:-1]).any()):
        gap = 0 if lo.shape[0] == 0 or lo[0] != 0 else int(hi[np.flatnonzero(np.append(lo[1:] != hi[:-1], True))[0]])
        _fail(f"{w}.linear_calls", f"expected every local row in exactly one sequence range, row {min(gap, R - 1)} is not")
    if replay_total != a.replay_tokens:
        _fail(f"{w}.replay_tokens", f"expected {replay_total}, got {a.replay_tokens}")
    if a.num_states and (export_call < 0).any():
        _fail(f"{w}.num_states", f"state {int(np.flatnonzero(export_call < 0)[0])} of num_states {a.num_states} is never exported")
    if a.export_states.size and (export_call[a.export_states] < 0).any():
        _fail(f"{w}.export_states", "expected states that some sequence exports")


def _check_order(arrays: list[MicrobatchArrays], index: dict[int, int], steps: list[tuple[int, int]], where: str) -> None:
    """Forward once then backward once, properly nested; imports only from open windows."""
    M = len(arrays)
    state = np.zeros(M, np.int8)  # 0 not run, 1 open, 2 done
    stack: list[int] = []
    exported_rows: dict[int, np.ndarray] = {}
    for i, (kind, k) in enumerate(steps):
        if not 0 <= k < M:
            _fail(f"{where}.steps[{i}]", f"expected an index < {M}, got {k}")
        a = arrays[k]
        if kind == plan_pb2.ExecStep.FORWARD:
            if state[k]:
                _fail(f"{where}.steps[{i}]", f"microbatch {a.id} forwarded twice")
            _check_imports(a, arrays, index, state, exported_rows)
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
                   exported_rows: dict[int, np.ndarray]) -> None:
    w = a.where
    ids = np.concatenate([a.import_microbatch, a.state_import_microbatch]).astype(np.int64)
    if not ids.shape[0]:
        return
    if int(ids.min()) < 0:
        _fail(w, f"imports from microbatch {int(ids.min())}, which is not an open window on this rank")
    for e in np.flatnonzero(np.bincount(ids)).tolist():
        k = index.get(e, -1)
        if k < 0 or state[k] != 1:
            _fail(w, f"imports from microbatch {e}, which is not an open window on this rank")
        ex = arrays[k]
        sel = a.import_microbatch == e
        if sel.any():
            listed = exported_rows.get(k)
            if listed is None:
                listed = exported_rows[k] = np.zeros(ex.num_rows + ex.num_imports, np.bool_)
                listed[ex.export_rows] = True
            rows = a.import_row[sel].astype(np.int64)
            bad = (rows >= listed.shape[0])
            bad[~bad] = ~listed[rows[~bad]]
            if bad.any():
                i = int(np.flatnonzero(sel)[np.flatnonzero(bad)[0]])
                _fail(f"{w}.import_row[{i}]", f"row {int(a.import_row[i])} is not listed in microbatch {e}'s export_rows")
        sel = a.state_import_microbatch == e
        if sel.any():
            ok = np.isin(a.state_import_state[sel], ex.export_states)
            if not ok.all():
                q = int(np.flatnonzero(sel)[np.flatnonzero(~ok)[0]])
                _fail(f"{w}.state_imports[{q}]", f"state {int(a.state_import_state[q])} is not in microbatch {e}'s export_states")
