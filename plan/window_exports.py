"""What each sharing-window parent must export, per kind of tensor (docs/design/windows.md).

    needs = export_needs(arrays_by_id, forward_order)   # {exporter id: ExportNeeds}
    import_needs(child, needs.get(child.id))            # {exporter id: what this child reads of it}

A child reads imported rows through softmax attention (K/V: ATTN), the short conv (conv inputs:
CONV) and bounded replay (q/k/v/g/beta: KERNEL), plus fp32 states; rows no consumer reads are not
exported. The trainer exports exactly these, and the memory model counts exactly these; a window
across ranks carries what `import_needs` says (`sent` on the exporter's rank, `remote` on the
importer's). Legend: R local rows, I imported rows.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from plan.microbatch import MicrobatchArrays

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


def export_needs(mbs: dict[int, MicrobatchArrays], order: list[int], *,
                 sent: Mapping[int, list[ExportNeeds]] | None = None,
                 remote: Collection[tuple[int, int]] = ()) -> dict[int, ExportNeeds]:
    """Per exporter, the rows and states its importers read (docs/design/windows.md).

    Args:
        mbs: decoded microbatches of one rank, by id.
        order: their ids in forward order (an exporter before its importers).
        sent: windows across ranks whose exporter is here: exporter id -> what each of its
            importers on other ranks reads (`plan.cross_edges.sent_needs`); those reads count
            like a local importer's.
        remote: windows across ranks whose importer is here: (exporter id, importer id) pairs
            whose imports another rank's exporter provides (`plan.cross_edges.remote_imports`;
            left out here).
    Returns:
        {exporter id: ExportNeeds} for every microbatch of this rank that something imports from.
    """
    needs: dict[int, ExportNeeds] = {}
    parts: dict[int, dict[str, list[np.ndarray]]] = {}
    states: dict[int, list[np.ndarray]] = {}

    def add(e: int, nd: ExportNeeds) -> None:
        d = parts.setdefault(e, {k: [] for k in KINDS})
        for k in KINDS:
            d[k].append(nd.rows[k])
        states.setdefault(e, []).append(nd.states)

    for e, theirs in (sent or {}).items():
        for nd in theirs:
            add(e, nd)
    for m in reversed(order):  # importers first: their needs are complete when they are visited
        mb = mbs[m]
        own = None
        if m in parts:
            own = needs[m] = _finish(parts.pop(m), states.pop(m, []))
        for e, nd in _import_parts(mb, own):
            if (e, m) not in remote:
                add(e, nd)
    if parts:
        raise ValueError(f"order: microbatches {sorted(parts)} are imported from but not in the forward order")
    return needs


def import_needs(mb: MicrobatchArrays, own: ExportNeeds | None) -> dict[int, ExportNeeds]:
    """Per exporter of `mb`, what mb reads of it (mb's share of that exporter's `export_needs`;
    with `own` = mb's own needs, the rows it re-exports to its importers included): what a window
    across ranks from that exporter to mb carries (rows and states sorted and distinct)."""
    return {e: _finish({k: [nd.rows[k]] for k in KINDS}, [nd.states]) for e, nd in _import_parts(mb, own)}


def _import_parts(mb: MicrobatchArrays, own: ExportNeeds | None):
    """(exporter id, ExportNeeds of mb's reads from it) per exporter of mb (rows unsorted, possibly repeated)."""
    used = used_imports(mb, own) if mb.num_imports else None
    row_exporters = _distinct(mb.import_microbatch)
    state_exporters = _distinct(mb.state_import_microbatch)
    for e in sorted(set(row_exporters) | set(state_exporters)):
        nd = ExportNeeds()
        if used is not None and e in row_exporters:
            sel = mb.import_microbatch == e
            nd.rows = {k: mb.import_row[sel & used[k]].astype(np.int64) for k in KINDS}
        if e in state_exporters:
            nd.states = mb.state_import_state[mb.state_import_microbatch == e].astype(np.int64)
        yield e, nd


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


def _finish(parts: dict[str, list[np.ndarray]], states: list[np.ndarray]) -> ExportNeeds:
    return ExportNeeds(rows={k: _union(parts[k]) for k in KINDS}, states=_union(states))
