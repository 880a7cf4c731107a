"""Windows across ranks (DESIGN §5.7, proto `CrossEdge`): decoded edges and the rules of one rank's edges.

    edges = decode_edges(rank)                                   # [CrossEdgeArrays], bounds-checked
    check_rank_edges(header, rank, edges, arrays, index, steps)  # PlanValidationError naming the edge

A cross edge is a sharing window whose importer runs on another rank than its exporter. Both
ranks list it in `RankPlan.cross_edges`; the exporter's rank sends the exported tensors of the
edge's rows and states at the end of its step of phase `send_phase`, the importer's rank sends
their gradients back at the end of `grad_phase`. The rules one rank can check alone (the slice
check runs them, `plan.slice_check`; the oracle validator can run them per rank):

- a lock-step plan (phases name when tensors travel); edges in increasing id, each id once;
- exporter_rank != importer_rank, both in [0, world_size), this rank one of them; the microbatch
  of this rank's side is one of its microbatches, the other side's is not;
- rows and states int32, sorted, distinct, >= 0. On the exporter's rank: rows among the
  exporter's `export_rows`, states among its `export_states`. On the importer's rank: rows among
  the rows the importer imports from that exporter (`import_row` where `import_microbatch` is the
  exporter), states among its state imports from it, and every state import from it on the edge;
- phases: the exporter's FORWARD phase <= send_phase < the importer's FORWARD phase, the
  importer's BACKWARD phase <= grad_phase < the exporter's BACKWARD phase (each rank checks its
  side; in a lock-step plan step i runs in phase i);
- bytes: the plan's memory model of the edge's rows and states (`edge_bytes`).

Which rows each kind must carry (the importer's consumers, `plan.window_exports`) is what the
trainer's layout checks when it builds the importer (an import missing from the edge is an error
naming both microbatches). Step-wide rules (both ranks list the same edge) need the whole plan:
`check_plan_edges`.

Legend: n rows of one kind, q states of the edge.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plan.decode import MicrobatchArrays, PlanValidationError
from plan.window_exports import ATTN, CONV, KERNEL, KINDS, ExportNeeds
from proto.arrays import unpack
from proto.harts.v1 import plan_pb2

__all__ = ["CrossEdgeArrays", "check_plan_edges", "check_rank_edges", "decode_edges", "edge_bytes"]

#: CrossEdge field of each export kind's rows
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


def edge_bytes(memory: plan_pb2.MemoryModel, rows: dict[str, np.ndarray], states: np.ndarray) -> int:
    """Bytes an edge sends each way under the plan's memory model (CrossEdge.bytes)."""
    return (rows[ATTN].shape[0] * memory.attn_row_bytes + rows[CONV].shape[0] * memory.conv_row_bytes
            + rows[KERNEL].shape[0] * memory.kernel_row_bytes + states.shape[0] * memory.state_bytes)


def _sorted_subset(where: str, name: str, values: np.ndarray, of: np.ndarray, what: str) -> None:
    """`values` strictly increasing, >= 0 and all in `of`."""
    if values.shape[0] and (values[0] < 0 or (np.diff(values) <= 0).any()):
        _fail(f"{where}.{name}", "expected sorted, distinct ids >= 0")
    missing = values[~np.isin(values, of)]
    if missing.shape[0]:
        _fail(f"{where}.{name}", f"expected {what}, got {int(missing[0])}")


def check_rank_edges(header: plan_pb2.PlanHeader, rank: int, edges: list[CrossEdgeArrays],
                     arrays: list[MicrobatchArrays], index: dict[int, int], steps: list[tuple[int, int]]) -> None:
    """The rules of the module docstring for one rank's edges.

    Args:
        rank: this rank.
        edges: its `decode_edges`.
        arrays: its decoded microbatches (RankPlan order); index: microbatch id -> position there.
        steps: (kind, microbatch index or -1) per step; step i runs in phase i.

    Raises:
        PlanValidationError: the first violated rule, naming the edge.
    """
    if not edges:
        return
    params = header.params
    if not params.lockstep:
        _fail(f"rank {rank}.cross_edges", f"expected none in a free plan (params.lockstep false), got {len(edges)}")
    P, W = len(steps), params.world_size
    phase_of: dict[tuple[int, int], int] = {}  # (kind, microbatch index) -> its phase
    for p, (kind, k) in enumerate(steps):
        phase_of[kind, k] = p
    fwd, bwd = plan_pb2.ExecStep.FORWARD, plan_pb2.ExecStep.BACKWARD
    last = -1
    for i, e in enumerate(edges):
        w = f"rank {rank}.cross_edges[{i}] ({e.where})"
        if e.id <= last:
            _fail(w, f"expected edges in increasing id, got id {e.id} after {last}")
        last = e.id
        if e.exporter_rank == e.importer_rank or not (0 <= e.exporter_rank < W and 0 <= e.importer_rank < W):
            _fail(w, f"expected two different ranks in [0, {W}), got exporter_rank {e.exporter_rank}, "
                     f"importer_rank {e.importer_rank}")
        if rank not in (e.exporter_rank, e.importer_rank):
            _fail(w, f"expected rank {rank} to be its exporter's or its importer's rank")
        for name, p in (("send_phase", e.send_phase), ("grad_phase", e.grad_phase)):
            if not 0 <= p < P:
                _fail(f"{w}.{name}", f"expected a phase in [0, {P}), got {p}")
        here, there = (e.exporter, e.importer) if rank == e.exporter_rank else (e.importer, e.exporter)
        if here not in index:
            _fail(w, f"expected microbatch {here} on rank {rank}, it is not one of its microbatches")
        if there in index:
            _fail(w, f"expected microbatch {there} on rank {e.peer(rank)}, got one of rank {rank}'s microbatches")
        a = arrays[index[here]]
        f_here, b_here = phase_of[fwd, index[here]], phase_of[bwd, index[here]]
        if rank == e.exporter_rank:
            rows_of = np.asarray(a.export_rows, np.int64)
            for k in KINDS:
                _sorted_subset(w, ROW_FIELDS[k], e.rows[k], rows_of, f"rows of microbatch {a.id}'s export_rows")
            _sorted_subset(w, "states", e.states, np.asarray(a.export_states, np.int64),
                           f"states of microbatch {a.id}'s export_states")
            if e.send_phase < f_here:
                _fail(f"{w}.send_phase", f"expected >= {f_here} (the exporter's FORWARD phase), got {e.send_phase}")
            if e.grad_phase >= b_here:
                _fail(f"{w}.grad_phase", f"expected < {b_here} (the exporter's BACKWARD phase), got {e.grad_phase}")
        else:
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
        want = edge_bytes(params.memory, e.rows, e.states)
        if e.bytes != want:
            _fail(f"{w}.bytes", f"expected {want} (the memory model of its rows and states), got {e.bytes}")


def check_plan_edges(ranks: list[plan_pb2.RankPlan]) -> None:
    """Step-wide: every edge is listed, identically, by exactly its two ranks, and edge ids are
    0..n-1 (each rank's own rules: `check_rank_edges`).

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
