"""Plain-Python oracle for `radix.py`: a per-token dict trie, compressed into segments.

Slow (a Python step per token) and obviously correct; tests compare it with the Numba path on
seeded random inputs. Same contract and output as `radix.radix_forest` and `explicit_forest`
(docs/design/rollout-forest.md).
"""
from __future__ import annotations

import numpy as np

from planner_service.ingest.radix import RadixForest


class _Node:
    __slots__ = ("children", "ends")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.ends: list[int] = []


def radix_forest_reference(tokens_N: np.ndarray, offsets_T1: np.ndarray, traj_tree_T: np.ndarray,
                           n_trees: int) -> RadixForest:
    """Same as `radix.radix_forest`, by a per-token trie walked depth-first."""
    roots = [_Node() for _ in range(n_trees)]
    for t in range(len(offsets_T1) - 1):
        node = roots[int(traj_tree_T[t])]
        for tok in tokens_N[offsets_T1[t] : offsets_T1[t + 1]].tolist():
            node = node.children.setdefault(tok, _Node())
        node.ends.append(t)

    tokens: list[int] = []
    seg_parent: list[int] = []
    seg_length: list[int] = []
    seg_depth: list[int] = []
    seg_tree: list[int] = []
    traj_seg = [-1] * (len(offsets_T1) - 1)

    # Depth-first with an explicit stack; a segment runs down single-child chains until a branch,
    # a leaf or a trajectory end.
    stack = [(tok, roots[tree].children[tok], -1, 0, tree)
             for tree in range(n_trees - 1, -1, -1) for tok in sorted(roots[tree].children, reverse=True)]
    while stack:
        first_tok, node, parent, depth, tree = stack.pop()
        seg = len(seg_parent)
        run = [first_tok]
        while len(node.children) == 1 and not node.ends:
            (tok, node), = node.children.items()
            run.append(tok)
        tokens.extend(run)
        seg_parent.append(parent)
        seg_length.append(len(run))
        seg_depth.append(depth)
        seg_tree.append(tree)
        for t in node.ends:
            traj_seg[t] = seg
        for tok in sorted(node.children, reverse=True):
            stack.append((tok, node.children[tok], seg, depth + len(run), tree))
    return RadixForest(
        tokens=np.asarray(tokens, np.int32),
        seg_parent=np.asarray(seg_parent, np.int32),
        seg_length=np.asarray(seg_length, np.int32),
        seg_depth=np.asarray(seg_depth, np.int32),
        seg_tree=np.asarray(seg_tree, np.int32),
        traj_seg=np.asarray(traj_seg, np.int32),
    )
