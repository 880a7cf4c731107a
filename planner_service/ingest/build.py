"""A checked `RawBatch` -> `Forest`: radix forests of the flat trees, explicit trees, and the
trajectory-space arrays.

Flat trees come first (in order of first appearance of their tree_id), then explicit trees in
submission order; trajectories keep submission order (flat ones, then each tree's). Scalar
advantages are broadcast to every position, a missing loss_mask means all ones, a missing weight 1.0;
per-node fields (the compact tree form) are gathered along each trajectory's root-to-node path
(docs/design/rollout-forest.md).

Legend: T trajectories, N_e expanded tokens, S segments.
"""
from __future__ import annotations

import numpy as np

from planner_service.forest import Forest
from planner_service.ingest.batch import Column, RawBatch
from planner_service.ingest.check import node_field_positions
from planner_service.ingest.explicit import explicit_forest
from planner_service.ingest.json_scan import FIELDS
from planner_service.ingest.limits import Limits
from planner_service.ingest.radix import RadixForest, radix_forest
from planner_service.ingest.radix_ref import radix_forest_reference


def _empty() -> RadixForest:
    z = np.zeros(0, np.int32)
    return RadixForest(tokens=z, seg_parent=z, seg_length=z, seg_depth=z, seg_tree=z, traj_seg=z)


def _scatter(out_Ne: np.ndarray, col: Column, traj_offset: np.ndarray) -> None:
    """Write each entry of `col` over its owner's positions in the trajectory-space array."""
    if not col.owners:
        return
    values = col.values.astype(out_Ne.dtype, copy=False)
    if len(col.owners) == traj_offset.shape[0] - 1:  # every trajectory has it: already in order
        out_Ne[:] = values
        return
    owners = np.asarray(col.owners, np.int64)
    lengths = np.diff(col.offsets)
    shift = np.repeat(traj_offset[owners] - col.offsets[:-1], lengths)
    out_Ne[shift + np.arange(values.shape[0])] = values


def _scatter_nodes(out_Ne: np.ndarray, raw: RawBatch, name: str, traj_offset: np.ndarray) -> None:
    """Write the per-node field `name` (compact trees) over the positions of the trajectories that use it."""
    col = raw.node_columns[name]
    if not col.owners:
        return
    trajs, positions = node_field_positions(raw, name)
    lengths = traj_offset[trajs + 1] - traj_offset[trajs]
    ends = np.cumsum(lengths)
    target = np.repeat(traj_offset[trajs] - (ends - lengths), lengths) + np.arange(positions.shape[0])
    out_Ne[target] = col.values[positions].astype(out_Ne.dtype, copy=False)


def build_forest(raw: RawBatch, *, numba: bool = True, limits: Limits | None = None) -> Forest:
    """Build the Forest of a batch that `check_batch` accepted.

    Side effect: `raw` gives up its token arrays once they are merged (so that the expanded tokens
    and the trajectory-space arrays are not in memory together); build a batch once.

    Args:
        numba: False builds the flat trees with the plain-Python reference (tests, benchmarks).
        limits: checks `max_unique_tokens` on the merged forest (LimitError), when given.
    """
    names: dict[str, int] = {}
    flat_tree = np.fromiter((names.setdefault(n, len(names)) for n in raw.flat_tree_name), np.int32, raw.n_flat)
    flat = _flat_forest(raw, flat_tree, len(names), numba)
    expl = _explicit_forest(raw)
    raw.columns["tokens"].values = None
    raw.node_tokens.values = None
    if raw.lists is not None:
        raw.lists.buffers = tuple(None if f == "tokens" else b for f, b in zip(FIELDS, raw.lists.buffers))
    if limits is not None:
        limits.check("max_unique_tokens", int(flat.tokens.shape[0] + expl.tokens.shape[0]), "distinct tokens")

    S_flat = flat.seg_parent.shape[0]
    seg_length = np.concatenate([flat.seg_length, expl.seg_length]).astype(np.int32)
    seg_offset = np.zeros(seg_length.shape[0], np.int64)
    np.cumsum(seg_length[:-1], out=seg_offset[1:])
    traj_len = raw.traj_len
    T = traj_len.shape[0]
    traj_offset = np.zeros(T + 1, np.int64)
    np.cumsum(traj_len, out=traj_offset[1:])
    loss_mask, advantages, logprobs = _trajectory_fields(raw, traj_offset)
    return Forest(
        batch_id=raw.batch_id,
        vocab_size=raw.vocab_size,
        policy_version=raw.policy_version,
        tokens=np.concatenate([flat.tokens, expl.tokens]).astype(np.int32),
        seg_parent=np.concatenate([flat.seg_parent, np.where(expl.seg_parent >= 0, expl.seg_parent + S_flat, -1)]).astype(np.int32),
        seg_offset=seg_offset,
        seg_length=seg_length,
        seg_depth=np.concatenate([flat.seg_depth, expl.seg_depth]).astype(np.int32),
        seg_tree=np.concatenate([flat.seg_tree, expl.seg_tree + len(names)]).astype(np.int32),
        tree_ids=list(names) + list(raw.tree_ids),
        traj_ids=list(raw.traj_ids),
        traj_seg=np.concatenate([flat.traj_seg, expl.traj_seg + S_flat]).astype(np.int32),
        traj_offset=traj_offset,
        loss_mask=loss_mask,
        advantages=advantages,
        old_logprobs=logprobs["old_logprobs"],
        ref_logprobs=logprobs["ref_logprobs"],
        reward=np.asarray(raw.reward, np.float32),
        weight=np.asarray([1.0 if w is None else w for w in raw.weight], np.float32),
        group_ids=list(raw.group_ids),
    )


def _flat_forest(raw: RawBatch, flat_tree: np.ndarray, n_trees: int, numba: bool) -> RadixForest:
    """Radix forest of the flat trees (`flat_tree`: int32 [T_flat] tree of each trajectory)."""
    if not raw.n_flat:
        return _empty()
    tokens_col = raw.columns["tokens"]
    tokens = tokens_col.values.astype(np.int32, copy=False)
    if numba:
        return radix_forest(tokens, tokens_col.offsets, flat_tree, n_trees)
    return radix_forest_reference(tokens, tokens_col.offsets, flat_tree, n_trees)


def _explicit_forest(raw: RawBatch) -> RadixForest:
    """Forest of the explicit trees (nodes with parents)."""
    if not raw.node_id:
        return _empty()
    return explicit_forest(
        node_tree_V=np.asarray(raw.node_tree, np.int64),
        node_id_V=np.asarray(raw.node_id, np.int64),
        parent_V=raw.node_parent_idx,
        tokens_N=raw.node_tokens.values.astype(np.int32, copy=False),
        offsets_V1=raw.node_tokens.offsets,
        n_trees=len(raw.tree_ids),
        traj_node=raw.traj_node_idx,
    )


def _trajectory_fields(raw: RawBatch, traj_offset: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray | None]]:
    """Trajectory-space arrays [N_e]: loss mask, advantages, and old/ref log-probs (None when absent)."""
    T, n_e = traj_offset.shape[0] - 1, int(traj_offset[-1])
    mask_col = raw.columns["loss_mask"]
    if len(mask_col.owners) == T and mask_col.values.dtype == np.uint8 and mask_col.values.flags.writeable:
        loss_mask = mask_col.values  # every trajectory has one, in order: the parsed array itself
    else:
        loss_mask = np.ones(n_e, np.uint8)
        _scatter(loss_mask, mask_col, traj_offset)
        _scatter_nodes(loss_mask, raw, "loss_mask", traj_offset)
    advantages = np.repeat(np.asarray(raw.adv_scalar, np.float32), raw.traj_len)
    _scatter(advantages, raw.columns["advantage"], traj_offset)
    logprobs = {}
    for name in ("old_logprobs", "ref_logprobs"):
        col = raw.columns[name]
        logprobs[name] = None
        if col.owners or raw.node_columns[name].owners:
            logprobs[name] = np.empty(n_e, np.float32)
            _scatter(logprobs[name], col, traj_offset)
            _scatter_nodes(logprobs[name], raw, name, traj_offset)
    return loss_mask, advantages, logprobs
