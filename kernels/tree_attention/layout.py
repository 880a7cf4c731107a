"""Input validation and the block layout of one tree-attention call.

Both backends see the plan's layout (proto/harts/v1/plan.proto, Microbatch): segments
`seg_start[s] : seg_start[s] + seg_len[s]` that tile the R local rows, and per segment the half-open
k/v row ranges `attn_ranges[attn_offsets[s] : attn_offsets[s+1]]` (its ancestors, local rows < R or
imported rows >= R) that all its queries see. This module checks them once and builds the index
tensors the Triton kernels walk:

- query blocks: each segment's rows cut into blocks of BM rows from the segment start (a block never
  spans two segments), the unit of the forward and dq programs;
- kv pieces (backward only): for every kv block of BN rows, the (query block, column interval,
  causal) triples that see part of it, as a CSR map. One query block's pieces are disjoint in
  columns (ancestor ranges are disjoint and lie outside the segment), so a kv-major program sums
  its dk/dv over the pieces without atomics.

Legend: R query rows, Rk k/v rows, S segments, n ancestor ranges, NB query blocks, NKB kv blocks,
P kv pieces, H query heads, Hkv kv heads, D head dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
    """[n, 2] half-open k/v row ranges."""


def _as_index(name: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x)
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected an int32/int64 tensor, got {x.dtype}")
    if x.dim() != dim:
        raise ValueError(f"{name}: expected {dim} dimension(s), got shape {tuple(x.shape)}")
    return x.detach().to("cpu", torch.int64)


def validate_inputs(
    q_RHD: torch.Tensor,
    k_KHD: torch.Tensor,
    v_KHD: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    attn_offsets: torch.Tensor,
    attn_ranges: torch.Tensor,
) -> TreeIndex:
    """Check shapes, dtypes and the segment layout; returns the layout as int64 CPU tensors.

    Raises ValueError ("expected X, got Y", naming the field) on any violation.
    """
    if q_RHD.dim() != 3 or k_KHD.dim() != 3 or v_KHD.dim() != 3:
        raise ValueError(
            f"q, k, v: expected [R, H, D], [Rk, Hkv, D], [Rk, Hkv, D], got {tuple(q_RHD.shape)}, "
            f"{tuple(k_KHD.shape)}, {tuple(v_KHD.shape)}"
        )
    R, H, D = q_RHD.shape
    Rk, Hkv, Dk = k_KHD.shape
    if tuple(v_KHD.shape) != (Rk, Hkv, D) or Dk != D:
        raise ValueError(f"k, v: expected shape {(Rk, Hkv, D)} each, got {tuple(k_KHD.shape)} and {tuple(v_KHD.shape)}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q: expected H a multiple of Hkv={Hkv}, got H={H}")
    if Rk < R:
        raise ValueError(f"k: expected Rk >= R={R} rows (local rows first, then imported), got {Rk}")
    if not (q_RHD.dtype == k_KHD.dtype == v_KHD.dtype) or not q_RHD.dtype.is_floating_point:
        raise ValueError(f"q, k, v: expected one floating dtype, got {q_RHD.dtype}, {k_KHD.dtype}, {v_KHD.dtype}")
    if not (q_RHD.device == k_KHD.device == v_KHD.device):
        raise ValueError(f"q, k, v: expected one device, got {q_RHD.device}, {k_KHD.device}, {v_KHD.device}")

    start_S = _as_index("seg_start", seg_start, 1)
    len_S = _as_index("seg_len", seg_len, 1)
    off_S1 = _as_index("attn_offsets", attn_offsets, 1)
    ranges_n2 = _as_index("attn_ranges", attn_ranges, 2) if attn_ranges.numel() else torch.zeros(0, 2, dtype=torch.long)
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
    if off_S1.numel() != S + 1 or (S + 1 and int(off_S1[0]) != 0) or (off_S1[1:] < off_S1[:-1]).any():
        raise ValueError(f"attn_offsets: expected {S + 1} non-decreasing offsets from 0, got {off_S1.tolist()[:8]}...")
    n = int(off_S1[-1]) if S + 1 else 0
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


def segmented_arange(counts: torch.Tensor) -> torch.Tensor:
    """Position of every element inside its group: [0..c0-1, 0..c1-1, ...] for counts [c0, c1, ...]."""
    total = int(counts.sum())
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(total, dtype=torch.long) - torch.repeat_interleave(starts, counts)


@dataclass(slots=True, kw_only=True)
class QueryBlocks:
    """Each segment's rows in blocks of BM, from the segment start (int64, CPU)."""

    seg_NB: torch.Tensor
    """Segment of each block."""
    row_NB: torch.Tensor
    """First row of each block."""


def query_blocks(index: TreeIndex, block_m: int) -> QueryBlocks:
    """Cut each segment into ceil(seg_len / BM) query blocks."""
    nb_S = (index.seg_len_S + block_m - 1) // block_m
    seg_NB = torch.repeat_interleave(torch.arange(nb_S.numel(), dtype=torch.long), nb_S)
    row_NB = index.seg_start_S[seg_NB] + block_m * segmented_arange(nb_S)
    return QueryBlocks(seg_NB=seg_NB, row_NB=row_NB)


@dataclass(slots=True, kw_only=True)
class KvPieces:
    """CSR map kv block -> pieces (int64, CPU), pieces sorted by kv block."""

    offsets_NKB1: torch.Tensor
    """[NKB+1] piece offsets per kv block of BN rows."""
    qblock_P: torch.Tensor
    """Query block of each piece."""
    lo_P: torch.Tensor
    """First column (k/v row) of the piece; inside the piece's kv block."""
    hi_P: torch.Tensor
    """One past the last column."""
    causal_P: torch.Tensor
    """1 where the piece is the block's own segment (column <= row also applies), else 0."""


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
