"""Input validation and the chunk layout of one varlen gated-delta-rule call.

Both backends (the PyTorch reference and the Triton kernel) see the same packed inputs; this module
checks them once and turns `cu_seqlens` and the export requests into index tensors.

Chunk order. Sequences are ranked by their number of chunks, most first (stable, so equal counts
keep their input order). Chunk `j` of the sequence of rank `r` gets slot `chunk_off[j] + r`: all
`j`-th chunks are contiguous, and the sequences that have a `j`-th chunk are the ranks
`0 .. active[j]-1`, a prefix. The inter-chunk recurrence is then a loop over `j` on prefixes of one
state tensor, and the intra-chunk work is one batch over all slots.

Legend: T packed rows, N sequences, M chunks in the call, C chunk size, E exported states,
J = the most chunks of any sequence, H heads, K key dim, V value dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, kw_only=True)
class ChunkLayout:
    """Where every chunk, row and exported state of a call lives."""

    chunk_size: int
    """C, the chunk size; chunks of a sequence are rows [jC, (j+1)C) from its start."""
    seq_len_N: torch.Tensor
    """Rows per sequence (int64, CPU)."""
    seq_start_N: torch.Tensor
    """First packed row per sequence (int64, CPU)."""
    rank_to_seq_N: torch.Tensor
    """Sequence index at each rank (int64, CPU); ranks sort sequences by chunk count, most first."""
    active_J: list[int]
    """active_J[j]: how many sequences have a j-th chunk (a prefix of the ranks)."""
    chunk_off_J: list[int]
    """chunk_off_J[j]: slot of the j-th chunk of rank 0."""
    gather_MC: torch.Tensor
    """Packed row of every position of every chunk slot; T (one past the end) for padding."""
    row_slot_T: torch.Tensor
    """Flat position (slot * C + offset) of every packed row."""
    export_chunks_E: torch.Tensor
    """Chunks of its sequence that exported state e follows: ceil(export_pos / C) (int64, CPU)."""
    export_slot_E: torch.Tensor
    """Slot of the chunk after which state e is taken (int64, CPU)."""

    @property
    def num_chunks(self) -> int:
        """M, the number of chunk slots."""
        return int(self.gather_MC.shape[0])


def validate_inputs(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state_NHKV: torch.Tensor | None,
    export_seq_E: torch.Tensor,
    export_pos_E: torch.Tensor,
    chunk_size: int,
) -> None:
    """Raise ValueError naming the argument when the packed inputs do not fit the contract."""
    if q_THK.dim() != 3:
        raise ValueError(f"q: expected [T, H, K], got shape {tuple(q_THK.shape)}")
    T, H, K = q_THK.shape
    if tuple(k_THK.shape) != (T, H, K):
        raise ValueError(f"k: expected shape {(T, H, K)} like q, got {tuple(k_THK.shape)}")
    if v_THV.dim() != 3 or tuple(v_THV.shape[:2]) != (T, H):
        raise ValueError(f"v: expected [T={T}, H={H}, V], got shape {tuple(v_THV.shape)}")
    V = v_THV.shape[2]
    for name, x in (("g", g_TH), ("beta", beta_TH)):
        if tuple(x.shape) != (T, H):
            raise ValueError(f"{name}: expected shape {(T, H)}, got {tuple(x.shape)}")
    for name, x in (("q", q_THK), ("k", k_THK), ("v", v_THV), ("g", g_TH), ("beta", beta_TH)):
        if not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1 (64 by default), got {chunk_size}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens: expected an integer tensor [N+1] with N >= 1, got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}"
        )
    cu = cu_seqlens.cpu()
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens: expected to start at 0 and end at T={T}, got {int(cu[0])} .. {int(cu[-1])}")
    if bool((cu[1:] <= cu[:-1]).any()):
        raise ValueError(f"cu_seqlens: expected strictly increasing offsets (every sequence >= 1 row), got {cu.tolist()}")
    N = cu.numel() - 1
    if initial_state_NHKV is not None:
        if tuple(initial_state_NHKV.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state: expected shape {(N, H, K, V)}, got {tuple(initial_state_NHKV.shape)}"
            )
        if not initial_state_NHKV.is_floating_point():
            raise ValueError(f"initial_state: expected fp32, got {initial_state_NHKV.dtype}")
    if export_seq_E.dim() != 1 or export_pos_E.shape != export_seq_E.shape:
        raise ValueError(
            f"export_seq, export_pos: expected two 1-D tensors of equal length, got "
            f"{tuple(export_seq_E.shape)} and {tuple(export_pos_E.shape)}"
        )
    if export_seq_E.numel() == 0:
        return
    seq = export_seq_E.cpu().long()
    pos = export_pos_E.cpu().long()
    if bool(((seq < 0) | (seq >= N)).any()):
        raise ValueError(f"export_seq: expected values in [0, {N}), got {seq.tolist()}")
    lens = (cu[1:] - cu[:-1]).long()[seq]
    bad = (pos <= 0) | (pos > lens) | ((pos % chunk_size != 0) & (pos != lens))
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"export_pos[{e}]: expected a multiple of chunk_size={chunk_size} in (0, len] or the sequence "
            f"length {int(lens[e])}, got {int(pos[e])}"
        )


def build_chunk_layout(
    cu_seqlens: torch.Tensor, export_seq_E: torch.Tensor, export_pos_E: torch.Tensor, chunk_size: int
) -> ChunkLayout:
    """Index tensors of one call (on the CPU; the caller moves what it gathers with).

    Args:
        cu_seqlens: [N+1] validated offsets.
        export_seq_E, export_pos_E: [E] validated export requests.
        chunk_size: C.
    """
    C = chunk_size
    cu = cu_seqlens.cpu().long()
    T = int(cu[-1])
    seq_start_N = cu[:-1]
    seq_len_N = cu[1:] - cu[:-1]
    n_chunks_N = (seq_len_N + C - 1) // C
    rank_to_seq_N = torch.sort(n_chunks_N, descending=True, stable=True).indices
    n_chunks_R = n_chunks_N[rank_to_seq_N]
    J = int(n_chunks_R[0])
    active_J = [int((n_chunks_R > j).sum()) for j in range(J)]
    chunk_off_J = [0] * J
    for j in range(1, J):
        chunk_off_J[j] = chunk_off_J[j - 1] + active_J[j - 1]
    M = chunk_off_J[-1] + active_J[-1]

    chunk_j_M = torch.cat([torch.full((a,), j, dtype=torch.long) for j, a in enumerate(active_J)])
    chunk_rank_M = torch.cat([torch.arange(a) for a in active_J])
    chunk_seq_M = rank_to_seq_N[chunk_rank_M]
    row_MC = (seq_start_N[chunk_seq_M] + chunk_j_M * C)[:, None] + torch.arange(C)[None, :]
    valid_MC = row_MC < (seq_start_N + seq_len_N)[chunk_seq_M][:, None]
    gather_MC = torch.where(valid_MC, row_MC, torch.full_like(row_MC, T))
    row_slot_T = torch.empty(T, dtype=torch.long)
    row_slot_T[row_MC[valid_MC]] = torch.arange(M * C).reshape(M, C)[valid_MC]

    seq_to_rank_N = torch.empty_like(rank_to_seq_N)
    seq_to_rank_N[rank_to_seq_N] = torch.arange(rank_to_seq_N.numel())
    export_chunks_E = (export_pos_E.cpu().long() + C - 1) // C
    offs = torch.tensor(chunk_off_J + [M], dtype=torch.long)
    export_slot_E = offs[export_chunks_E - 1] + seq_to_rank_N[export_seq_E.cpu().long()]
    return ChunkLayout(
        chunk_size=C,
        seq_len_N=seq_len_N,
        seq_start_N=seq_start_N,
        rank_to_seq_N=rank_to_seq_N,
        active_J=active_J,
        chunk_off_J=chunk_off_J,
        gather_MC=gather_MC,
        row_slot_T=row_slot_T,
        export_chunks_E=export_chunks_E,
        export_slot_E=export_slot_E,
    )
