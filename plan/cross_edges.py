"""Windows across ranks (plan.proto `CrossEdge`): decoded edges, their rules, bytes, what moves when.

    edges = decode_edges(rank_plan)                                   # [CrossEdgeArrays]
    check_rank_edges(header, rank, edges, arrays, index, steps)       # one rank's rules
    check_plan_edges(plan.ranks)                                      # step-wide: both sides agree
    held, moved = held_bytes(edges, rank, P), transfer_bytes(edges, rank, P)   # memory, cost per phase

Used by the planner's builder, the validator, the slice check and the trainer (`trainer/cross_rank.py`);
numpy only. The rules, memory and costs: docs/design/cross-rank.md.
Legend: E edges of a rank, P phases, n rows of one kind, q states of an edge.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan.microbatch import MicrobatchArrays, PlanValidationError
from plan.memory_model import RowSizes
from plan.window_exports import ATTN, CONV, KERNEL, KINDS, ExportNeeds, export_needs, import_needs
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2

__all__ = ["CrossEdgeArrays", "check_plan_edges", "check_rank_edges", "decode_edges", "edge_bytes", "held_bytes",
           "remote_imports", "sent_needs", "transfer_bytes"]

#: CrossEdge field of each export kind's rows (plan.window_exports.KINDS).
ROW_FIELDS = {ATTN: "attn_rows", CONV: "conv_rows", KERNEL: "kernel_rows"}


def _fail(where: str, msg: str):
    raise PlanValidationError(f"{where}: {msg}")


@dataclass(slots=True, kw_only=True, frozen=True)
class CrossEdgeArrays:
    """One decoded `CrossEdge`."""

    id: int
    exporter: int
    """Global microbatch id of the exporter."""
    exporter_rank: int
    importer: int
    """Global microbatch id of the importer."""
    importer_rank: int
    rows: dict[str, np.ndarray]
    """kind (ATTN, CONV, KERNEL) -> int64 [n] sorted extended rows of the exporter."""
    states: np.ndarray
    """int64 [q] sorted ids in the exporter's state table."""
    send_phase: int
    grad_phase: int
    bytes: int

    @property
    def where(self) -> str:
        return f"cross edge {self.id} (microbatch {self.exporter} on rank {self.exporter_rank} -> " \
               f"microbatch {self.importer} on rank {self.importer_rank})"

    @property
    def needs(self) -> ExportNeeds:
        """What the importer reads of the exporter over this edge, as `plan.window_exports` counts it."""
        return ExportNeeds(rows=dict(self.rows), states=self.states)

    def peer(self, rank: int) -> int:
        """The other side's rank, seen from `rank`."""
        return self.importer_rank if rank == self.exporter_rank else self.exporter_rank


def decode_edges(rank: plan_pb2.RankPlan) -> list[CrossEdgeArrays]:
    """Unpack a rank's cross edges (array lengths only; `check_rank_edges` checks the rest).

    Raises:
        PlanValidationError: a row or state field that is not int32 bytes, naming the edge.
    """
    out = []
    for i, e in enumerate(rank.cross_edges):
        w = f"rank {rank.rank}.cross_edges[{i}]"

        def arr(name: str) -> np.ndarray:
            try:
                return unpack(getattr(e, name), "int32", name=f"{w}.{name}").astype(np.int64)
            except ValueError as exc:
                raise PlanValidationError(str(exc)) from None

        out.append(CrossEdgeArrays(
            id=int(e.id), exporter=int(e.exporter), exporter_rank=int(e.exporter_rank), importer=int(e.importer),
            importer_rank=int(e.importer_rank), rows={k: arr(f) for k, f in ROW_FIELDS.items()}, states=arr("states"),
            send_phase=int(e.send_phase), grad_phase=int(e.grad_phase), bytes=int(e.bytes)))
    return out


def edge_bytes(sizes: RowSizes, needs: ExportNeeds) -> int:
    """Bytes an edge with these rows and states sends each way (CrossEdge.bytes)."""
    return int(sizes.export_bytes(int(needs.rows[ATTN].shape[0]), int(needs.rows[CONV].shape[0]),
                                  int(needs.rows[KERNEL].shape[0]), int(needs.states.shape[0])))


def sent_needs(edges: list[CrossEdgeArrays], rank: int) -> dict[int, list[ExportNeeds]]:
    """Exporter id -> what importers on other ranks read of it, for the edges this rank exports
    (`plan.window_exports.export_needs(..., sent=...)`)."""
    out: dict[int, list[ExportNeeds]] = {}
    for e in edges:
        if e.exporter_rank == rank:
            out.setdefault(e.exporter, []).append(e.needs)
    return out


def remote_imports(edges: list[CrossEdgeArrays], rank: int) -> set[tuple[int, int]]:
    """(exporter id, importer id) of the edges this rank imports over: imports another rank's
    exporter provides (`plan.window_exports.export_needs(..., remote=...)`)."""
    return {(e.exporter, e.importer) for e in edges if e.importer_rank == rank}


def held_bytes(edges: list[CrossEdgeArrays], rank: int, num_phases: int) -> np.ndarray:
    """int64 [P] bytes of received exports the rank holds in each phase: an edge it imports holds
    `bytes` in phases send_phase < p <= grad_phase."""
    out = np.zeros(num_phases + 1, np.int64)
    for e in edges:
        if e.importer_rank == rank:
            out[e.send_phase + 1] += e.bytes
            out[e.grad_phase + 1] -= e.bytes
    return np.cumsum(out)[:num_phases]


def transfer_bytes(edges: list[CrossEdgeArrays], rank: int, num_phases: int) -> np.ndarray:
    """int64 [P] bytes the rank sends or receives at the end of each phase: every edge of the rank
    moves `bytes` in its send_phase (exports) and again in its grad_phase (their gradients)."""
    out = np.zeros(num_phases, np.int64)
    for e in edges:
        if rank in (e.exporter_rank, e.importer_rank):
            out[e.send_phase] += e.bytes
            out[e.grad_phase] += e.bytes
    return out


def _sorted_subset(where: str, name: str, values: np.ndarray, of: np.ndarray, what: str) -> None:
    """`values` strictly increasing, >= 0 and all in `of`."""
    if values.shape[0] and (values[0] < 0 or (np.diff(values) <= 0).any()):
        _fail(f"{where}.{name}", "expected sorted, distinct ids >= 0")
    missing = values[~np.isin(values, of)]
    if missing.shape[0]:
        _fail(f"{where}.{name}", f"expected {what}, got {int(missing[0])}")


def check_rank_edges(header: plan_pb2.PlanHeader, rank: int, edges: list[CrossEdgeArrays],
                     arrays: list[MicrobatchArrays], index: dict[int, int], steps: list[tuple[int, int]]) -> None:
    """The one-rank rules for one rank's edges (docs/design/cross-rank.md, "The rules").

    Args:
        rank: this rank.
        edges: its `decode_edges`.
        arrays: its decoded microbatches (RankPlan order); index: microbatch id -> position there.
        steps: (kind, microbatch index or -1) per step; step i runs in phase i. Every import from
            another rank has its edge (the callers' execution-order rules check that first).

    Raises:
        PlanValidationError: the first violated rule, naming the edge and field, e.g.
            "rank 1.cross_edges[0].send_phase: expected < 4 (the importer's FORWARD phase), got 4".
    """
    if not edges:
        return
    params = header.params
    if not params.lockstep:
        _fail(f"rank {rank}.cross_edges", f"expected none in a free plan (windows cross ranks only in lock-step "
                                          f"plans), got {len(edges)}")
    P, W = len(steps), params.world_size
    try:
        sizes = RowSizes.from_proto(params.memory)
    except ValueError as exc:
        raise PlanValidationError(f"header.params.memory: expected the memory model's byte sizes ({exc})") from None
    phase_of: dict[tuple[int, int], int] = {}  # (kind, microbatch index) -> its phase
    for p, (kind, k) in enumerate(steps):
        phase_of[kind, k] = p
    fwd, bwd = plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD
    last = -1
    incoming: dict[tuple[int, int], int] = {}
    for i, e in enumerate(edges):
        w = f"rank {rank}.cross_edges[{i}]"
        if e.id <= last:
            _fail(f"{w}.id", f"expected ids increasing and >= 0 within a rank, got {e.id} after {last}")
        last = e.id
        _check_ends(w, e, rank, W, P)
        side, here, there = ("exporter", e.exporter, e.importer) if rank == e.exporter_rank else \
            ("importer", e.importer, e.exporter)
        if here not in index:
            _fail(f"{w}.{side}", f"expected a microbatch of rank {rank}, got {here}")
        if there in index:
            other = "importer" if side == "exporter" else "exporter"
            _fail(f"{w}.{other}", f"expected a microbatch of rank {e.peer(rank)}, got {there}, which runs on rank {rank}")
        a = arrays[index[here]]
        f_here, b_here = phase_of[fwd, index[here]], phase_of[bwd, index[here]]
        if side == "exporter":
            _check_exporter_side(w, e, a, f_here, b_here)
        else:
            _check_importer_side(w, e, a, f_here, b_here, incoming)
        want = edge_bytes(sizes, e.needs)
        if e.bytes != want:
            _fail(f"{w}.bytes", f"expected {want} (the memory model of its rows and states), got {e.bytes}")
    if incoming:
        _check_reads(rank, edges, arrays, index, steps)


def _check_ends(w: str, e: CrossEdgeArrays, rank: int, W: int, P: int) -> None:
    """The edge's two ranks (distinct, one of them this rank) and its phases within the step."""
    for name in ("exporter_rank", "importer_rank"):
        if not 0 <= getattr(e, name) < W:
            _fail(f"{w}.{name}", f"expected a rank in [0, {W}), got {getattr(e, name)}")
    if e.exporter_rank == e.importer_rank:
        _fail(f"{w}.importer_rank", f"expected two different ranks, a rank other than the exporter's "
                                    f"({e.exporter_rank}), got {e.importer_rank}")
    if rank not in (e.exporter_rank, e.importer_rank):
        _fail(w, f"expected rank {rank} to be its exporter's or its importer's rank, got "
                 f"{e.exporter_rank} -> {e.importer_rank}")
    if not 0 <= e.send_phase < e.grad_phase < P:
        _fail(f"{w}.send_phase", f"expected 0 <= send_phase < grad_phase < {P} (phases of the step), "
                                 f"got {e.send_phase} and {e.grad_phase}")


def _check_exporter_side(w: str, e: CrossEdgeArrays, a: MicrobatchArrays, f_here: int, b_here: int) -> None:
    """On the exporter's rank: rows and states it exports, sent after its FORWARD, answered before its BACKWARD."""
    rows_of = np.asarray(a.export_rows, np.int64)
    for k in KINDS:
        _sorted_subset(w, ROW_FIELDS[k], e.rows[k], rows_of, f"rows of microbatch {a.id}'s export_rows")
    _sorted_subset(w, "states", e.states, np.asarray(a.export_states, np.int64),
                   f"states of microbatch {a.id}'s export_states")
    if e.send_phase < f_here:
        _fail(f"{w}.send_phase", f"expected >= {f_here} (the exporter's FORWARD phase), got {e.send_phase}")
    if e.grad_phase >= b_here:
        _fail(f"{w}.grad_phase", f"expected < {b_here} (the exporter's BACKWARD phase), got {e.grad_phase}")


def _check_importer_side(w: str, e: CrossEdgeArrays, a: MicrobatchArrays, f_here: int, b_here: int,
                         incoming: dict[tuple[int, int], int]) -> None:
    """On the importer's rank: one edge per exporter, rows and states it imports (every state),
    received before its FORWARD, answered after its BACKWARD; records the edge in `incoming`."""
    if (e.importer, e.exporter) in incoming:
        _fail(w, f"a second edge from microbatch {e.exporter} to {e.importer} "
                 f"(edge {incoming[e.importer, e.exporter]})")
    incoming[e.importer, e.exporter] = e.id
    imported = np.asarray(a.import_row[a.import_microbatch == e.exporter], np.int64)
    for k in KINDS:
        _sorted_subset(w, ROW_FIELDS[k], e.rows[k], imported,
                       f"rows microbatch {a.id} imports from microbatch {e.exporter}")
    states = np.asarray(a.state_import_state[a.state_import_microbatch == e.exporter], np.int64)
    _sorted_subset(w, "states", e.states, states, f"states microbatch {a.id} imports from microbatch {e.exporter}")
    unsent = states[~np.isin(states, e.states)]
    if unsent.shape[0]:
        _fail(f"{w}.states", f"expected every state microbatch {a.id} imports from microbatch {e.exporter}, "
                             f"state {int(unsent[0])} is missing")
    if e.send_phase >= f_here:
        _fail(f"{w}.send_phase", f"expected < {f_here} (the importer's FORWARD phase), got {e.send_phase}")
    if e.grad_phase < b_here:
        _fail(f"{w}.grad_phase", f"expected >= {b_here} (the importer's BACKWARD phase), got {e.grad_phase}")


def _check_reads(rank: int, edges: list[CrossEdgeArrays], arrays: list[MicrobatchArrays], index: dict[int, int],
                 steps: list[tuple[int, int]]) -> None:
    """The importer side's rows are exactly what the importer and its importers read (its states
    are every state it imports from the exporter, checked with the edge)."""
    by_id = {a.id: a for a in arrays}
    order = [arrays[k].id for kind, k in steps if kind == plan_pb2.ExecStep.FORWARD and k >= 0]
    needs = export_needs(by_id, order, sent=sent_needs(edges, rank), remote=remote_imports(edges, rank))
    reads: dict[int, dict[int, ExportNeeds]] = {}
    for i, e in enumerate(edges):
        if e.importer_rank != rank:
            continue
        if e.importer not in reads:
            reads[e.importer] = import_needs(by_id[e.importer], needs.get(e.importer))
        want = reads[e.importer].get(e.exporter, ExportNeeds())
        w = f"rank {rank}.cross_edges[{i}]"
        for k in KINDS:
            if not np.array_equal(e.rows[k], want.rows[k]):
                _fail(f"{w}.{ROW_FIELDS[k]}", f"expected the {want.rows[k].shape[0]} rows of microbatch {e.exporter} "
                      f"that microbatch {e.importer} and its importers read, got {e.rows[k].shape[0]} rows "
                      f"({_first_difference(e.rows[k], want.rows[k])})")


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    extra = np.setdiff1d(got, want)
    if extra.shape[0]:
        return f"row {int(extra[0])} is not read"
    return f"row {int(np.setdiff1d(want, got)[0])} is missing"


def check_plan_edges(ranks: list[plan_pb2.RankPlan]) -> None:
    """Step-wide: every edge is listed, identically, by exactly its two ranks, and edge ids are
    0..E-1 (each rank's own rules: `check_rank_edges`).

    Raises:
        PlanValidationError: naming the edge.
    """
    seen: dict[int, tuple[int, bytes]] = {}
    for r in ranks:
        for e in r.cross_edges:
            body = e.SerializeToString(deterministic=True)
            if e.id in seen:
                first, other = seen[e.id]
                if first < 0:
                    _fail(f"cross edge {e.id}", f"expected it on two ranks, rank {r.rank} lists it a third time")
                if body != other:
                    _fail(f"cross edge {e.id}", f"ranks {first} and {r.rank} list it differently")
                seen[e.id] = (-1, body)  # listed twice: done
                if {first, r.rank} != {e.exporter_rank, e.importer_rank}:
                    _fail(f"cross edge {e.id}", f"expected it on ranks {e.exporter_rank} and {e.importer_rank}, "
                                                f"got ranks {first} and {r.rank}")
            else:
                seen[e.id] = (r.rank, body)
    once = sorted(i for i, (r, _) in seen.items() if r >= 0)
    if once:
        _fail(f"cross edge {once[0]}", "expected it on its exporter's and its importer's rank, got one rank only")
    if sorted(seen) != list(range(len(seen))):
        _fail("cross_edges", f"expected edge ids 0..{len(seen) - 1}, got {sorted(seen)[:8]}")
