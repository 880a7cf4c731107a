"""Windows across ranks (DESIGN §5.7, plan.proto `CrossEdge`): what one rank's data decides.

    edges = decode_edges(rank_plan, world_size, num_phases)        # [CrossEdgeArrays], bounds-checked
    check_rank_edges(where, rank_plan.rank, edges, arrays_by_id, order, fwd_phase, bwd_phase, sizes)
    needs = export_needs(arrays_by_id, order, remote=outgoing_needs(edges, rank),
                         external=remote_exporters(edges, rank))    # plan.window_exports
    held = held_bytes(edges, rank, num_phases)                     # what received exports occupy
    moved = transfer_bytes(edges, rank, num_phases)                # what the rank sends or receives

A sharing window whose importer runs on another rank than its exporter is a `CrossEdge`, listed in
both ranks' `RankPlan.cross_edges` with a step-wide id. The importer's Microbatch names the
exporter in `import_microbatch` (rows) and / or `state_imports` (states) as for a local window; the
edge says what travels and when:

- rows and states: exactly `plan.window_exports.reads_of(importer, its own needs, exporter)`,
  what the importer and, transitively, its own importers (local ones, and remote ones through the
  importer's outgoing edges) read of the exporter, per kind (ATTN: K/V; CONV: conv inputs; KERNEL:
  q/k/v/g/beta of replay rows) plus the fp32 states. The importer's rank decides it alone;
- phases: the exports travel at the end of `send_phase` (>= the exporter's FORWARD phase, < the
  importer's), their gradients at the end of `grad_phase` (>= the importer's BACKWARD phase, < the
  exporter's BACKWARD phase). Each side checks its half;
- bytes: `RowSizes.export_bytes` of the row and state counts (PlanParams.memory), each way.

Memory (plan.memory_model): the exporter's open window is what it is for a local importer (its
full activations, or when recomputed its exports, those the remote importers read included:
`outgoing_needs`); the importer's rank holds the received tensors, `bytes`, in every phase p with
send_phase < p <= grad_phase (`held_bytes`), whatever it runs then.

Cost (PlanStats, plan.phases): the exports cost `bytes x CostModel.transfer_byte` to both ranks in
`send_phase`, and their gradients the same in `grad_phase` (`transfer_bytes`): a lock-step phase
lasts as long as its slowest rank's step plus its transfers.

Used by the planner's builder, the oracle validator (`plan.validator`, which adds the step-wide
rules: each edge identical on both ranks, ids 0..E-1) and the fast slice check. Numpy only.

Legend: E edges of a rank, P phases.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from proto.arrays import unpack
from proto.harts.v1 import plan_pb2
from plan.decode import MicrobatchArrays, PlanValidationError
from plan.memory_model import RowSizes
from plan.window_exports import ATTN, CONV, KERNEL, KINDS, ExportNeeds, export_needs, reads_of

__all__ = ["CrossEdgeArrays", "check_rank_edges", "decode_edges", "edge_bytes", "held_bytes", "outgoing_needs",
           "remote_exporters", "transfer_bytes"]

#: CrossEdge row fields per export kind (plan.window_exports.KINDS).
ROW_FIELDS = {ATTN: "attn_rows", CONV: "conv_rows", KERNEL: "kernel_rows"}


def _fail(where: str, msg: str):
    raise PlanValidationError(f"{where}: {msg}")


@dataclass(slots=True, kw_only=True)
class CrossEdgeArrays:
    """One decoded CrossEdge (see plan.proto)."""

    id: int
    exporter: int
    exporter_rank: int
    importer: int
    importer_rank: int
    rows: dict[str, np.ndarray]
    """kind -> int64 sorted unique extended rows of the exporter (attn_rows, conv_rows, kernel_rows)."""
    states: np.ndarray
    """int64 sorted unique ids in the exporter's state table."""
    send_phase: int
    grad_phase: int
    bytes: int

    def needs(self) -> ExportNeeds:
        """The edge's rows and states as the exporter's needs (`plan.window_exports.ExportNeeds`)."""
        return ExportNeeds(rows=dict(self.rows), states=self.states)


def edge_bytes(sizes: RowSizes, needs: ExportNeeds) -> int:
    """Bytes an edge with these rows and states sends each way (CrossEdge.bytes)."""
    return int(sizes.export_bytes(int(needs.rows[ATTN].shape[0]), int(needs.rows[CONV].shape[0]),
                                  int(needs.rows[KERNEL].shape[0]), int(needs.states.shape[0])))


def _sorted_unique(where: str, a: np.ndarray) -> np.ndarray:
    a = a.astype(np.int64)
    if a.shape[0] and (a[0] < 0 or (np.diff(a) <= 0).any()):
        _fail(where, "expected sorted, distinct, non-negative ids")
    return a


def decode_edges(rank: plan_pb2.RankPlan, world_size: int, num_phases: int) -> list[CrossEdgeArrays]:
    """Decode one rank's cross_edges with the checks that need nothing else: ids increasing,
    ranks in [0, world_size), distinct and one of them this rank, rows and states sorted and
    distinct, phases in [0, num_phases) with send_phase < grad_phase, bytes >= 0.

    Raises:
        PlanValidationError: naming the edge and field, e.g. "rank 1.cross_edges[0].send_phase: ...".
    """
    out: list[CrossEdgeArrays] = []
    last = -1
    for j, e in enumerate(rank.cross_edges):
        w = f"rank {rank.rank}.cross_edges[{j}]"
        if e.id <= last:
            _fail(f"{w}.id", f"expected ids increasing and >= 0 within a rank, got {e.id} after {last}")
        last = e.id
        for name in ("exporter_rank", "importer_rank"):
            if not 0 <= getattr(e, name) < world_size:
                _fail(f"{w}.{name}", f"expected a rank in [0, {world_size}), got {getattr(e, name)}")
        if e.exporter_rank == e.importer_rank:
            _fail(f"{w}.importer_rank", f"expected a rank other than the exporter's ({e.exporter_rank}), got {e.importer_rank}")
        if rank.rank not in (e.exporter_rank, e.importer_rank):
            _fail(w, f"expected rank {rank.rank} to be the exporter's or the importer's rank, got {e.exporter_rank} -> {e.importer_rank}")
        if e.exporter < 0 or e.importer < 0 or e.exporter == e.importer:
            _fail(w, f"expected two distinct microbatch ids >= 0, got exporter {e.exporter}, importer {e.importer}")
        if not 0 <= e.send_phase < e.grad_phase < num_phases:
            _fail(f"{w}.send_phase", f"expected 0 <= send_phase < grad_phase < {num_phases} (phases of the step), "
                  f"got {e.send_phase} and {e.grad_phase}")
        if e.bytes < 0:
            _fail(f"{w}.bytes", f"expected >= 0, got {e.bytes}")
        rows = {k: _sorted_unique(f"{w}.{f}", unpack(getattr(e, f), "int32")) for k, f in ROW_FIELDS.items()}
        out.append(CrossEdgeArrays(
            id=int(e.id), exporter=int(e.exporter), exporter_rank=int(e.exporter_rank), importer=int(e.importer),
            importer_rank=int(e.importer_rank), rows=rows, states=_sorted_unique(f"{w}.states", unpack(e.states, "int32")),
            send_phase=int(e.send_phase), grad_phase=int(e.grad_phase), bytes=int(e.bytes)))
    return out


def outgoing_needs(edges: list[CrossEdgeArrays], rank: int) -> dict[int, list[ExportNeeds]]:
    """Exporter id -> what importers on other ranks read of it, for the edges this rank exports
    (`plan.window_exports.export_needs(..., remote=...)`)."""
    out: dict[int, list[ExportNeeds]] = {}
    for e in edges:
        if e.exporter_rank == rank:
            out.setdefault(e.exporter, []).append(e.needs())
    return out


def remote_exporters(edges: list[CrossEdgeArrays], rank: int) -> set[int]:
    """Ids of the exporters on other ranks that this rank's microbatches import from."""
    return {e.exporter for e in edges if e.importer_rank == rank}


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


def check_rank_edges(where: str, rank: int, edges: list[CrossEdgeArrays], mbs: dict[int, MicrobatchArrays],
                     order: list[int], fwd_phase: dict[int, int], bwd_phase: dict[int, int], sizes: RowSizes) -> None:
    """The rules of one rank's edges that its own data decides (module docstring).

    Args:
        where: e.g. "rank 3", for the messages.
        rank: the rank; edges: its `decode_edges`.
        mbs: its decoded microbatches by id; order: their ids in forward order.
        fwd_phase / bwd_phase: microbatch id -> phase of its FORWARD / BACKWARD step.
        sizes: the plan's memory-model sizes (PlanParams.memory).

    Raises:
        PlanValidationError: the first violated rule, naming the edge and field.
    """
    incoming: dict[tuple[int, int], int] = {}
    for j, e in enumerate(edges):
        w = f"{where}.cross_edges[{j}]"
        if e.exporter_rank == rank:
            x = mbs.get(e.exporter)
            if x is None:
                _fail(f"{w}.exporter", f"expected a microbatch of rank {rank}, got {e.exporter}")
            n_ext = x.num_rows + x.num_imports
            listed = np.union1d(np.union1d(e.rows[ATTN], e.rows[CONV]), e.rows[KERNEL])
            if listed.shape[0] and (listed[-1] >= n_ext or not np.isin(listed, x.export_rows).all()):
                bad = int(listed[~np.isin(listed, x.export_rows) | (listed >= n_ext)][0])
                _fail(f"{w}.attn_rows", f"row {bad} is not an extended row of microbatch {e.exporter} listed in its export_rows")
            if e.states.shape[0] and not np.isin(e.states, x.export_states).all():
                bad = int(e.states[~np.isin(e.states, x.export_states)][0])
                _fail(f"{w}.states", f"state {bad} is not in microbatch {e.exporter}'s export_states")
            if e.send_phase < fwd_phase[e.exporter]:
                _fail(f"{w}.send_phase", f"expected >= {fwd_phase[e.exporter]} (the exporter's FORWARD phase), got {e.send_phase}")
            if e.grad_phase >= bwd_phase[e.exporter]:
                _fail(f"{w}.grad_phase", f"expected < {bwd_phase[e.exporter]} (the exporter's BACKWARD phase), got {e.grad_phase}")
        else:
            if e.importer not in mbs:
                _fail(f"{w}.importer", f"expected a microbatch of rank {rank}, got {e.importer}")
            if e.exporter in mbs:
                _fail(f"{w}.exporter", f"expected a microbatch of rank {e.exporter_rank}, got {e.exporter}, which runs on rank {rank}")
            if (e.importer, e.exporter) in incoming:
                _fail(w, f"a second edge from microbatch {e.exporter} to {e.importer} (edge {incoming[e.importer, e.exporter]})")
            incoming[e.importer, e.exporter] = e.id
            if e.send_phase >= fwd_phase[e.importer]:
                _fail(f"{w}.send_phase", f"expected < {fwd_phase[e.importer]} (the importer's FORWARD phase), got {e.send_phase}")
            if e.grad_phase < bwd_phase[e.importer]:
                _fail(f"{w}.grad_phase", f"expected >= {bwd_phase[e.importer]} (the importer's BACKWARD phase), got {e.grad_phase}")
        if e.bytes != edge_bytes(sizes, e.needs()):
            _fail(f"{w}.bytes", f"expected {edge_bytes(sizes, e.needs())} (its rows and states under the memory model), got {e.bytes}")
    for m in order:  # every import from another rank has its edge
        mb = mbs[m]
        for x in set(mb.import_microbatch.tolist()) | set(mb.state_import_microbatch.tolist()):
            if x not in mbs and (m, x) not in incoming:
                _fail(f"microbatch {m}.import_microbatch", f"imports from microbatch {x}, which is neither on rank {rank} "
                      f"nor the exporter of one of its cross_edges")
    if not incoming:
        return
    needs = export_needs(mbs, order, remote=outgoing_needs(edges, rank), external=remote_exporters(edges, rank))
    for j, e in enumerate(edges):
        if e.importer_rank != rank:
            continue
        want = reads_of(mbs[e.importer], needs.get(e.importer), e.exporter)
        for k in KINDS:
            if not np.array_equal(e.rows[k], want.rows[k]):
                _fail(f"{where}.cross_edges[{j}].{ROW_FIELDS[k]}", f"expected the {want.rows[k].shape[0]} rows of "
                      f"microbatch {e.exporter} that microbatch {e.importer} and its importers read, got {e.rows[k].shape[0]} "
                      f"rows ({_first_difference(e.rows[k], want.rows[k])})")
        if not np.array_equal(e.states, want.states):
            _fail(f"{where}.cross_edges[{j}].states", f"expected the states {want.states.tolist()[:8]} microbatch {e.importer} "
                  f"imports from {e.exporter}, got {e.states.tolist()[:8]}")


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    extra = np.setdiff1d(got, want)
    if extra.shape[0]:
        return f"row {int(extra[0])} is not read"
    return f"row {int(np.setdiff1d(want, got)[0])} is missing"
