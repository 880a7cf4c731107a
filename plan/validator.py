"""Independent checker of HARTS plans (the wire contract of proto/harts/v1/plan.proto): the test oracle.

    validate_plan(plan, forest_like=None)   # the whole step (all ranks)
    validate_slice(slice_)                  # one rank's slice: what a trainer can check alone

Both raise `PlanValidationError` (a ValueError) naming the microbatch and field at fault. Numpy
plus plain Python, written from the contract, not from the builder, and never importing the
planner; `harts plan` and a trainer's `validate="full"` run it. What it checks beyond the slice
check, and `forest_like`: docs/design/plan-contract.md ("Three levels of checking").
Legend: R local rows, I imported rows, S segments, P log-prob entries, K conv kernel, C chunk size.
"""
from __future__ import annotations

import numpy as np

from proto.harts.v1 import plan_pb2
from plan.cross_edges import CrossEdgeArrays, check_rank_edges, decode_edges, held_bytes, remote_imports, sent_needs
from plan.header import check_header
from plan.memory_model import CHECKPOINTING, HEADS, RowSizes, rank_live_bytes
from plan.microbatch import PlanValidationError
from plan.oracle_logprobs import check_logprobs
from plan.oracle_rows import CheckedMicrobatch, StepRows
from plan.oracle_schedule import check_ancestry, check_linear
from plan.oracle_stats import check_counts, check_cross_edge_stats
from plan.phases import check_rank_phases, lockstep_phases


def _fail(where: str, msg: str) -> None:
    raise PlanValidationError(f"{where}: {msg}")


def _memory_sizes(params: plan_pb2.PlanParams) -> RowSizes:
    try:
        sizes = RowSizes.from_proto(params.memory)
    except ValueError as exc:
        raise PlanValidationError(f"header.params.memory: expected the memory model's byte sizes ({exc})") from None
    want = params.memory_tokens * sizes.row_bytes
    if params.memory.memory_bytes != want:
        _fail("header.params.memory.memory_bytes", f"expected memory_tokens x (activation_row_bytes + recompute_row_bytes) = "
                                                   f"{want}, got {params.memory.memory_bytes}")
    for name, known in (("activation_checkpointing", CHECKPOINTING), ("head", HEADS)):
        value = getattr(params.memory, name)
        if value and value not in known:
            _fail(f"header.params.memory.{name}", f"expected empty or one of {', '.join(known)}, got {value!r}")
    return sizes


def _check_live_memory(where: str, params: plan_pb2.PlanParams, rank: plan_pb2.RankPlan, ids: list[int],
                       mbs: dict[int, CheckedMicrobatch], edges: list[CrossEdgeArrays]) -> int:
    """Live window stack at every step under the memory model (plan.memory_model), with the
    exporters' remote needs and the received exports of cross edges (plan.cross_edges); returns
    the peak bytes."""
    sizes = _memory_sizes(params)
    arrays = {m: mb.arrays for m, mb in mbs.items()}
    real = [(i, s) for i, s in enumerate(rank.steps) if s.microbatch >= 0]  # stand-ins hold no activations
    held = held_bytes(edges, rank.rank, len(rank.steps))[[i for i, _ in real]] if edges else None
    live, peak = rank_live_bytes(sizes, arrays, [(s.kind == plan_pb2.ExecStep.FORWARD, ids[s.microbatch]) for _, s in real],
                                 sent=sent_needs(edges, rank.rank), remote=remote_imports(edges, rank.rank), held=held)
    budget = params.memory.memory_bytes
    for (i, _), x in zip(real, live):
        if x > budget:
            _fail(f"{where}.steps[{i}]", f"live window stack {x} bytes ({sizes.tokens(x)} row-equivalents) exceeds memory_bytes {budget} (memory_tokens {params.memory_tokens})")
    return peak


def _check_rank(header: plan_pb2.PlanHeader, rank: plan_pb2.RankPlan
                ) -> tuple[dict[int, CheckedMicrobatch], list[int], int, list[CrossEdgeArrays]]:
    """One rank's tables, execution order, live memory and the one-rank rules of its cross edges.

    Returns:
        (its microbatches by id, their ids in forward order, its peak live bytes, its decoded edges).
    """
    params = header.params
    where = f"rank {rank.rank}"
    mbs: dict[int, CheckedMicrobatch] = {}
    for mb in rank.microbatches:
        if mb.id in mbs:
            _fail(f"{where}.microbatches", f"microbatch id {mb.id} appears twice")
        mbs[mb.id] = CheckedMicrobatch(mb, params, len(header.tree_ids))
        computed = mb.num_rows + mb.replay_tokens
        if computed > params.microbatch_tokens:
            _fail(f"microbatch {mb.id}", f"computed rows {computed} exceed microbatch_tokens {params.microbatch_tokens}")
        if int(mbs[mb.id].row_dup.sum()) != mb.duplicated_tokens:
            _fail(f"microbatch {mb.id}.duplicated_tokens", f"expected {int(mbs[mb.id].row_dup.sum())}, got {mb.duplicated_tokens}")
        if mbs[mb.id].I and not params.windows:
            _fail(f"microbatch {mb.id}.import_row", "expected no imports with windows off")
    # Execution order: each microbatch forward once then backward once, properly nested; in a
    # lock-step plan one step per phase of the phase's kind, stand-ins paired (plan.phases).
    ids = [mb.id for mb in rank.microbatches]
    phases = lockstep_phases(header)
    if params.lockstep:
        check_rank_phases(where, phases, [(s.kind, s.microbatch, s.standin) for s in rank.steps],
                          [mb.recompute for mb in rank.microbatches])
    else:
        for i, step in enumerate(rank.steps):
            if step.standin:
                _fail(f"{where}.steps[{i}]", f"expected standin 0 in a free plan (params.lockstep false), got {step.standin}")
    edges = decode_edges(rank)
    remote = remote_imports(edges, rank.rank)
    seen_f: dict[int, int] = {}
    seen_b: dict[int, int] = {}
    stack: list[int] = []
    order: list[int] = []
    for i, step in enumerate(rank.steps):
        if params.lockstep and step.microbatch == -1:
            continue
        if not 0 <= step.microbatch < len(ids):
            _fail(f"{where}.steps[{i}]", f"expected an index < {len(ids)}, got {step.microbatch}")
        m = ids[step.microbatch]
        if step.kind == plan_pb2.ExecStep.FORWARD:
            if m in seen_f:
                _fail(f"{where}.steps[{i}]", f"microbatch {m} forwarded twice")
            seen_f[m] = i
            for e in set(mbs[m].import_mb.tolist()) | {s.microbatch for s in mbs[m].msg.state_imports}:
                if e not in stack and not ((e, m) in remote and e not in mbs):  # another rank's: its edge says when
                    _fail(f"{where}.steps[{i}]", f"microbatch {m} imports from {e}, which is not an open window here")
            stack.append(m)
            order.append(m)
        else:
            if m not in seen_f or m in seen_b:
                _fail(f"{where}.steps[{i}]", f"backward of microbatch {m} without one prior forward")
            if not stack or stack[-1] != m:
                _fail(f"{where}.steps[{i}]", f"backward of {m} is not depth-first (open: {stack})")
            seen_b[m] = i
            stack.pop()
    for m in ids:
        if m not in seen_f or m not in seen_b:
            _fail(f"{where}.steps", f"microbatch {m} is not forwarded and backwarded exactly once")
    # in a lock-step plan the step index is the phase
    check_rank_edges(header, rank.rank, edges, [mbs[m].arrays for m in ids], {m: i for i, m in enumerate(ids)},
                     [(s.kind, s.microbatch) for s in rank.steps])
    peak = _check_live_memory(where, params, rank, ids, mbs, edges)
    return mbs, order, peak, edges


def _check_rows(header: plan_pb2.PlanHeader, mbs: dict[int, CheckedMicrobatch], order: list[int], st: StepRows,
                states_of: dict[int, dict[int, tuple[int, int]]]) -> None:
    """Resolve the microbatches of `order` (exporters first) and check what depends on their
    rows: ancestry, linear-attention schedules, the log-prob map's rows, export rows."""
    params = header.params
    for m in order:
        st.resolve(m, order)
        check_ancestry(mbs[m], st.pred[m], params.conv_kernel)
        check_linear(mbs[m], st, params, states_of)
        mb = mbs[m]
        if mb.P:
            r = mb.lp_row
            if ((r < 0) | (r >= mb.R)).any():
                _fail(f"{mb.where}.lp_row", f"expected local rows in [0, {mb.R})")
            if (mb.row_dup[r] == 1).any():
                _fail(f"{mb.where}.lp_row", "expected kept rows, got a duplicated context row")
            if not np.array_equal(mb.depth[r].astype(np.int64), mb.lp_pos.astype(np.int64) - 1):
                i = int(np.flatnonzero(mb.depth[r] != mb.lp_pos - 1)[0])
                _fail(f"{mb.where}.lp_row[{i}]", f"expected a row at depth {int(mb.lp_pos[i]) - 1} (position - 1), got depth {int(mb.depth[r[i]])}")
            if ((mb.lp_traj < 0) | (mb.lp_traj >= len(header.trajectory_ids))).any():
                _fail(f"{mb.where}.lp_traj", f"expected indices into header.trajectory_ids (< {len(header.trajectory_ids)})")
            if header.params.logprob_positions == plan_pb2.LOGPROB_POSITIONS_LOSS and (mb.lp_loss_mask != 1).any():
                _fail(f"{mb.where}.lp_loss_mask", "expected only loss positions (mask 1) in a loss-positions plan")
        rows = mb.export_rows
        if rows.shape[0] and ((rows < 0) | (rows >= mb.R + mb.I)).any():
            _fail(f"{mb.where}.export_rows", f"expected extended rows in [0, {mb.R + mb.I})")


def validate_slice(slice_: plan_pb2.PlanSlice) -> None:
    """Check one rank's slice: tables, ancestry, schedule, imports, budgets, execution order and
    the one-rank rules of its cross edges (plan.cross_edges).

    A microbatch whose rows come, directly or through its window ancestors, from another rank
    (a cross edge) cannot have its token chains, ancestry and states checked without that rank:
    validate_plan checks them.

    Raises:
        PlanValidationError: the first violated rule, naming the microbatch and field.
    """
    check_header(slice_.header)
    mbs, order, _, edges = _check_rank(slice_.header, slice_.rank)
    remote = {x for x, _ in remote_imports(edges, slice_.rank.rank)}
    alone: list[int] = []
    for m in order:
        mb = mbs[m]
        sources = set(mb.import_mb.tolist()) | {s.microbatch for s in mb.msg.state_imports}
        if sources & remote:
            remote.add(m)  # its importers depend on another rank too
        else:
            alone.append(m)
    _check_rows(slice_.header, mbs, alone, StepRows(mbs), {})


def validate_plan(plan: plan_pb2.Plan, forest_like=None) -> None:
    """Check a whole plan: every rank slice, then the step-wide rules.

    Step-wide rules: microbatch ids 0..M-1 each placed exactly once; every forest token kept
    (non-duplicated) exactly once; every trajectory position with a loss term (or every position
    1..L-1 for LOGPROB_POSITIONS_ALL) has exactly one log-prob entry whose row ends the
    trajectory's prefix and whose label is the next token (through `forest_like` when given;
    otherwise consecutive entries of a trajectory must chain); normalisers and stats consistent.

    Raises:
        PlanValidationError: the first violated rule.
    """
    header = plan.header
    if header.local_tables:
        _fail("header.local_tables", "expected the step's tables in a whole plan (local tables are for slices)")
    check_header(header)
    p = header.params
    if len(plan.ranks) != p.world_size:
        _fail("ranks", f"expected {p.world_size} rank plans, got {len(plan.ranks)}")
    all_mbs, order, peak, edges = _check_ranks(plan)
    M = len(all_mbs)
    if sorted(all_mbs) != list(range(M)):
        _fail("ranks", f"expected microbatch ids 0..{M - 1}, got {sorted(all_mbs)[:5]}...")
    check_cross_edge_stats(plan, edges)
    st_all = StepRows(all_mbs)
    _check_rows(header, all_mbs, order, st_all, {})
    kept = _check_kept_once(all_mbs, st_all)
    check_counts(plan, all_mbs, kept, peak, _memory_sizes(p))
    _check_copies_agree(all_mbs, st_all)
    calls = max((len(mb.msg.linear_calls) for mb in all_mbs.values()), default=0)
    if header.stats.linear_attention_calls != calls:
        _fail("header.stats.linear_attention_calls", f"expected {calls}, got {header.stats.linear_attention_calls}")
    check_logprobs(header, all_mbs, st_all, forest_like)
    if forest_like is not None:
        expect = getattr(forest_like, "unique_tokens", None)
        if expect is not None and int(expect) != kept:
            _fail("ranks", f"expected {int(expect)} distinct forest tokens kept, got {kept}")


def _check_ranks(plan: plan_pb2.Plan
                 ) -> tuple[dict[int, CheckedMicrobatch], list[int], int, list[CrossEdgeArrays]]:
    """Every rank's rules (`_check_rank`). Returns the step's microbatches by id, the order in
    which their rows resolve (exporters first: rank by rank in a free plan, by forward phase in a
    lock-step plan, where a cross edge's exporter forwards in an earlier phase than its importer),
    the peak live bytes of any rank and every rank's decoded cross edges."""
    header = plan.header
    all_mbs: dict[int, CheckedMicrobatch] = {}
    peak = 0
    forward: list[tuple[int, int, int]] = []  # (forward step = phase in a lock-step plan, rank, microbatch)
    edges: list[CrossEdgeArrays] = []
    for i, rank in enumerate(plan.ranks):
        if rank.rank != i:
            _fail(f"ranks[{i}].rank", f"expected {i}, got {rank.rank}")
        mbs, _, rank_peak, rank_edges = _check_rank(header, rank)
        peak = max(peak, rank_peak)
        edges += rank_edges
        for m, mb in mbs.items():
            if m in all_mbs:
                _fail(f"microbatch {m}", "placed on more than one rank")
            all_mbs[m] = mb
        ids = [mb.id for mb in rank.microbatches]
        forward += [(j, i, ids[s.microbatch]) for j, s in enumerate(rank.steps)
                    if s.microbatch >= 0 and s.kind == plan_pb2.ExecStep.FORWARD]
    order = [m for _, _, m in (sorted(forward) if header.params.lockstep else sorted(forward, key=lambda x: (x[1], x[0])))]
    return all_mbs, order, peak, edges


def _check_kept_once(all_mbs: dict[int, CheckedMicrobatch], st: StepRows) -> int:
    """Each forest identity kept once over the non-duplicated rows; returns the kept rows."""
    kept = [st.ident[m][: mb.R][mb.row_dup == 0] for m, mb in all_mbs.items()]
    kept_all = np.concatenate(kept) if kept else np.zeros(0, np.int64)
    uniq, counts = np.unique(kept_all, return_counts=True)
    if (counts > 1).any():
        x = int(uniq[np.flatnonzero(counts > 1)[0]])
        _fail("ranks", f"forest token (segment {x >> 32}, offset {x & 0xFFFFFFFF}) is kept in more than one microbatch")
    return int(kept_all.shape[0])


def _check_copies_agree(all_mbs: dict[int, CheckedMicrobatch], st: StepRows) -> None:
    """Every copy of a forest token (kept or duplicated) carries the same token id and depth."""
    M = len(all_mbs)
    ident = np.concatenate([st.ident[m][: mb.R] for m, mb in all_mbs.items()]) if M else np.zeros(0, np.int64)
    tok_depth = np.concatenate([np.stack([mb.tokens, mb.depth], 1) for mb in all_mbs.values()]) if M else np.zeros((0, 2), np.int32)
    order = np.argsort(ident, kind="stable")
    same = ident[order][1:] == ident[order][:-1]
    differs = (tok_depth[order][1:] != tok_depth[order][:-1]).any(axis=1)
    if (same & differs).any():
        x = int(ident[order][1:][np.flatnonzero(same & differs)[0]])
        _fail("ranks", f"copies of forest token (segment {x >> 32}, offset {x & 0xFFFFFFFF}) disagree on token id or depth")
