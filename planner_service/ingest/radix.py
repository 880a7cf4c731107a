"""Prefix forests from flat trajectories and explicit trees: the Numba fast path.

    rf = radix_forest(tokens_N, offsets_T1, traj_tree_T, n_trees)   # RadixForest: segments in preorder

A radix tree (compressed trie) per tree, children in one open-addressing hash table keyed by
(node, first token): linear in the expanded tokens. `preorder` numbers the nodes depth-first with
children by (first token, tie id), so the forest does not depend on the order of insertion;
`radix_ref.py` is the plain-Python oracle (docs/design/rollout-forest.md, "How a forest is built").
Legend: N expanded tokens (concatenated trajectories), T trajectories, F trees, V radix nodes
(F virtual roots first, then real nodes), S segments (real nodes in preorder), N_u distinct tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

_HASH_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (Fibonacci hashing)


@dataclass(slots=True, kw_only=True)
class RadixForest:
    """Segments of a prefix forest in depth-first preorder (the `Forest` segment arrays)."""

    tokens: np.ndarray
    """int32 [N_u] segment tokens, segment after segment."""
    seg_parent: np.ndarray
    """int32 [S] parent segment, -1 for a root."""
    seg_length: np.ndarray
    """int32 [S] tokens per segment, >= 1."""
    seg_depth: np.ndarray
    """int32 [S] depth of the segment's first token."""
    seg_tree: np.ndarray
    """int32 [S] tree index."""
    traj_seg: np.ndarray
    """int32 [T] segment where each trajectory ends."""


@njit(cache=True)
def _slot(keys, key, mask):
    h = key * _HASH_MUL
    h ^= h >> 29
    i = h & mask
    while keys[i] != -1 and keys[i] != key:
        i = (i + 1) & mask
    return i


@njit(cache=True)
def _insert_all(tokens_N, offsets_T1, traj_tree_T, n_trees):
    """Insert every trajectory into the radix forest of its tree.

    Returns (node_start_V, node_len_V, node_parent_V, traj_node_T, V): node v's tokens are
    tokens_N[node_start_V[v] : +node_len_V[v]]; nodes 0..n_trees-1 are empty virtual roots.
    """
    T = offsets_T1.shape[0] - 1
    cap_nodes = n_trees + 2 * T
    node_start = np.zeros(cap_nodes, np.int64)
    node_len = np.zeros(cap_nodes, np.int64)
    node_parent = np.full(cap_nodes, -1, np.int64)
    traj_node = np.empty(T, np.int64)
    cap = 16
    while cap < 2 * cap_nodes:
        cap *= 2
    mask = cap - 1
    keys = np.full(cap, -1, np.int64)
    vals = np.empty(cap, np.int64)
    n = n_trees
    for t in range(T):
        pos = offsets_T1[t]
        end = offsets_T1[t + 1]
        cur = np.int64(traj_tree_T[t])
        while True:
            if pos == end:
                traj_node[t] = cur
                break
            key = (cur << 32) | np.int64(tokens_N[pos])
            i = _slot(keys, key, mask)
            if keys[i] == -1:
                keys[i] = key
                vals[i] = n
                node_start[n] = pos
                node_len[n] = end - pos
                node_parent[n] = cur
                traj_node[t] = n
                n += 1
                break
            child = vals[i]
            cs = node_start[child]
            cl = node_len[child]
            m = min(cl, end - pos)
            k = 1
            while k < m and tokens_N[cs + k] == tokens_N[pos + k]:
                k += 1
            if k < cl:
                # Split `child` at k: a new upper node takes the shared head; `child` keeps the tail
                # (and so its own children's keys stay valid).
                u = n
                n += 1
                node_start[u] = cs
                node_len[u] = k
                node_parent[u] = cur
                vals[i] = u
                node_start[child] = cs + k
                node_len[child] = cl - k
                node_parent[child] = u
                j = _slot(keys, (np.int64(u) << 32) | np.int64(tokens_N[cs + k]), mask)
                keys[j] = (np.int64(u) << 32) | np.int64(tokens_N[cs + k])
                vals[j] = child
                child = u
            cur = child
            pos += k
    return node_start[:n], node_len[:n], node_parent[:n], traj_node, n


@njit(cache=True)
def _dfs(child_ptr, child_idx, roots, node_len, n_nodes):
    """Depth-first preorder from `roots` over CSR children (already in visiting order).

    Returns (order, depth): order lists the visited nodes (roots included), depth[v] is the depth
    of v's first token (-1 for nodes never reached, i.e. below a cycle).
    """
    order = np.empty(n_nodes, np.int64)
    depth = np.full(n_nodes, -1, np.int64)
    stack = np.empty(n_nodes, np.int64)
    top = 0
    for r in range(roots.shape[0] - 1, -1, -1):
        stack[top] = roots[r]
        depth[roots[r]] = 0
        top += 1
    k = 0
    while top > 0:
        top -= 1
        v = stack[top]
        order[k] = v
        k += 1
        d = depth[v] + node_len[v]
        for c in range(child_ptr[v + 1] - 1, child_ptr[v] - 1, -1):
            w = child_idx[c]
            depth[w] = d
            stack[top] = w
            top += 1
    return order[:k], depth


@njit(cache=True)
def _gather(src_N, starts_S, lengths_S, total):
    out = np.empty(total, np.int32)
    k = 0
    for s in range(starts_S.shape[0]):
        a = starts_S[s]
        for i in range(lengths_S[s]):
            out[k] = src_N[a + i]
            k += 1
    return out


def preorder(parent_V: np.ndarray, node_len_V: np.ndarray, first_tok_V: np.ndarray, tie_V: np.ndarray,
             roots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth-first preorder of a forest given by parent pointers.

    Children are visited by (first token, tie) ascending.

    Args:
        parent_V: int64 [V] parent node, -1 for roots (which are listed in `roots`).
        node_len_V: int64 [V] tokens per node (0 for virtual roots).
        first_tok_V: int64 [V] first token of each node (any value for roots).
        tie_V: int64 [V] secondary sort key among siblings with the same first token.
        roots: int64 [R] root nodes, in visiting order.

    Returns:
        (order, depth): int64 [visited] preorder, int64 [V] first-token depth (-1 where unreached).
    """
    V = parent_V.shape[0]
    has_parent = np.flatnonzero(parent_V >= 0)
    kids = has_parent[np.lexsort((tie_V[has_parent], first_tok_V[has_parent], parent_V[has_parent]))]
    child_ptr = np.zeros(V + 1, np.int64)
    np.cumsum(np.bincount(parent_V[has_parent], minlength=V), out=child_ptr[1:])
    return _dfs(child_ptr, kids.astype(np.int64), roots.astype(np.int64), node_len_V.astype(np.int64), V)


def segments_from_nodes(*, src_tokens: np.ndarray, node_start: np.ndarray, node_len: np.ndarray,
                        node_parent: np.ndarray, node_tree: np.ndarray, order: np.ndarray,
                        depth: np.ndarray, n_virtual: int, traj_node: np.ndarray) -> RadixForest:
    """Number the real nodes of `order` as segments and lay their tokens out contiguously.

    Nodes 0..n_virtual-1 are virtual roots (dropped; their children become roots).
    """
    seg_nodes = order[order >= n_virtual]
    V = node_parent.shape[0]
    seg_of = np.full(V, -1, np.int64)
    seg_of[seg_nodes] = np.arange(seg_nodes.shape[0])
    parents = node_parent[seg_nodes]
    seg_parent = np.where(parents >= n_virtual, seg_of[np.maximum(parents, 0)], -1)
    lengths = node_len[seg_nodes]
    total = int(lengths.sum())
    return RadixForest(
        tokens=_gather(src_tokens, node_start[seg_nodes].astype(np.int64), lengths.astype(np.int64), total),
        seg_parent=seg_parent.astype(np.int32),
        seg_length=lengths.astype(np.int32),
        seg_depth=depth[seg_nodes].astype(np.int32),
        seg_tree=node_tree[seg_nodes].astype(np.int32),
        traj_seg=seg_of[traj_node].astype(np.int32),
    )


def radix_forest(tokens_N: np.ndarray, offsets_T1: np.ndarray, traj_tree_T: np.ndarray, n_trees: int) -> RadixForest:
    """Radix forest of flat trajectories, merged on equal prefixes within each tree.

    Args:
        tokens_N: int32 [N] concatenated trajectory tokens.
        offsets_T1: int64 [T+1] trajectory t is tokens_N[offsets_T1[t] : offsets_T1[t+1]], length >= 1.
        traj_tree_T: int32 [T] tree of each trajectory, in [0, n_trees); trees are emitted in index order.
        n_trees: F.
    """
    tokens_N = np.ascontiguousarray(tokens_N, np.int32)
    start, length, parent, traj_node, V = _insert_all(
        tokens_N, np.ascontiguousarray(offsets_T1, np.int64), np.ascontiguousarray(traj_tree_T, np.int32), n_trees
    )
    # A node's tokens are a range of the trajectory that created it, so that trajectory's tree is the node's.
    node_tree = np.empty(V, np.int64)
    node_tree[:n_trees] = np.arange(n_trees)
    owner = np.searchsorted(offsets_T1, start[n_trees:], side="right") - 1
    node_tree[n_trees:] = np.asarray(traj_tree_T, np.int64)[owner]
    first = np.zeros(V, np.int64)
    first[n_trees:] = tokens_N[start[n_trees:]]
    order, depth = preorder(parent, length, first, np.arange(V, dtype=np.int64), np.arange(n_trees, dtype=np.int64))
    return segments_from_nodes(src_tokens=tokens_N, node_start=start, node_len=length, node_parent=parent,
                               node_tree=node_tree, order=order, depth=depth, n_virtual=n_trees, traj_node=traj_node)


def warmup() -> None:
    """Compile (or load from the on-disk cache) every Numba function on a tiny input."""
    radix_forest(np.array([1, 2, 1, 3], np.int32), np.array([0, 2, 4], np.int64), np.zeros(2, np.int32), 1)
