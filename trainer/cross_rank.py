"""Windows across ranks in the trainer (proto `CrossEdge`): what travels, and how.

    wire = EdgeWire.of(edge, layout)               # layout: export_layout(model.config, dtype)
    buf = wire.pack(tensors_by_name, device)       # uint8 [wire.nbytes]
    tensors = wire.unpack(buf)                     # name -> [n, ...] tensor
    transport.run(phase, [Transfer(...), ...])     # fills the receive buffers

`EdgeWire` is one edge's tensors as one buffer in the canonical layout, both ways; `P2PTransport`
moves a phase's buffers with batched point-to-point, every wait bounded (`CrossRankError`);
`LocalTransport` serves a whole plan in one process (docs/design/cross-rank.md).
Legend: n rows of one kind of the edge.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch

from plan.cross_edges import CrossEdgeArrays
from plan.phases import PHASE_NAMES
from plan.window_exports import ExportNeeds
from trainer.boundary import STATE, kind_of

__all__ = ["CrossRankError", "EdgeWire", "LocalTransport", "P2PTransport", "RankEdges", "Received", "Transfer"]


class CrossRankError(RuntimeError):
    """A window across ranks could not be exchanged (a peer died, hung or sent something else)."""


@dataclass(slots=True, frozen=True)
class EdgeWire:
    """The tensors of one edge, in order: (name, rows, per-row shape, dtype)."""

    entries: tuple[tuple[str, int, tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, edge: CrossEdgeArrays, layout: list[tuple[str, str, tuple[int, ...], torch.dtype]]) -> "EdgeWire":
        """The edge's tensors: every export of `layout` whose kind has rows (states) on the edge."""
        count = {k: int(v.shape[0]) for k, v in edge.rows.items()}
        count[STATE] = int(edge.states.shape[0])
        return cls(tuple((name, count[kind], shape, dtype) for name, kind, shape, dtype in layout if count[kind]))

    @property
    def nbytes(self) -> int:
        return sum(n * math.prod(shape) * dtype.itemsize for _, n, shape, dtype in self.entries)

    def pack(self, tensors: Mapping[str, torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """uint8 [nbytes] the tensors in wire order (a missing gradient, None, travels as zeros).

        Raises:
            CrossRankError: a tensor of another shape or dtype than the layout's (an internal error).
        """
        parts = []
        for name, n, shape, dtype in self.entries:
            t = tensors.get(name)
            if t is None:
                t = torch.zeros((n, *shape), dtype=dtype, device=device)
            elif tuple(t.shape) != (n, *shape) or t.dtype != dtype:
                raise CrossRankError(f"{name}: expected a {dtype} tensor of shape {[n, *shape]} to send, "
                                     f"got {t.dtype} {list(t.shape)}")
            parts.append(t.detach().contiguous().reshape(-1).view(torch.uint8))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)

    def unpack(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> tensor of the received uint8 buffer (fresh storage, aligned for its dtype)."""
        out, at = {}, 0
        for name, n, shape, dtype in self.entries:
            size = n * math.prod(shape) * dtype.itemsize
            out[name] = buf[at : at + size].clone().view(dtype).reshape(n, *shape)
            at += size
        return out


@dataclass(slots=True, kw_only=True)
class Transfer:
    """One side of one edge's exchange in a phase: a buffer sent to or received from `peer`."""

    edge: CrossEdgeArrays
    grad: bool
    """False: the exports (send_phase); True: their gradients (grad_phase)."""
    rank: int
    """This side's rank."""
    peer: int
    send: bool
    buf: torch.Tensor
    """uint8: the bytes to send, or the buffer to receive into."""

    @property
    def tag(self) -> int:
        """Point-to-point tag: the edge and the direction (gloo matches on it; NCCL keeps the order)."""
        return 2 * self.edge.id + int(self.grad)

    def describe(self, phase: int, phase_kind: int | None) -> str:
        what = "gradients" if self.grad else "exports"
        kind = f" ({PHASE_NAMES[phase_kind]})" if phase_kind is not None else ""
        verb = f"sending {what} to" if self.send else f"receiving {what} from"
        return (f"phase {phase}{kind}, cross edge {self.edge.id} (microbatch {self.edge.exporter} -> "
                f"{self.edge.importer}): rank {self.rank} {verb} rank {self.peer} ({self.buf.numel()} bytes)")


class LocalTransport:
    """Every rank of a whole plan in this process: each receive copies its matching send."""

    def run(self, phase: int, transfers: list[Transfer], phase_kind: int | None = None) -> None:
        sends = {(t.edge.id, t.grad): t for t in transfers if t.send}
        for t in transfers:
            if t.send:
                continue
            src = sends.pop((t.edge.id, t.grad), None)
            if src is None or src.buf.numel() != t.buf.numel():
                got = "nothing" if src is None else f"{src.buf.numel()} bytes"
                raise CrossRankError(f"{t.describe(phase, phase_kind)}: the peer sent {got}")
            t.buf.copy_(src.buf)
        if sends:
            t = next(iter(sends.values()))
            raise CrossRankError(f"{t.describe(phase, phase_kind)}: no rank receives it")


class P2PTransport:
    """Batched point-to-point over the default process group, every wait bounded by `timeout_s`."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
        self.timeout_s = timeout_s

    def run(self, phase: int, transfers: list[Transfer], phase_kind: int | None = None) -> None:
        """Post this rank's operations of `phase` together (increasing edge id), wait for all.

        Raises:
            CrossRankError: an operation failed (gloo: the peer's connection reset, it died) or
                did not complete within the timeout (the peer hangs, or runs another plan), naming
                the phase, the edge and the peer rank.
        """
        import torch.distributed as dist

        if not transfers:
            return
        transfers = sorted(transfers, key=lambda t: (t.edge.id, t.grad))
        ops = [dist.P2POp(dist.isend if t.send else dist.irecv, t.buf, t.peer, tag=t.tag) for t in transfers]
        t0 = time.monotonic()
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:  # gloo may already know that the peer's connection closed
            raise self._failure(transfers[0], phase, phase_kind, t0, exc) from None
        # one work per operation (gloo), or one for the whole batch (NCCL coalesces): an error names
        # the first transfer its work covers
        owners = transfers if len(works) == len(transfers) else [transfers[0]] * len(works)
        for work, t in zip(works, owners):
            # Work.wait(timeout) blocks at most that long on gloo and NCCL alike, and raises at once
            # when the peer's connection breaks (is_completed() would not see that)
            left = max(t0 + self.timeout_s - time.monotonic(), 1e-3)
            try:
                work.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                raise self._failure(t, phase, phase_kind, t0, exc) from None

    def _failure(self, t: Transfer, phase: int, phase_kind: int | None, t0: float, exc: RuntimeError) -> CrossRankError:
        """The one-line error of a transfer that failed or timed out `time.monotonic() - t0` s after
        its phase's operations were posted."""
        waited = time.monotonic() - t0
        cause = (f"not done after parallelism.p2p_timeout_s = {self.timeout_s:g} s" if waited >= 0.99 * self.timeout_s
                 else f"failed after {waited:.1f} s")
        return CrossRankError(f"{t.describe(phase, phase_kind)}: {cause} (is rank {t.peer} alive and running "
                              f"the same plan?): {str(exc).splitlines()[0][:300]}")


@dataclass(slots=True, kw_only=True)
class Received:
    """The exports a window across ranks brought to its importer on this rank."""

    exports: dict[str, torch.Tensor]
    """name -> the edge's rows (states) of the exporter's export, no graph."""
    export_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> gradient the importer's leaves accumulated, sent back at the edge's grad_phase."""


class RankEdges:
    """One rank's windows across ranks in a step: which transfers end which phase, and their effect.

    The exporter's side reads the open exporter's `exports` (its whole export table: what its
    local and remote importers read, `plan.window_exports.export_needs(sent=...)`) at the edge's
    rows and adds the received gradients to its `export_grads`; the importer's side keeps what it
    received as a `Received`, whose `export_grads` the executor's hand-back fills like an open
    window's.
    """

    def __init__(self, rank: int, edges: list[CrossEdgeArrays], needs: Mapping[int, ExportNeeds],
                 layout: list[tuple[str, str, tuple[int, ...], torch.dtype]], device: torch.device):
        """
        Args:
            rank: this rank.
            edges: its edges (`plan.cross_edges.decode_edges`, checked).
            needs: this rank's `export_needs`, the edges' exporters here included.
            layout: `trainer.boundary.export_layout` of the model.
        """
        self.rank, self.edges, self.device = rank, edges, device
        self.wire = {e.id: EdgeWire.of(e, layout) for e in edges}
        self.at: dict[int, list[tuple[CrossEdgeArrays, bool]]] = {}
        for e in edges:
            self.at.setdefault(e.send_phase, []).append((e, False))
            self.at.setdefault(e.grad_phase, []).append((e, True))
        # exporter side: positions of the edge's rows in the exporter's export table, per kind
        self.positions: dict[int, dict[str, torch.Tensor]] = {}
        for e in edges:
            if e.exporter_rank == rank:
                nd = needs[e.exporter]
                tables = {**nd.rows, STATE: nd.states}
                want = {**e.rows, STATE: e.states}
                self.positions[e.id] = {k: torch.from_numpy(np.searchsorted(tables[k], want[k])).to(device)
                                        for k in tables}
        self.received: dict[tuple[int, int], Received] = {}

    def into(self, importer: int) -> dict[int, ExportNeeds]:
        """Exporter id -> what the edges into `importer` carry (the layout's export tables of the
        remote exporters, as seen by this importer)."""
        return {e.exporter: e.needs for e in self.edges if e.importer == importer and e.importer_rank == self.rank}

    def sources(self, importer: int) -> dict[int, Received]:
        """Exporter id -> what arrived for `importer` from another rank."""
        return {e: r for (e, m), r in self.received.items() if m == importer}

    def transfers(self, phase: int, open_: Mapping[int, object], *, backward: bool) -> list[Transfer]:
        """This rank's transfers at the end of `phase` (sends packed now), in increasing edge id.

        Args:
            open_: exporter id -> its open window (`exports`, `export_grads`).
            backward: False (a forward-only step): no gradients travel.
        Raises:
            CrossRankError: an exporter that is not open, a received window missing (a plan whose
                ranks disagree).
        """
        out = []
        for e, grad in sorted(self.at.get(phase, []), key=lambda x: x[0].id):
            if grad and not backward:
                continue
            wire, exporting = self.wire[e.id], e.exporter_rank == self.rank
            send = exporting != grad
            if not send:
                buf = torch.empty(wire.nbytes, dtype=torch.uint8, device=self.device)
            elif exporting:
                w = open_.get(e.exporter)
                if w is None:
                    raise CrossRankError(f"phase {phase}: cross edge {e.id}: exporter {e.exporter} is not open on rank {self.rank}")
                pos = self.positions[e.id]
                buf = wire.pack({name: w.exports[name].detach().index_select(0, pos[kind_of(name)])
                                 for name, *_ in wire.entries}, self.device)
            else:
                got = self.received.pop((e.exporter, e.importer), None)
                if got is None:
                    raise CrossRankError(f"phase {phase}: cross edge {e.id}: nothing was received for importer {e.importer}")
                buf = wire.pack(got.export_grads, self.device)
            out.append(Transfer(edge=e, grad=grad, rank=self.rank, peer=e.peer(self.rank), send=send, buf=buf))
        return out

    def complete(self, transfers: list[Transfer], open_: Mapping[int, object]) -> None:
        """Use what `transfers` received: keep an edge's exports for its importer, or add its
        gradients to the exporter's (with its local importers')."""
        for t in transfers:
            if t.send:
                continue
            e, tensors = t.edge, self.wire[t.edge.id].unpack(t.buf)
            if not t.grad:
                self.received[e.exporter, e.importer] = Received(exports=tensors)
                continue
            w, pos = open_[e.exporter], self.positions[e.id]
            for name, g in tensors.items():
                acc = w.export_grads.get(name)
                if acc is None:
                    acc = w.export_grads[name] = torch.zeros_like(w.exports[name])
                acc.index_add_(0, pos[kind_of(name)], g)
