"""The layout of one microbatch's tree attention: validated once, shared by every attention layer.

    layout = prepare_tree_layout(seg_start, seg_len, attn_offsets, attn_ranges, num_rows=R,
                                 num_kv_rows=R + I, device=q.device)

Keys are the plan's extended rows [0, R + I) (a window's imported rows after the local ones);
the query blocks and the kv pieces (a CSR map) the Triton kernels walk: docs/design/execution.md
("Tree attention"). Legend: R query (local) rows, I imported rows, Rk = R + I k/v rows,
S segments, n ancestor ranges, NB query blocks, NKB kv blocks, P kv pieces, H query heads,
Hkv kv heads, D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from kernels.devices import resolve_device, same_device, to_device


@dataclass(slots=True, kw_only=True)
class TreeIndex:
    """The segment layout as int64 CPU tensors (validated)."""

    seg_start_S: torch.Tensor
    """First row of each segment."""
    seg_len_S: torch.Tensor
    """Rows of each segment."""
    attn_offsets_S1: torch.Tensor
    """[S+1] offsets into attn_ranges_n2."""
    attn_ranges_n2: torch.Tensor
    """[n, 2] half-open extended-row ranges."""


@dataclass(slots=True, kw_only=True)
class QueryBlocks:
    """Each segment's rows in blocks of BM, from the segment start (int64)."""

    seg_NB: torch.Tensor
    """Segment of each block."""
    row_NB: torch.Tensor
    """First row of each block."""


@dataclass(slots=True, kw_only=True)
class KvPieces:
    """CSR map kv block -> pieces (int64), pieces sorted by kv block."""

    offsets_NKB1: torch.Tensor
    """[NKB+1] piece offsets per kv block of BN rows."""
    qblock_P: torch.Tensor
    """Query block of each piece."""
    lo_P: torch.Tensor
    """First column (extended row) of the piece; inside the piece's kv block."""
    hi_P: torch.Tensor
    """One past the last column."""
    causal_P: torch.Tensor
    """1 where the piece is the block's own segment (column <= row also applies), else 0."""


@dataclass(slots=True, kw_only=True)
class TreeLayout:
    """One microbatch's attention layout (`prepare_tree_layout`): the validated host index for the
    reference and the Triton block maps on `device`, reused by every layer."""

    num_rows: int
    """R, query rows (the microbatch's local rows)."""
    num_kv_rows: int
    """R + I, key/value rows: local rows then imported rows (the plan's extended rows)."""
    index: TreeIndex
    """The compact ranges, validated, as int64 CPU tensors (the reference walks them)."""
    block_m: int
    """BM, query rows per Triton program."""
    block_n: int
    """BN, key/value rows per Triton tile."""
    blocks: QueryBlocks
    """Query blocks (on `device`)."""
    pieces: KvPieces
    """The backward's kv-block map (on `device`)."""
    seg_start_S: torch.Tensor
    """`index.seg_start_S` on `device`."""
    seg_len_S: torch.Tensor
    """`index.seg_len_S` on `device`."""
    attn_offsets_S1: torch.Tensor
    """`index.attn_offsets_S1` on `device`."""
    attn_ranges_2n: torch.Tensor
    """`index.attn_ranges_n2` flattened (start, end, start, end, ...) on `device`."""
    anc_depth_n: torch.Tensor
    """Depth of each ancestor range's first row in its segment's key sequence (the rows of the
    segment's earlier ranges), on `device` (the depth-tiled Triton mode)."""
    anc_len_S: torch.Tensor
    """Ancestor rows of each segment (the depth of its first own row), on `device`."""
    device: torch.device
    """Where the block maps live (resolved: "cuda:0", never "cuda"; `kernels.devices`)."""
    batch_invariant: bool = False
    """The Triton forward and dq tile each query's keys at fixed depths of its key sequence (rows
    gathered across ranges): a row's bits do not depend on how its ancestors are split into ranges."""
    plans: dict = field(default_factory=dict)
    """Per-backend plans built from this layout on first use (`plan`), e.g. a CPU tile plan."""

    @property
    def num_segments(self) -> int:
        return int(self.index.seg_start_S.shape[0])

    def plan(self, name: str, build):
        """`build(self)` on the first call for `name`, the same object afterwards: a backend's own
        index structure (built once per microbatch, shared by every layer)."""
        if name not in self.plans:
            self.plans[name] = build(self)
        return self.plans[name]

    def to(self, device: torch.device | str) -> TreeLayout:
        """This layout with its block maps on `device` (self when they already are: "cuda" and
        "cuda:<current>" are one device)."""
        if same_device(device, self.device):
            return self
        device = resolve_device(device)
        mv = lambda t: to_device(t, device)  # noqa: E731
        b, p = self.blocks, self.pieces
        return replace(
            self,
            blocks=QueryBlocks(seg_NB=mv(b.seg_NB), row_NB=mv(b.row_NB)),
            pieces=KvPieces(offsets_NKB1=mv(p.offsets_NKB1), qblock_P=mv(p.qblock_P), lo_P=mv(p.lo_P),
                            hi_P=mv(p.hi_P), causal_P=mv(p.causal_P)),
            seg_start_S=mv(self.seg_start_S), seg_len_S=mv(self.seg_len_S),
            attn_offsets_S1=mv(self.attn_offsets_S1), attn_ranges_2n=mv(self.attn_ranges_2n),
            anc_depth_n=mv(self.anc_depth_n), anc_len_S=mv(self.anc_len_S), device=device, plans={},
        )


def _as_index(name: str, x, dim: int) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected an integer array, got {x.dtype}")
        x = torch.from_numpy(x.astype(np.int64))
    elif not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected an int32/int64 tensor or numpy array, got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32/int64 tensor, got {x.dtype}")
    if x.dim() != dim and not (dim == 2 and x.numel() == 0):
        raise ValueError(f"{name}: expected {dim} dimension(s), got shape {tuple(x.shape)}")
    return x.detach().to("cpu", torch.int64)


def validate_layout(seg_start, seg_len, attn_offsets, attn_ranges, num_rows: int, num_kv_rows: int) -> TreeIndex:
    """Check the segment layout against R = num_rows query rows and Rk = num_kv_rows extended rows;
    returns it as int64 CPU tensors. Raises ValueError ("expected X, got Y", naming the field)."""
    R, Rk = int(num_rows), int(num_kv_rows)
    if R < 0 or Rk < R:
        raise ValueError(f"num_kv_rows: expected >= num_rows={R} (local rows first, then imported), got {Rk}")
    start_S = _as_index("seg_start", seg_start, 1)
    len_S = _as_index("seg_len", seg_len, 1)
    off_S1 = _as_index("attn_offsets", attn_offsets, 1)
    ranges_n2 = _as_index("attn_ranges", attn_ranges, 2).reshape(-1, 2)
    S = start_S.numel()
    if len_S.numel() != S:
        raise ValueError(f"seg_len: expected {S} entries (one per segment), got {len_S.numel()}")
    if (len_S < 1).any():
        raise ValueError(f"seg_len: expected every segment >= 1 row, got min {int(len_S.min())}")
    order = torch.argsort(start_S)
    ends = start_S[order] + len_S[order]
    if S == 0 and R != 0 or S and (int(start_S[order[0]]) != 0 or int(ends[-1]) != R or not torch.equal(start_S[order[1:]], ends[:-1])):
        raise ValueError(f"seg_start/seg_len: expected segments that tile rows 0..{R} exactly, got starts {start_S.tolist()[:8]}... "
                         f"lengths {len_S.tolist()[:8]}...")
    if off_S1.numel() != S + 1 or int(off_S1[0]) != 0 or (off_S1[1:] < off_S1[:-1]).any():
        raise ValueError(f"attn_offsets: expected {S + 1} non-decreasing offsets from 0, got {off_S1.tolist()[:8]}...")
    n = int(off_S1[-1])
    if ranges_n2.shape != (n, 2):
        raise ValueError(f"attn_ranges: expected shape ({n}, 2) (attn_offsets[-1] ranges), got {tuple(ranges_n2.shape)}")
    if n and ((ranges_n2[:, 0] < 0).any() or (ranges_n2[:, 1] < ranges_n2[:, 0]).any() or (ranges_n2[:, 1] > Rk).any()):
        raise ValueError(f"attn_ranges: expected 0 <= start <= end <= Rk={Rk}, got {ranges_n2.tolist()[:8]}...")
    if n:
        seg_n = torch.repeat_interleave(torch.arange(S, dtype=torch.long), off_S1[1:] - off_S1[:-1])
        a_n, b_n = ranges_n2[:, 0], ranges_n2[:, 1]
        own = (a_n < (start_S + len_S)[seg_n]) & (b_n > start_S[seg_n]) & (b_n > a_n)
        if own.any():
            i = int(own.nonzero()[0])
            raise ValueError(
                f"attn_ranges: expected ancestor ranges outside their segment's own rows, got range "
                f"{ranges_n2[i].tolist()} for segment {int(seg_n[i])} (rows {int(start_S[seg_n[i]])}.."
                f"{int(start_S[seg_n[i]] + len_S[seg_n[i]])})"
            )
    return TreeIndex(seg_start_S=start_S, seg_len_S=len_S, attn_offsets_S1=off_S1, attn_ranges_n2=ranges_n2)


def validate_tensors(q_RHD: torch.Tensor, k_KHD: torch.Tensor, v_KHD: torch.Tensor, layout: TreeLayout) -> None:
    """Check q [R, H, D], k and v [R + I, Hkv, D] against the layout (no host synchronisation)."""
    if not isinstance(layout, TreeLayout):
        raise ValueError(f"layout: expected a TreeLayout from prepare_tree_layout, got {type(layout).__name__}")
    if q_RHD.dim() != 3 or k_KHD.dim() != 3 or v_KHD.dim() != 3:
        raise ValueError(
            f"q, k, v: expected [R, H, D], [R+I, Hkv, D], [R+I, Hkv, D], got {tuple(q_RHD.shape)}, "
            f"{tuple(k_KHD.shape)}, {tuple(v_KHD.shape)}"
        )
    R, H, D = q_RHD.shape
    Rk, Hkv, Dk = k_KHD.shape
    if R != layout.num_rows:
        raise ValueError(f"q: expected the layout's {layout.num_rows} query rows, got {R}")
    if Rk != layout.num_kv_rows:
        raise ValueError(f"k: expected the layout's {layout.num_kv_rows} extended rows (local, then imported), got {Rk}")
    if tuple(v_KHD.shape) != (Rk, Hkv, D) or Dk != D:
        raise ValueError(f"k, v: expected shape {(Rk, Hkv, D)} each, got {tuple(k_KHD.shape)} and {tuple(v_KHD.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q: expected H a multiple of Hkv={Hkv}, got H={H}")
    if not (q_RHD.dtype == k_KHD.dtype == v_KHD.dtype) or not q_RHD.dtype.is_floating_point:
        raise ValueError(f"q, k, v: expected one floating dtype, got {q_RHD.dtype}, {k_KHD.dtype}, {v_KHD.dtype}")
    if not (same_device(q_RHD.device, k_KHD.device) and same_device(q_RHD.device, v_KHD.device)):
        raise ValueError(f"q, k, v: expected one device, got {q_RHD.device}, {k_KHD.device}, {v_KHD.device}")


def segmented_arange(counts: torch.Tensor) -> torch.Tensor:
    """Position of every element inside its group: [0..c0-1, 0..c1-1, ...] for counts [c0, c1, ...]."""
    total = int(counts.sum())
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(total, dtype=torch.long) - torch.repeat_interleave(starts, counts)


def query_blocks(index: TreeIndex, block_m: int) -> QueryBlocks:
    """Cut each segment into ceil(seg_len / BM) query blocks."""
    nb_S = (index.seg_len_S + block_m - 1) // block_m
    seg_NB = torch.repeat_interleave(torch.arange(nb_S.numel(), dtype=torch.long), nb_S)
    row_NB = index.seg_start_S[seg_NB] + block_m * segmented_arange(nb_S)
    return QueryBlocks(seg_NB=seg_NB, row_NB=row_NB)


def kv_pieces(index: TreeIndex, blocks: QueryBlocks, *, block_m: int, block_n: int, num_kv_rows: int) -> KvPieces:
    """For every kv block, the (query block, column interval, causal) pieces that see it.

    A query block of segment s sees its ancestor ranges fully and its own segment's rows
    seg_start[s] .. (its last row) causally; each such interval is split at kv block boundaries.
    """
    seg_NB = blocks.seg_NB
    NB = seg_NB.numel()
    nr_NB = (index.attn_offsets_S1[1:] - index.attn_offsets_S1[:-1])[seg_NB]
    anc_qb = torch.repeat_interleave(torch.arange(NB, dtype=torch.long), nr_NB)
    anc_r = index.attn_offsets_S1[seg_NB][anc_qb] + segmented_arange(nr_NB)
    anc_lo = index.attn_ranges_n2[anc_r, 0]
    anc_hi = index.attn_ranges_n2[anc_r, 1]
    seg_end_NB = (index.seg_start_S + index.seg_len_S)[seg_NB]
    own_lo = index.seg_start_S[seg_NB]
    own_hi = torch.minimum(blocks.row_NB + block_m, seg_end_NB)

    qb = torch.cat([anc_qb, torch.arange(NB, dtype=torch.long)])
    lo = torch.cat([anc_lo, own_lo])
    hi = torch.cat([anc_hi, own_hi])
    causal = torch.cat([torch.zeros_like(anc_qb), torch.ones(NB, dtype=torch.long)])
    keep = hi > lo
    qb, lo, hi, causal = qb[keep], lo[keep], hi[keep], causal[keep]

    first_blk = lo // block_n
    count = (hi - 1) // block_n - first_blk + 1
    rep = torch.repeat_interleave(torch.arange(qb.numel(), dtype=torch.long), count)
    kvb_P = first_blk[rep] + segmented_arange(count)
    lo_P = torch.maximum(lo[rep], kvb_P * block_n)
    hi_P = torch.minimum(hi[rep], (kvb_P + 1) * block_n)
    order = torch.argsort(kvb_P, stable=True)
    nkb = (num_kv_rows + block_n - 1) // block_n
    per_block = torch.bincount(kvb_P, minlength=nkb)
    offsets = torch.zeros(nkb + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(per_block, 0)
    return KvPieces(
        offsets_NKB1=offsets, qblock_P=qb[rep][order], lo_P=lo_P[order], hi_P=hi_P[order], causal_P=causal[rep][order]
    )


def prepare_tree_layout(
    seg_start,
    seg_len,
    attn_offsets,
    attn_ranges,
    *,
    num_rows: int,
    num_kv_rows: int | None = None,
    device: torch.device | str | None = None,
    block_m: int = 64,
    block_n: int = 64,
    batch_invariant: bool = False,
) -> TreeLayout:
    """Validate a microbatch's compact attention ranges and build its layout, once for every layer.

    Args:
        seg_start, seg_len: [S] int segments tiling the local rows 0..R-1 (tensors or numpy arrays,
            e.g. the plan's decoded `seg_start` / `seg_length`).
        attn_offsets: [S+1]; attn_ranges: [n, 2] half-open extended-row ranges (the plan's
            `attn_offsets` / `attn_ranges`: rows >= R are imported rows).
        num_rows: R. num_kv_rows: R + I (default R: no imported rows).
        device: where the kernels' inputs will live (default CPU).
        block_m, block_n: Triton query / kv tile rows (powers of two >= 16).
        batch_invariant: the Triton kernels' depth-tiled mode (`TreeLayout.batch_invariant`): a
            row's output and dq are bitwise those of its expanded sequence, at the cost of gathered
            key rows; tree and expanded layouts must both use it, with one block_n.
    """
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk < 16 or blk & (blk - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {blk}")
    Rk = num_rows if num_kv_rows is None else num_kv_rows
    index = validate_layout(seg_start, seg_len, attn_offsets, attn_ranges, num_rows, Rk)
    blocks = query_blocks(index, block_m)
    pieces = kv_pieces(index, blocks, block_m=block_m, block_n=block_n, num_kv_rows=Rk)
    # Ancestor depths: each range's exclusive cumulative length within its segment.
    len_n = index.attn_ranges_n2[:, 1] - index.attn_ranges_n2[:, 0]
    cum_n1 = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(len_n, 0)])
    first_n = torch.repeat_interleave(index.attn_offsets_S1[:-1], index.attn_offsets_S1[1:] - index.attn_offsets_S1[:-1])
    layout = TreeLayout(
        num_rows=int(num_rows), num_kv_rows=int(Rk), index=index, block_m=block_m, block_n=block_n,
        blocks=blocks, pieces=pieces, seg_start_S=index.seg_start_S, seg_len_S=index.seg_len_S,
        attn_offsets_S1=index.attn_offsets_S1, attn_ranges_2n=index.attn_ranges_n2.reshape(-1),
        anc_depth_n=cum_n1[:-1] - cum_n1[first_n], anc_len_S=cum_n1[index.attn_offsets_S1[1:]] - cum_n1[index.attn_offsets_S1[:-1]],
        device=torch.device("cpu"), batch_invariant=bool(batch_invariant),
    )
    return layout.to(device or "cpu")
