"""What each sharing-window parent must export, per kind of tensor (DESIGN §5.5).

    needs = export_needs(arrays_by_id, forward_order)   # {exporter id: ExportNeeds}

A window child reads its imported (extended) rows through three consumers, each needing another
per-layer tensor of the exporter:
- softmax attention (rows inside the child's attention ranges): the K/V rows;
- the short conv (rows named in the child's conv_ancestors): the conv inputs;
- bounded replay (rows named in the child's replay_rows): the linear-attention kernel inputs
  q/k/v/g/beta;
plus the fp32 states of its state imports. A row the child re-exports to a grandchild needs, in
the child's exporter, whatever the grandchild needs of it. Rows that no consumer reads are not
exported at all: with a real model the conv inputs and kernel inputs are 8x the K/V bytes per
row, and only the last K-1 rows above a child's roots and its replay rows need them.

The trainer exports exactly these tensors; the planner's and the validator's memory accounting of
recomputed windows counts exactly these rows (one rule, one module). A window across ranks
(plan.proto CrossEdge, `plan.cross_edges`) sends exactly what `reads_of` lists for its importer,
and its exporter's needs include those reads (`export_needs(..., remote=...)`).

Legend: R local rows, I imported rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from plan.decode import MicrobatchArrays

#: kinds of exported per-layer tensors
ATTN, CONV, KERNEL = "attn", "conv", "kernel"
KINDS = (ATTN, CONV, KERNEL)


@dataclass(slots=True)
class ExportNeeds:
    """Extended rows of one exporter whose per-layer tensors later microbatches read."""

    rows: dict[str, np.ndarray] = field(default_factory=lambda: {k: np.zeros(0, np.int64) for k in KINDS})
    """kind -> int64 sorted unique extended rows (< R + I of the exporter)."""
    states: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64 sorted state ids of the exporter's table that later microbatches import."""

    def local_counts(self, num_rows: int) -> dict[str, int]:
        """kind -> number of the exporter's own rows (< num_rows) exported: imported rows it
        re-exports are kept live by the window that computed them."""
        return {k: int(np.searchsorted(r, num_rows)) for k, r in self.rows.items()}


def used_imports(mb: MicrobatchArrays, own: ExportNeeds | None) -> dict[str, np.ndarray]:
    """kind -> bool [I]: imported rows of mb that mb's consumers or its own importers read."""
    R, I = mb.num_rows, mb.num_imports
    used = {}
    cover = np.zeros(R + I + 1, np.int64)
    rg = mb.attn_ranges
    if rg.shape[0]:
        np.add.at(cover, rg[:, 0], 1)
        np.add.at(cover, rg[:, 1], -1)
    used[ATTN] = np.cumsum(cover)[R : R + I] > 0
    conv = mb.conv_ancestors.reshape(-1)
    used[CONV] = np.zeros(I, np.bool_)
    used[CONV][conv[conv >= R] - R] = True
    used[KERNEL] = np.zeros(I, np.bool_)
    for call in mb.linear_calls:
        rep = call.replay_rows
        used[KERNEL][rep[rep >= R] - R] = True
    if own is not None:
        for k in KINDS:
            r = own.rows[k]
            used[k][r[r >= R] - R] = True
    return used


def reads_of(mb: MicrobatchArrays, own: ExportNeeds | None, exporter: int,
             used: dict[str, np.ndarray] | None = None) -> ExportNeeds:
    """What importer `mb` and its own importers read of `exporter`: per kind, the exporter's
    extended rows among mb's imports that a consumer of that kind reads (`used_imports`), and the
    exporter's states mb imports (sorted, unique). The rows and states of a window across ranks
    (plan.proto CrossEdge) are exactly this.

    Args:
        own: what mb's own importers read of mb (its `export_needs` entry; None: nothing).
        used: `used_imports(mb, own)` when the caller has it already.
    """
    used = used_imports(mb, own) if used is None else used
    sel = mb.import_microbatch == exporter
    rows = {k: _union([mb.import_row[sel & used[k]].astype(np.int64)]) for k in KINDS}
    states = _union([mb.state_import_state[mb.state_import_microbatch == exporter].astype(np.int64)])
    return ExportNeeds(rows=rows, states=states)


def export_needs(mbs: dict[int, MicrobatchArrays], order: list[int], *,
                 remote: dict[int, list[ExportNeeds]] | None = None, external=()) -> dict[int, ExportNeeds]:
    """Per exporter, the rows and states its importers read (see the module docstring).

    Args:
        mbs: decoded microbatches of one rank, by id.
        order: their ids in forward order (an exporter before its importers).
        remote: exporter id -> what importers on other ranks read of it (their windows across
            ranks, `plan.cross_edges.outgoing_needs`); those reads count like a local importer's.
        external: ids of exporters on other ranks that microbatches of `mbs` import from (windows
            across ranks); their needs are not collected here.
    Returns:
        {exporter id: ExportNeeds} for every microbatch of `mbs` that something imports from.
    """
    needs: dict[int, ExportNeeds] = {}
    parts: dict[int, list[ExportNeeds]] = {e: list(v) for e, v in (remote or {}).items()}
    skip = set(external)
    for m in reversed(order):  # importers first: their needs are complete when they are visited
        mb = mbs[m]
        own = None
        if m in parts:
            own = needs[m] = _finish(parts.pop(m))
        exporters = sorted((set(_distinct(mb.import_microbatch)) | set(_distinct(mb.state_import_microbatch))) - skip)
        used = used_imports(mb, own) if exporters and mb.num_imports else None
        for e in exporters:
            parts.setdefault(e, []).append(reads_of(mb, own, e, used))
    if parts:
        raise ValueError(f"order: microbatches {sorted(parts)} are imported from but not in the forward order")
    return needs


def _distinct(a: np.ndarray) -> list[int]:
    """Sorted distinct values of `a` (np.unique), at one comparison per entry when they are all
    equal: a window child imports from its one parent."""
    if a.shape[0] == 0:
        return []
    first = int(a[0])
    return [first] if bool((a == first).all()) else np.unique(a).tolist()


def _union(xs: list[np.ndarray]) -> np.ndarray:
    """int64 sorted distinct values of the non-negative arrays `xs` (np.unique of their
    concatenation), in time linear in their sizes and largest value: every importer of a window
    chain lists the whole root path above it, so these lists are long and heavily repeated."""
    cat = np.concatenate(xs) if xs else np.zeros(0, np.int64)
    if cat.shape[0] == 0:
        return np.zeros(0, np.int64)
    seen = np.zeros(int(cat.max()) + 1, np.bool_)
    seen[cat] = True
    return np.flatnonzero(seen).astype(np.int64)


def _finish(parts: list[ExportNeeds]) -> ExportNeeds:
    return ExportNeeds(rows={k: _union([p.rows[k] for p in parts]) for k in KINDS},
                       states=_union([p.states for p in parts]))
