"""Input validation and the chunk layout of one varlen gated-delta-rule call.

    layout = prepare_layout(cu_seqlens, export_seq, export_pos, chunk_size, device=q.device)

Sequences ranked by chunk count, chunk j of rank r at slot `chunk_off[j] + r`, so the recurrence
runs on prefixes of one state tensor; built once per call's indices and shared by every layer
(docs/design/execution.md, "The gated delta rule").
Legend: T packed rows, N sequences, M chunks in the call, C chunk size, E exported states,
J = the most chunks of any sequence, H heads, K key dim, V value dim.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kernels.devices import resolve_device, same_device, to_device
from kernels.row_adds import RowAdds


@dataclass(slots=True, kw_only=True)
class ChunkLayout:
    """Where every chunk, row and exported state of a call lives (built by `prepare_layout`).

    Host fields are int64 numpy arrays; the tensors the kernel gathers with live on `device`."""

    chunk_size: int
    """C, the chunk size; chunks of a sequence are rows [jC, (j+1)C) from its start."""
    cu_seqlens: np.ndarray
    """[N+1] the offsets it was built from (host)."""
    export_seq_E: np.ndarray
    """[E] the export requests it was built from: sequence (host)."""
    export_pos_E: np.ndarray
    """[E] the export requests it was built from: rows done (host)."""
    seq_len_N: np.ndarray
    """Rows per sequence (host)."""
    seq_start_N: np.ndarray
    """First packed row per sequence (host)."""
    active_J: list[int]
    """active_J[j]: how many sequences have a j-th chunk (a prefix of the ranks)."""
    chunk_off_J: list[int]
    """chunk_off_J[j]: slot of the j-th chunk of rank 0."""
    export_chunks_E: np.ndarray
    """Chunks of its sequence that exported state e follows: ceil(export_pos / C) (host)."""
    export_slot_E: np.ndarray
    """Slot of the chunk after which state e is taken (host)."""
    rank_to_seq_N: torch.Tensor
    """Sequence index at each rank (int64, on `device`); ranks sort sequences by chunk count, most first."""
    gather_MC: torch.Tensor
    """Packed row of every position of every chunk slot; T (one past the end) for padding (on `device`)."""
    row_slot_T: torch.Tensor
    """Flat position (slot * C + offset) of every packed row (on `device`)."""
    export_ranks_J: dict[int, torch.Tensor]
    """Chunk step j -> ranks whose state is exported right after step j, by ascending e (on `device`)."""
    export_adds_J: dict[int, RowAdds]
    """Chunk step j -> the fixed-order sum of step j's export gradients into their ranks' rows
    (a rank listed twice gets both, in order; on `device`)."""
    export_order_E: torch.Tensor
    """Position of export e in the step-by-step concatenation of the `export_ranks_J` (on `device`)."""
    above_diag_CC: torch.Tensor
    """[C, C] bool, True strictly above the diagonal: the causal mask of the intra-chunk decays (on `device`)."""
    chunk_row_M: torch.Tensor
    """First packed row of every chunk slot (int64, on `device`; the Triton kernels' per-chunk programs)."""
    chunk_end_M: torch.Tensor
    """One past the last packed row of every chunk slot (int64, on `device`)."""
    chunk_off_t_J: torch.Tensor
    """`chunk_off_J` as an int64 tensor on `device` (the Triton recurrences walk slot chunk_off[j] + rank)."""
    rank_chunks_N: torch.Tensor
    """Chunks of the sequence at each rank (int64, on `device`)."""
    export_row_M: torch.Tensor
    """Per chunk slot, the row of the distinct-export buffer its end state fills, or -1 (int64, on `device`)."""
    export_unique_E: torch.Tensor
    """Row of the distinct-export buffer of every export e (requests for one state share it; int64, on `device`)."""
    export_adds_U: RowAdds
    """The fixed-order sum of the E export gradients into the U distinct-export rows (on `device`)."""
    num_export_rows: int
    """U, distinct states exported (rows of the Triton kernels' export buffer)."""
    device: torch.device
    """Where the index tensors the kernel gathers with live (resolved: "cuda:0", never "cuda"; `kernels.devices`)."""
    source: tuple = ()
    """The (cu_seqlens, export_seq, export_pos) objects given to `prepare_layout`: a call passing these
    very objects again matches without a comparison (index tensors are not modified in place)."""

    @property
    def num_chunks(self) -> int:
        """M, the number of chunk slots."""
        return int(self.gather_MC.shape[0])

    @property
    def num_rows(self) -> int:
        """T, the packed rows of the call."""
        return int(self.row_slot_T.shape[0])

    @property
    def num_seqs(self) -> int:
        """N, the sequences of the call."""
        return int(self.seq_len_N.shape[0])

    def to(self, device: torch.device | str) -> ChunkLayout:
        """This layout with its gather tensors on `device` (self when they already are: "cuda" and
        "cuda:<current>" are one device)."""
        if same_device(device, self.device):
            return self
        device = resolve_device(device)
        return replace(
            self,
            rank_to_seq_N=to_device(self.rank_to_seq_N, device),
            gather_MC=to_device(self.gather_MC, device),
            row_slot_T=to_device(self.row_slot_T, device),
            export_ranks_J={j: to_device(r, device) for j, r in self.export_ranks_J.items()},
            export_adds_J={j: a.to(device) for j, a in self.export_adds_J.items()},
            export_order_E=to_device(self.export_order_E, device),
            above_diag_CC=to_device(self.above_diag_CC, device),
            chunk_row_M=to_device(self.chunk_row_M, device),
            chunk_end_M=to_device(self.chunk_end_M, device),
            chunk_off_t_J=to_device(self.chunk_off_t_J, device),
            rank_chunks_N=to_device(self.rank_chunks_N, device),
            export_row_M=to_device(self.export_row_M, device),
            export_unique_E=to_device(self.export_unique_E, device),
            export_adds_U=self.export_adds_U.to(device),
            device=device,
        )

    def matches(self, cu_seqlens, export_seq, export_pos, chunk_size: int) -> bool:
        """Whether this layout was built from these indices (identical objects, or equal values)."""
        if chunk_size != self.chunk_size:
            return False
        if len(self.source) == 3 and all(a is b for a, b in zip((cu_seqlens, export_seq, export_pos), self.source)):
            return True
        for given, own in ((cu_seqlens, self.cu_seqlens), (export_seq, self.export_seq_E), (export_pos, self.export_pos_E)):
            if given is own:
                continue
            given = given.detach().cpu().numpy() if isinstance(given, torch.Tensor) else np.asarray(given)
            if not np.array_equal(given, own):
                return False
        return True


def host_indices(x, name: str) -> np.ndarray:
    """An integer tensor or numpy array as an int64 numpy array (one device-to-host copy if on a device)."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an int32/int64 tensor, got {x.dtype}")
        return x.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise ValueError(f"{name}: expected an integer array, got {x.dtype}")
        return x.astype(np.int64, copy=False)
    raise ValueError(f"{name}: expected an integer tensor or numpy array, got {type(x).__name__}")


def validate_tensors(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    initial_state_NHKV: torch.Tensor | None,
    num_seqs: int | None,
) -> None:
    """Raise ValueError naming the argument when the data tensors do not fit the contract
    (num_seqs: N to check the initial state against, or None to skip that check)."""
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
    if initial_state_NHKV is not None:
        if num_seqs is not None and tuple(initial_state_NHKV.shape) != (num_seqs, H, K, V):
            raise ValueError(
                f"initial_state: expected shape {(num_seqs, H, K, V)}, got {tuple(initial_state_NHKV.shape)}"
            )
        if not initial_state_NHKV.is_floating_point():
            raise ValueError(f"initial_state: expected fp32, got {initial_state_NHKV.dtype}")


def validate_indices(
    cu_seqlens, export_seq_E, export_pos_E, chunk_size: int, num_rows: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check offsets and export requests (num_rows: T to check cu_seqlens[-1] against, or None);
    return them as int64 numpy arrays (cu [N+1], seq [E], pos [E])."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected >= 1 (64 by default), got {chunk_size}")
    cu = host_indices(cu_seqlens, "cu_seqlens")
    if cu.ndim != 1 or cu.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected an integer tensor [N+1] with N >= 1, got shape {tuple(cu.shape)}")
    T = int(cu[-1]) if num_rows is None else num_rows
    if int(cu[0]) != 0 or int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens: expected to start at 0 and end at T={T}, got {int(cu[0])} .. {int(cu[-1])}")
    if (cu[1:] <= cu[:-1]).any():
        raise ValueError(f"cu_seqlens: expected strictly increasing offsets (every sequence >= 1 row), got {cu.tolist()}")
    N = cu.shape[0] - 1
    seq = host_indices(export_seq_E, "export_seq")
    pos = host_indices(export_pos_E, "export_pos")
    if seq.ndim != 1 or pos.shape != seq.shape:
        raise ValueError(
            f"export_seq, export_pos: expected two 1-D tensors of equal length, got "
            f"{tuple(seq.shape)} and {tuple(pos.shape)}"
        )
    if seq.shape[0] == 0:
        return cu, seq, pos
    if ((seq < 0) | (seq >= N)).any():
        raise ValueError(f"export_seq: expected values in [0, {N}), got {seq.tolist()}")
    lens = (cu[1:] - cu[:-1])[seq]
    bad = (pos <= 0) | (pos > lens) | ((pos % chunk_size != 0) & (pos != lens))
    if bad.any():
        e = int(bad.nonzero()[0][0])
        raise ValueError(
            f"export_pos[{e}]: expected a multiple of chunk_size={chunk_size} in (0, len] or the sequence "
            f"length {int(lens[e])}, got {int(pos[e])}"
        )
    return cu, seq, pos


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
    validate_tensors(q_THK, k_THK, v_THV, g_TH, beta_TH, None, None)
    cu, _, _ = validate_indices(cu_seqlens, export_seq_E, export_pos_E, chunk_size, q_THK.shape[0])
    validate_tensors(q_THK, k_THK, v_THV, g_TH, beta_TH, initial_state_NHKV, cu.shape[0] - 1)


def prepare_layout(
    cu_seqlens, export_seq, export_pos, chunk_size: int, *, device: torch.device | str | None = None
) -> ChunkLayout:
    """Validate the indices of a call and build its layout, once for every layer that runs it.

    Args:
        cu_seqlens: [N+1] packed sequence offsets (int tensor or numpy array; host data).
        export_seq, export_pos: [E] export requests (as in `chunk_gated_delta_rule`).
        chunk_size: C.
        device: where the kernel's inputs will live (default CPU); the gather indices go there.
    """
    cu, seq, pos = validate_indices(cu_seqlens, export_seq, export_pos, chunk_size)
    layout = build_chunk_layout(cu, seq, pos, chunk_size)
    layout.source = (cu_seqlens, export_seq, export_pos)
    return layout.to(device or "cpu")


def build_chunk_layout(cu_seqlens, export_seq_E, export_pos_E, chunk_size: int) -> ChunkLayout:
    """Index tensors of one call, on the CPU (`prepare_layout` validates first; this does not).

    Args:
        cu_seqlens: [N+1] validated offsets (int tensor or numpy array).
        export_seq_E, export_pos_E: [E] validated export requests.
        chunk_size: C.
    """
    C = chunk_size
    cu = host_indices(cu_seqlens, "cu_seqlens")
    export_seq_E = host_indices(export_seq_E, "export_seq")
    export_pos_E = host_indices(export_pos_E, "export_pos")
    T = int(cu[-1])
    seq_start_N = cu[:-1]
    seq_len_N = cu[1:] - cu[:-1]
    n_chunks_N = (seq_len_N + C - 1) // C
    rank_to_seq_N = np.argsort(-n_chunks_N, kind="stable")  # most chunks first, ties in input order
    n_chunks_R = n_chunks_N[rank_to_seq_N]
    J = int(n_chunks_R[0])
    # active[j] = #sequences with more than j chunks: a reversed cumulative count.
    active = np.bincount(n_chunks_R, minlength=J + 1)[::-1].cumsum()[::-1][1:]
    off = np.cumsum(active) - active
    M = int(active.sum())

    chunk_j_M = np.repeat(np.arange(J), active)
    chunk_seq_M = rank_to_seq_N[np.arange(M) - off[chunk_j_M]]
    row_MC = (seq_start_N[chunk_seq_M] + chunk_j_M * C)[:, None] + np.arange(C)[None, :]
    valid_MC = row_MC < (seq_start_N + seq_len_N)[chunk_seq_M][:, None]
    gather_MC = np.where(valid_MC, row_MC, T)
    row_slot_T = np.empty(T, dtype=np.int64)
    row_slot_T[row_MC[valid_MC]] = np.arange(M * C).reshape(M, C)[valid_MC]

    seq_to_rank_N = np.empty_like(rank_to_seq_N)
    seq_to_rank_N[rank_to_seq_N] = np.arange(rank_to_seq_N.shape[0])
    export_chunks_E = (export_pos_E + C - 1) // C
    export_j_E = export_chunks_E - 1
    export_rank_E = seq_to_rank_N[export_seq_E]
    export_slot_E = off[export_j_E] + export_rank_E
    # Exports grouped by the step after which they are taken (ascending e within a step); the kernel
    # concatenates them step by step, export_order_E puts them back in request order.
    by_step_E = np.argsort(export_j_E, kind="stable")
    steps, starts = np.unique(export_j_E[by_step_E], return_index=True)
    parts = np.split(export_rank_E[by_step_E], starts[1:])
    export_order_E = np.empty_like(by_step_E)
    export_order_E[by_step_E] = np.arange(by_step_E.shape[0])
    # Triton indexing: each chunk slot's row range, and one export buffer row per distinct state.
    chunk_row_M = row_MC[:, 0]
    chunk_end_M = np.minimum(chunk_row_M + C, (seq_start_N + seq_len_N)[chunk_seq_M])
    export_rows_U, export_unique_E = np.unique(export_slot_E, return_inverse=True)
    export_row_M = np.full(M, -1, dtype=np.int64)
    export_row_M[export_rows_U] = np.arange(export_rows_U.shape[0])
    return ChunkLayout(
        chunk_size=C,
        cu_seqlens=cu,
        export_seq_E=export_seq_E,
        export_pos_E=export_pos_E,
        seq_len_N=seq_len_N,
        seq_start_N=seq_start_N,
        active_J=active.tolist(),
        chunk_off_J=off.tolist(),
        export_chunks_E=export_chunks_E,
        export_slot_E=export_slot_E,
        rank_to_seq_N=torch.from_numpy(rank_to_seq_N),
        gather_MC=torch.from_numpy(gather_MC),
        row_slot_T=torch.from_numpy(row_slot_T),
        export_ranks_J={int(j): torch.from_numpy(r) for j, r in zip(steps, parts)},
        export_adds_J={int(j): RowAdds.build(r) for j, r in zip(steps, parts)},
        export_order_E=torch.from_numpy(export_order_E),
        above_diag_CC=torch.ones(C, C, dtype=torch.bool).triu(1),
        chunk_row_M=torch.from_numpy(chunk_row_M.astype(np.int64)),
        chunk_end_M=torch.from_numpy(chunk_end_M.astype(np.int64)),
        chunk_off_t_J=torch.from_numpy(off.astype(np.int64)),
        rank_chunks_N=torch.from_numpy(n_chunks_R.astype(np.int64)),
        export_row_M=torch.from_numpy(export_row_M),
        export_unique_E=torch.from_numpy(export_unique_E.reshape(-1).astype(np.int64)),
        export_adds_U=RowAdds.build(export_unique_E.reshape(-1)),
        num_export_rows=int(export_rows_U.shape[0]),
        device=torch.device("cpu"),
    )
