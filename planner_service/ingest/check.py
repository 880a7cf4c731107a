"""Vectorised validation of a parsed batch, shared by the JSON and protobuf paths.

    raw = check_batch(raw, limits)     # arrays decoded and checked; ValidationError / LimitError

The one place that checks tree and node ids for uniqueness (the parsers only record them). Each
per-position column is decoded with one numpy conversion over all its entries and checked on the
concatenated arrays; only the error path drops to per-element Python, to describe the offending
value. The first problem in document order is raised (docs/design/rollout-forest.md).
"""
from __future__ import annotations

import itertools

import numpy as np

from planner_service.ingest.batch import Column, FirstError, ListRef, RawBatch, describe
from planner_service.ingest.explicit import first_cycle, path_depths, path_positions, resolve_ids
from planner_service.ingest.json_scan import ScannedJSON
from planner_service.ingest.limits import Limits

_KINDS = {"token": "iu", "mask": "iu", "float": "iuf"}
_PROTO_DTYPE = {"token": np.dtype("<i4"), "mask": np.dtype("u1"), "float": np.dtype("<f4")}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_EXPECT = {"token": "integer token ids", "mask": "0/1 values", "float": "numbers"}


def _element_ok(value, kind: str) -> bool:
    if isinstance(value, bool):  # JSON true/false are not numbers (nor 0/1 mask values)
        return False
    if kind == "float":
        return isinstance(value, float) or (isinstance(value, int) and _INT64_MIN <= value <= _INT64_MAX)
    return isinstance(value, int) and _INT64_MIN <= value <= _INT64_MAX


def _decode(col: Column, raw: RawBatch) -> tuple[int, str] | None:
    """Fill col.values / col.offsets; on a type problem return (entry, message) instead."""
    n = len(col.raw)
    if raw.source == "proto":
        dtype = _PROTO_DTYPE[col.kind]
        lengths = np.fromiter((len(b) for b in col.raw), np.int64, n) // dtype.itemsize
        col.values = np.frombuffer(b"".join(col.raw), dtype=dtype)
    else:
        lengths = np.fromiter((len(v) for v in col.raw), np.int64, n)
        col.values = _json_values(col, raw.lists)
    col.offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=col.offsets[1:])
    if col.values is not None:
        return None
    for e, entry in enumerate(col.raw):
        if isinstance(entry, ListRef):
            continue  # the scan parsed it: every element fits the field's type
        for i, value in enumerate(entry):
            if not _element_ok(value, col.kind):
                return e, f"expected {_EXPECT[col.kind]}, got {describe(value)} at position {i}"
    raise AssertionError("a column failed to convert but every element is valid")


def _json_values(col: Column, lists: ScannedJSON | None) -> np.ndarray | None:
    """All entries as one 1-D numeric array, or None when some element has the wrong type.

    Entries the JSON scan parsed are views of its buffers (no copy when they are consecutive in
    one buffer, as the lists of one field in document order are); raw lists are converted together.
    """
    refs = [e for e, v in enumerate(col.raw) if isinstance(v, ListRef)]
    if not refs or len(refs) < len(col.raw):
        lists_part = _list_values(col, [v for v in col.raw if not isinstance(v, ListRef)])
        if lists_part is None or not refs:
            return lists_part
    ks = np.fromiter((col.raw[e].k for e in refs), np.int64, len(refs))
    field = lists.ref_field[ks]
    start, length = lists.ref_offset[ks], lists.ref_length[ks]
    buffer = lists.buffers[int(field[0])]
    if len(refs) == len(col.raw):
        if (field == field[0]).all() and (start[1:] == start[:-1] + length[:-1]).all():
            return buffer[int(start[0]) : int(start[-1] + length[-1])]
        return np.concatenate([lists.values(int(k)) for k in ks])
    out = np.empty(int(sum(len(v) for v in col.raw)), np.result_type(lists_part.dtype, buffer.dtype))
    pos = a = 0
    is_ref = iter(refs)
    nxt = next(is_ref, -1)
    j = 0
    for e, entry in enumerate(col.raw):
        n = len(entry)
        if e == nxt:
            out[pos : pos + n] = lists.values(int(ks[j]))
            j += 1
            nxt = next(is_ref, -1)
        else:
            out[pos : pos + n] = lists_part[a : a + n]
            a += n
        pos += n
    return out


def _list_values(col: Column, entries: list) -> np.ndarray | None:
    flat = list(itertools.chain.from_iterable(entries))
    if not flat:
        return np.zeros(0, np.int64 if col.kind != "float" else np.float64)
    try:
        arr = np.asarray(flat)
    except (ValueError, TypeError, OverflowError):
        return None
    if arr.ndim != 1 or arr.dtype.kind not in _KINDS[col.kind]:
        return None
    if col.kind == "token" and arr.dtype.kind == "u" and arr.dtype.itemsize == 8:
        return None  # ids >= 2**63: reported per element as out of the int64 range
    if bool in set(map(type, flat)):  # numpy turns [true, 1] into [1, 1]
        return None
    return arr


def _first_bad(bad: np.ndarray) -> int:
    return int(np.argmax(bad)) if bad.any() else -1


class _Checker:
    def __init__(self, raw: RawBatch, limits: Limits):
        self.raw = raw
        self.limits = limits
        self.errors = FirstError()
        if raw.stop is not None:
            self.errors.offer(raw.stop.key, raw.stop.field, raw.stop.message)

    def owner(self, col: Column, e: int, nodes: bool) -> tuple[tuple, str]:
        owner = col.owners[e]
        if nodes:
            return self.raw.node_key(owner) + (col.rank,), f"{self.raw.node_path(owner)}.{col.name}"
        return self.raw.traj_key(owner) + (col.rank,), f"{self.raw.traj_path(owner)}.{col.name}"

    def column(self, col: Column, *, nodes: bool = False) -> None:
        problem = _decode(col, self.raw)
        if problem is not None:
            key, field = self.owner(col, problem[0], nodes)
            self.errors.offer(key + (1,), field, problem[1])
            return
        values = col.values
        if not values.shape[0]:
            return
        # the min/max tests allocate nothing: the per-element mask is built only for a bad column
        if col.kind == "token":
            if int(values.min()) >= 0 and int(values.max()) < self.raw.vocab_size:
                return
            bad = (values < 0) | (values >= self.raw.vocab_size)
            expect = f"token ids in [0, {self.raw.vocab_size})"
        elif col.kind == "mask":
            if int(values.min()) >= 0 and int(values.max()) <= 1:
                return
            bad = (values != 0) & (values != 1)
            expect = "loss-mask values 0 or 1"
        else:
            if values.dtype == np.float32 and all(isinstance(v, ListRef) for v in col.raw):
                return  # the scan keeps only finite float32 lists
            with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is what we detect
                f32 = values.astype(np.float32, copy=False)
                if np.isfinite(f32.min()) and np.isfinite(f32.max()):
                    return
            bad = ~np.isfinite(f32)
            expect = "finite float32 values"
        i = _first_bad(bad)
        if i >= 0:
            e = int(np.searchsorted(col.offsets, i, side="right")) - 1
            key, field = self.owner(col, e, nodes)
            got = values[i].item()
            self.errors.offer(key + (2,), field, f"expected {expect}, got {got!r} at position {i - int(col.offsets[e])}")

    def ids(self) -> int:
        """Tree ids: unique, and none also a flat trajectory's tree_id; node ids unique in their
        tree. Returns the first tree with a bad id (len(tree_ids) when none): the structure checks
        stop before it, since parents and trajectory nodes cannot be resolved by an ambiguous id."""
        raw = self.raw
        bad_tree = len(raw.tree_ids)
        first_tree: dict[str, int] = {}
        flat_names: dict[str, int] = {}
        for j, name in enumerate(raw.flat_tree_name):
            flat_names.setdefault(name, j)
        for k, tid in enumerate(raw.tree_ids):
            if tid in first_tree:
                why = f"expected a unique tree id, got {tid!r} again (first at trees[{first_tree[tid]}])"
            elif tid in flat_names:
                why = (f"expected a tree id distinct from the flat trajectories' tree_ids, got {tid!r} "
                       f"(trajectories[{flat_names[tid]}].tree_id)")
            else:
                first_tree[tid] = k
                continue
            self.errors.offer((3, k, 0), f"trees[{k}].id", why)
            bad_tree = k
            break
        if raw.node_id:
            node_tree = np.asarray(raw.node_tree, np.int64)
            node_id = np.asarray(raw.node_id, np.int64)
            order = np.lexsort((node_id, node_tree))  # stable: a repeat sorts after its first occurrence
            same = (node_tree[order[1:]] == node_tree[order[:-1]]) & (node_id[order[1:]] == node_id[order[:-1]])
            if same.any():
                n = int(order[1:][same].min())  # nodes are in document order: the first repeat
                first = int(np.flatnonzero((node_tree == node_tree[n]) & (node_id == node_id[n]))[0])
                self.errors.offer(raw.node_key(n) + (0,), f"{raw.node_path(n)}.id",
                                  f"expected a node id unique in its tree, got {raw.node_id[n]} again "
                                  f"(first at nodes[{raw.node_index[first]}])")
                bad_tree = min(bad_tree, raw.node_tree[n])
        return bad_tree

    def trees(self) -> None:
        """Parents, cycles, trajectory nodes and path lengths of the completely parsed trees."""
        node_tree, node_id, depth, lengths = self.tree_nodes()
        self.tree_trajectories(node_tree, node_id, depth, lengths)

    def tree_nodes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Resolve parents, find unknown parents and cycles; returns node tree, id, depth, length [V]."""
        raw = self.raw
        K = raw.trees_complete
        V = int(np.searchsorted(np.asarray(raw.node_tree, np.int64), K)) if raw.node_tree else 0
        node_tree = np.asarray(raw.node_tree[:V], np.int64)
        node_id = np.asarray(raw.node_id[:V], np.int64)
        parent_ids = raw.node_parent[:V]
        has_parent = np.fromiter((p is not None for p in parent_ids), bool, V)
        pid = np.fromiter((0 if p is None else p for p in parent_ids), np.int64, V)
        parent = np.full(V, -1, np.int64)
        q = np.flatnonzero(has_parent)
        parent[q] = resolve_ids(node_tree, node_id, node_tree[q], pid[q])
        unknown = q[parent[q] < 0]
        if unknown.size:
            n = int(unknown[0])
            self.errors.offer(raw.node_key(n) + (1,), f"{raw.node_path(n)}.parent",
                              f"expected the id of a node of trees[{raw.node_tree[n]}], got {int(pid[n])}")
        lengths = np.diff(raw.node_tokens.offsets)[:V]
        depth = path_depths(node_tree, parent, lengths, K)
        unreached = np.flatnonzero(depth < 0)
        if unreached.size:
            cycle = first_cycle(parent, unreached)
            n = cycle[0]
            ids = " -> ".join(str(raw.node_id[m]) for m in cycle + [n])
            self.errors.offer(raw.node_key(n) + (1,), f"{raw.node_path(n)}.parent",
                              f"expected a parent chain that ends at a root, got a cycle: {ids}")
        raw.node_parent_idx = parent
        return node_tree, node_id, depth, lengths

    def tree_trajectories(self, node_tree: np.ndarray, node_id: np.ndarray, depth: np.ndarray,
                          lengths: np.ndarray) -> None:
        """Resolve explicit trajectories' nodes; check path-length limits and per-position lengths."""
        raw = self.raw
        V = node_id.shape[0]
        n_flat = sum(1 for k in raw.traj_tree if k < 0)
        X = len(raw.traj_node_id)
        tree_x = np.asarray(raw.traj_tree[n_flat:n_flat + X], np.int64)
        node_x = resolve_ids(node_tree, node_id, tree_x, np.asarray(raw.traj_node_id, np.int64))
        missing = np.flatnonzero(node_x < 0)
        if missing.size:
            g = n_flat + int(missing[0])
            self.errors.offer(raw.traj_key(g) + (2,), f"{raw.traj_path(g)}.node",
                              f"expected the id of a node of trees[{raw.traj_tree[g]}], got {raw.traj_node_id[g - n_flat]}")
        raw.traj_node_idx = node_x
        safe = np.maximum(node_x, 0)
        path_len = np.full(X, -1, np.int64)
        if V:
            ok = (node_x >= 0) & (depth[safe] >= 0)
            path_len[ok] = depth[safe[ok]] + lengths[safe[ok]]
        flat_len = np.diff(raw.columns["tokens"].offsets)
        if X and (path_len >= 0).any():
            longest = int(np.argmax(path_len))
            self.limits.check("max_trajectory_length", int(path_len[longest]), "tokens in one trajectory path",
                              f"{raw.traj_path(n_flat + longest)}.node")
            total = int(flat_len.sum()) + np.cumsum(np.maximum(path_len, 0))
            over = int(np.searchsorted(total, self.limits.max_tokens, side="right"))
            if over < X:
                self.limits.check("max_tokens", int(total[-1]), "expanded tokens", f"{raw.traj_path(n_flat + over)}.node")
        raw.traj_len = np.concatenate([flat_len, path_len]).astype(np.int64)

        for col in raw.columns.values():
            if col.name == "tokens":
                continue
            owners = np.asarray(col.owners, np.int64)
            sel = np.flatnonzero(owners >= n_flat)
            if not sel.size:
                continue
            want = raw.traj_len[owners[sel]]
            have = np.diff(col.offsets)[sel]
            bad = sel[(want >= 0) & (want != have)]
            if bad.size:
                e = int(bad[0])
                key, field = self.owner(col, e, False)
                self.errors.offer(key + (0,), field,
                                  f"expected {int(raw.traj_len[col.owners[e]])} values (one per token of the "
                                  f"root-to-node path), got {int(have[np.searchsorted(sel, e)])}")


def node_field_positions(raw: RawBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(trajectories, positions) of the per-node field `name` of a checked batch: the global indices
    of the explicit trajectories whose trees carry it on their nodes, and, trajectory after
    trajectory, the index of each of their positions in `raw.node_columns[name].values`."""
    col = raw.node_columns[name]
    carried = np.fromiter((name in f for f in raw.tree_node_fields), np.bool_, len(raw.tree_node_fields))
    x_tree = np.asarray(raw.traj_tree[raw.n_flat:], np.int64)
    sel = np.flatnonzero(carried[x_tree]) if x_tree.shape[0] and carried.any() else np.zeros(0, np.int64)
    if not sel.size:
        return sel, np.zeros(0, np.int64)
    V = len(raw.node_id)
    start = np.zeros(V, np.int64)
    start[np.asarray(col.owners, np.int64)] = col.offsets[:-1]
    length = np.diff(raw.node_tokens.offsets)
    return raw.n_flat + sel, path_positions(raw.node_parent_idx, start, length, raw.traj_node_idx[sel])


def check_batch(raw: RawBatch, limits: Limits) -> RawBatch:
    """Validate `raw` in place (materialising its columns) or raise the first `ValidationError`."""
    checker = _Checker(raw, limits)
    for col in raw.columns.values():
        checker.column(col)
    checker.column(raw.node_tokens, nodes=True)
    for col in raw.node_columns.values():
        checker.column(col, nodes=True)
    raw.trees_complete = min(raw.trees_complete, checker.ids())
    if raw.trees_complete:
        checker.trees()
    else:
        raw.traj_len = np.diff(raw.columns["tokens"].offsets)
    checker.errors.raise_first()
    raw.n_flat = len(raw.flat_tree_name)
    mask = raw.columns["loss_mask"]
    without = np.ones(raw.traj_len.shape[0], np.bool_)
    without[np.asarray(mask.owners, np.int64)] = False
    loss = int(mask.values.sum(dtype=np.int64)) if mask.owners else 0
    if raw.node_columns["loss_mask"].owners:
        trajs, positions = node_field_positions(raw, "loss_mask")
        without[trajs] = False
        loss += int(raw.node_columns["loss_mask"].values[positions].sum(dtype=np.int64))
    loss += int(raw.traj_len[without].sum())
    limits.check("max_loss_tokens", loss, "loss positions (loss_mask 1, or every position without a loss_mask)")
    return raw
