"""Explicit rollout trees: parent resolution, cycle detection and the segment layout.

Nodes of all explicit trees are handled together with global indices (n); tree k's virtual root
is the extra node k (real nodes are shifted by K) so that one `radix.preorder` call orders every
tree. Children are visited by (first token, node id). Nodes become segments as given (siblings
that start with the same token are not re-merged; docs/design/rollout-forest.md).

Legend: V nodes (all trees), K trees, N_n node tokens (concatenated), T_x explicit trajectories.
"""
from __future__ import annotations

import numpy as np

from planner_service.ingest.radix import RadixForest, preorder, segments_from_nodes


def resolve_ids(node_tree_V: np.ndarray, node_id_V: np.ndarray, tree_Q: np.ndarray, id_Q: np.ndarray) -> np.ndarray:
    """Global node index of each (tree, id) query, -1 where the tree has no such node.

    Args:
        node_tree_V: int64 [V] tree of each node.
        node_id_V: int64 [V] client node ids, unique within each tree.
        tree_Q, id_Q: int64 [Q] queries.
    """
    if node_id_V.shape[0] == 0:
        return np.full(id_Q.shape[0], -1, np.int64)
    uniq = np.unique(node_id_V)
    width = np.int64(uniq.shape[0])
    comp_V = node_tree_V * width + np.searchsorted(uniq, node_id_V)
    order = np.argsort(comp_V, kind="stable")
    comp_sorted = comp_V[order]
    r = np.minimum(np.searchsorted(uniq, id_Q), width - 1)
    comp_Q = tree_Q * width + r
    p = np.minimum(np.searchsorted(comp_sorted, comp_Q), comp_sorted.shape[0] - 1)
    found = (uniq[r] == id_Q) & (comp_sorted[p] == comp_Q)
    return np.where(found, order[p], -1).astype(np.int64)


def _shifted(node_tree_V: np.ndarray, parent_V: np.ndarray, n_trees: int) -> np.ndarray:
    """Parents in the shifted numbering: virtual roots 0..K-1 (parent -1), real node n at K + n."""
    real = np.where(parent_V >= 0, parent_V + n_trees, node_tree_V)
    return np.concatenate([np.full(n_trees, -1, np.int64), real.astype(np.int64)])


def path_depths(node_tree_V: np.ndarray, parent_V: np.ndarray, length_V: np.ndarray, n_trees: int) -> np.ndarray:
    """int64 [V] depth of each node's first token; -1 for nodes that no root reaches (on or below a cycle).

    Args:
        parent_V: int64 [V] parent node (global index), -1 for roots.
        length_V: int64 [V] tokens per node.
    """
    V = parent_V.shape[0]
    parents = _shifted(node_tree_V, parent_V, n_trees)
    lengths = np.concatenate([np.zeros(n_trees, np.int64), length_V.astype(np.int64)])
    _, depth = preorder(parents, lengths, np.zeros(V + n_trees, np.int64), np.arange(V + n_trees, dtype=np.int64),
                        np.arange(n_trees, dtype=np.int64))
    return depth[n_trees:]


def first_cycle(parent_V: np.ndarray, unreached: np.ndarray) -> list[int]:
    """The cycle (node indices, in parent order) that contains the smallest-index node on any cycle.

    Args:
        parent_V: int64 [V] parent node, -1 for roots.
        unreached: int64 [U] nodes that no root reaches; each has a parent, also unreached.
    """
    state: dict[int, int] = {}  # 1: on the current walk, 2: finished
    on_cycle: set[int] = set()
    for start in unreached.tolist():
        walk = []
        v = start
        while v not in state:
            state[v] = 1
            walk.append(v)
            v = int(parent_V[v])
        if state[v] == 1:  # closed a new cycle at v
            on_cycle.update(walk[walk.index(v):])
        for w in walk:
            state[w] = 2
    head = min(on_cycle)
    cycle = [head]
    v = int(parent_V[head])
    while v != head:
        cycle.append(v)
        v = int(parent_V[v])
    return cycle


def path_positions(parent_V: np.ndarray, start_V: np.ndarray, length_V: np.ndarray, traj_node: np.ndarray) -> np.ndarray:
    """int64 [sum of path lengths] where each position of each trajectory lies in node-token space:
    trajectory after trajectory, its root-to-node path's nodes in order (the compact tree form's
    per-node arrays, gathered with it, become trajectory-space arrays).

    Args:
        parent_V: int64 [V] parent node (global index), -1 for roots; acyclic.
        start_V, length_V: int64 [V] where each node's entries start in the per-node array, and how many.
        traj_node: int64 [X] last node of each trajectory.
    """
    cur = np.asarray(traj_node, np.int64)
    levels = []
    while cur.shape[0] and (cur >= 0).any():  # one pass per node level: O(X * longest path in nodes)
        levels.append(cur)
        cur = np.where(cur >= 0, parent_V[np.maximum(cur, 0)], -1)
    if not levels:
        return np.zeros(0, np.int64)
    path = np.stack(levels[::-1], 1)  # [X, levels]: -1 before each root, then root ... node
    nodes = path[path >= 0]
    lengths = length_V[nodes]
    ends = np.cumsum(lengths)
    return np.repeat(start_V[nodes] - (ends - lengths), lengths) + np.arange(int(ends[-1]) if ends.shape[0] else 0)


def used_nodes(parent_V: np.ndarray, traj_node: np.ndarray) -> np.ndarray:
    """bool [V]: the nodes on some trajectory's root-to-node path (linear: each node is walked once)."""
    used = np.zeros(parent_V.shape[0], np.bool_)
    for v in np.asarray(traj_node, np.int64).tolist():
        while v >= 0 and not used[v]:
            used[v] = True
            v = int(parent_V[v])
    return used


def _drop_unused(node_tree_V, node_id_V, parent_V, tokens_N, offsets_V1, traj_node):
    """The same explicit trees restricted to the nodes that some trajectory passes through."""
    used = used_nodes(parent_V, traj_node)
    if used.all():
        return node_tree_V, node_id_V, parent_V, tokens_N, offsets_V1, traj_node
    keep = np.flatnonzero(used)
    new_index = np.full(parent_V.shape[0], -1, np.int64)
    new_index[keep] = np.arange(keep.shape[0])
    parents = parent_V[keep]
    parents = np.where(parents >= 0, new_index[np.maximum(parents, 0)], -1)
    lengths = np.diff(offsets_V1)[keep]
    offsets = np.zeros(keep.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    token_index = np.repeat(offsets_V1[:-1][keep] - offsets[:-1], lengths) + np.arange(offsets[-1])
    return (node_tree_V[keep], node_id_V[keep], parents, tokens_N[token_index], offsets,
            new_index[np.asarray(traj_node, np.int64)])


def explicit_forest(*, node_tree_V: np.ndarray, node_id_V: np.ndarray, parent_V: np.ndarray, tokens_N: np.ndarray,
                    offsets_V1: np.ndarray, n_trees: int, traj_node: np.ndarray) -> RadixForest:
    """Segments of validated explicit trees in depth-first preorder (trees in index order).

    Args:
        node_tree_V, node_id_V, parent_V: int64 [V] tree, client id and parent (global index, -1 root).
        tokens_N: int32 [N_n] node tokens, node after node; offsets_V1: int64 [V+1] their bounds.
        traj_node: int64 [T_x] last node of each explicit trajectory.
    """
    node_tree_V, node_id_V, parent_V, tokens_N, offsets_V1, traj_node = _drop_unused(
        node_tree_V, node_id_V, parent_V, tokens_N, offsets_V1, traj_node)
    V = parent_V.shape[0]
    K = n_trees
    starts = offsets_V1[:-1].astype(np.int64)
    lengths = np.diff(offsets_V1).astype(np.int64)
    parents = _shifted(node_tree_V, parent_V, K)
    node_len = np.concatenate([np.zeros(K, np.int64), lengths])
    first = np.concatenate([np.zeros(K, np.int64), tokens_N[starts].astype(np.int64) if V else np.zeros(0, np.int64)])
    tie = np.concatenate([np.arange(K, dtype=np.int64), node_id_V.astype(np.int64)])
    order, depth = preorder(parents, node_len, first, tie, np.arange(K, dtype=np.int64))
    return segments_from_nodes(
        src_tokens=np.ascontiguousarray(tokens_N, np.int32),
        node_start=np.concatenate([np.zeros(K, np.int64), starts]),
        node_len=node_len,
        node_parent=parents,
        node_tree=np.concatenate([np.arange(K, dtype=np.int64), node_tree_V.astype(np.int64)]),
        order=order,
        depth=depth,
        n_virtual=K,
        traj_node=np.asarray(traj_node, np.int64) + K,
    )
