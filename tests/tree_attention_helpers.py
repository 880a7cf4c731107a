"""Random tree layouts for the tree-attention tests (kernels.tree_attention).

A tree is a forest of segments. Each segment hangs below the first `cut` rows of its parent (any
cut 1..len(parent): a branch inside a segment or at its end), so its ancestors are the prefix path
above it: per ancestor segment, the rows down to where the path leaves it. Local segments are laid
out in rows 0..R-1 in a random order; imported segments (a chain of them, as a rank receives the
part of a path that another microbatch computed) occupy rows R..Rk-1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.tree_attention import TreeLayout, prepare_tree_layout


@dataclass(slots=True, kw_only=True)
class Tree:
    """One tree layout in the plan's form, plus its sizes."""

    seg_start: torch.Tensor
    seg_len: torch.Tensor
    attn_offsets: torch.Tensor
    attn_ranges: torch.Tensor
    R: int
    Rk: int

    def layout(self) -> dict[str, torch.Tensor]:
        """The compact arrays, as the plan carries them."""
        return dict(seg_start=self.seg_start, seg_len=self.seg_len, attn_offsets=self.attn_offsets,
                    attn_ranges=self.attn_ranges)

    def prepare(self, device: str = "cpu", **blocks) -> TreeLayout:
        """`prepare_tree_layout` of this tree (R local rows, Rk - R imported rows)."""
        return prepare_tree_layout(**self.layout(), num_rows=self.R, num_kv_rows=self.Rk, device=device, **blocks)


def random_tree(
    seed: int,
    *,
    num_segments: int,
    min_len: int = 1,
    max_len: int = 20,
    num_imported: int = 0,
    kind: str = "random",
    merge_adjacent: bool = True,
) -> Tree:
    """A random segment forest.

    kind: "random" (each segment picks any earlier segment, or none, as parent), "chain" (each
    segment continues the previous one at its end), "wide" (one root, every other segment branches
    from it at a random cut). Imported segments form a chain; local roots of "random" hang below it.
    merge_adjacent: join ancestor ranges that touch (the plan's compact form); both forms are valid.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    # node: [length, parent node or -1, cut]
    nodes: list[list[int]] = []
    for i in range(num_imported):
        nodes.append([rand(min_len, max_len), i - 1, 0])
        if i:
            nodes[i][2] = nodes[i - 1][0]
    for i in range(num_segments):
        node = len(nodes)
        length = rand(min_len, max_len)
        if kind == "chain":
            parent = node - 1
        elif kind == "wide":
            parent = num_imported if i else node - 1
        elif kind == "random":
            parent = rand(-1, node - 1)
        else:
            raise ValueError(f"kind: expected random/chain/wide, got {kind!r}")
        if parent < 0:
            cut = 0
        elif kind == "chain":
            cut = nodes[parent][0]
        else:
            cut = rand(1, nodes[parent][0])
        nodes.append([length, parent, cut])

    local = list(range(num_imported, len(nodes)))
    order = torch.randperm(len(local), generator=gen).tolist()
    start = {}
    row = 0
    for j in order:
        start[local[j]] = row
        row += nodes[local[j]][0]
    R = row
    for i in range(num_imported):
        start[i] = row
        row += nodes[i][0]
    Rk = row

    offsets, ranges = [0], []
    for node in local:
        path = []
        parent, cut = nodes[node][1], nodes[node][2]
        while parent >= 0:
            path.append((start[parent], start[parent] + cut))
            parent, cut = nodes[parent][1], nodes[parent][2]
        path.reverse()
        merged: list[tuple[int, int]] = []
        for a, b in path:
            if merge_adjacent and merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        ranges.extend(merged)
        offsets.append(len(ranges))
    return Tree(
        seg_start=torch.tensor([start[n] for n in local], dtype=torch.int32),
        seg_len=torch.tensor([nodes[n][0] for n in local], dtype=torch.int32),
        attn_offsets=torch.tensor(offsets, dtype=torch.int32),
        attn_ranges=torch.tensor(ranges, dtype=torch.int32).reshape(-1, 2),
        R=R,
        Rk=Rk,
    )


def random_qkv(tree: Tree, H: int, Hkv: int, D: int, *, seed: int, dtype: torch.dtype, device: str = "cpu"):
    """q [R, H, D], k, v [Rk, Hkv, D], requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tree.R, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(tree.Rk, Hkv, D, generator=gen, dtype=torch.float64)
    v = torch.randn(tree.Rk, Hkv, D, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype).requires_grad_(True) for x in (q, k, v)]
