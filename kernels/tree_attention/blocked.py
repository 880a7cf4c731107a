"""Exact tree attention on the CPU, flash-style: bounded working set, no score tensor kept.

    o_RHd = tree_attention(q_RHd, k_NHd, v_NHd, layout, scale=hd ** -0.5, backend="blocked")

Key blocks of exactly BLOCK_K keys at fixed depths, query blocks padded to at least MIN_ROWS
rows, a backward that recomputes the scores from the saved log-sum-exp; a tree row gets the bits
of its expanded trajectory (docs/design/execution.md, "Tree attention"; docs/design/numerics.md).
Legend: R query rows, N key-table rows (local rows, then imported ones), H heads, Hkv kv heads,
G = H / Hkv, hd head dim, M = G x queries of a block (padded), K keys of a key block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.row_adds import RowAdds

#: query rows per block (of one segment).
BLOCK_Q = 128
#: keys per key block; every P @ V product reduces over exactly this many keys.
BLOCK_K = 128
#: least GEMM rows of a block (fewer rows take another GEMM path with other bits).
MIN_ROWS = 16


@dataclass(slots=True, kw_only=True)
class _Block:
    q0: int
    """First query row."""
    n: int
    """Query rows."""
    n_keys: int
    """Keys the block reads (its last query's visible keys), rounded up to a BLOCK_K multiple."""
    first_visible: int
    """Keys visible to its first query (key blocks before this one need no mask)."""
    visible: torch.Tensor
    """long [n] keys visible to each query (ancestors, then own rows up to itself)."""


@dataclass(slots=True, kw_only=True)
class _Segment:
    kv: torch.Tensor
    """long [n_keys of its last block] key-table rows in depth order; N = zero padding."""
    kv_adds: RowAdds
    """Adds the segment's key gradients (all but the padding: distinct rows) into the key table."""
    blocks: list[_Block]


@dataclass(slots=True, kw_only=True)
class AttentionPlan:
    """Query blocks and key rows of every segment of a microbatch (built once, used by every layer)."""

    num_rows: int
    num_kv_rows: int
    segments: list[_Segment]

    def to(self, device: torch.device | str) -> "AttentionPlan":
        for s in self.segments:
            s.kv = s.kv.to(device)
            s.kv_adds = s.kv_adds.to(device)
            for b in s.blocks:
                b.visible = b.visible.to(device)
        return self


def attention_plan(layout) -> AttentionPlan:
    """Query blocks and key rows of every segment of a `TreeLayout` (built once per microbatch)."""
    ix = layout.index
    N = int(layout.num_kv_rows)
    starts, lens = ix.seg_start_S.tolist(), ix.seg_len_S.tolist()
    offs, ranges = ix.attn_offsets_S1.tolist(), ix.attn_ranges_n2.numpy()
    segments = []
    for s in sorted(range(len(starts)), key=starts.__getitem__):
        a, L = starts[s], lens[s]
        anc = [np.arange(lo, hi) for lo, hi in ranges[offs[s] : offs[s + 1]]]
        kv = np.concatenate(anc + [np.arange(a, a + L)]).astype(np.int64)
        n_anc = kv.shape[0] - L
        blocks = []
        for off in range(0, L, BLOCK_Q):
            n = min(BLOCK_Q, L - off)
            vis = n_anc + off + 1 + np.arange(n)
            blocks.append(_Block(q0=a + off, n=n, n_keys=-(-int(vis[-1]) // BLOCK_K) * BLOCK_K,
                                 first_visible=int(vis[0]), visible=torch.from_numpy(vis)))
        pad = blocks[-1].n_keys - kv.shape[0]
        adds = RowAdds.build(kv)
        kv = np.concatenate([kv, np.full(pad, N, np.int64)])
        segments.append(_Segment(kv=torch.from_numpy(kv), kv_adds=adds, blocks=blocks))
    plan = AttentionPlan(num_rows=int(layout.num_rows), num_kv_rows=N, segments=segments)
    return plan.to(layout.device) if layout.device.type != "cpu" else plan


def _group(x_nHd: torch.Tensor, Hkv: int, rows: int) -> torch.Tensor:
    """[n, H, hd] -> [Hkv, G * rows, hd] (query heads of one kv head folded into the rows; rows >= n
    zero-padded)."""
    n, H, hd = x_nHd.shape
    G = H // Hkv
    if rows > n:
        x_nHd = torch.cat([x_nHd, x_nHd.new_zeros(rows - n, H, hd)])
    return x_nHd.reshape(rows, Hkv, G, hd).permute(1, 2, 0, 3).reshape(Hkv, G * rows, hd)


def _ungroup(x_HkvMd: torch.Tensor, n: int, rows: int) -> torch.Tensor:
    """Inverse of `_group`: [Hkv, G * rows, d] -> [n, H, d]."""
    Hkv, M, d = x_HkvMd.shape
    G = M // rows
    return x_HkvMd.reshape(Hkv, G, rows, d).permute(2, 0, 1, 3).reshape(rows, Hkv * G, d)[:n]


def _rows(n: int, G: int) -> int:
    return max(n, -(-MIN_ROWS // G))


def _scores(q_g, k_seg, s0: int, b: _Block, vis_M: torch.Tensor, scale: float) -> torch.Tensor:
    """[Hkv, M, BLOCK_K] scores of keys s0..s0+BLOCK_K (depth positions), masked where hidden."""
    s = torch.bmm(q_g, k_seg[:, s0 : s0 + BLOCK_K].transpose(1, 2)).mul_(scale)
    if s0 + BLOCK_K > b.first_visible:  # the block's causal edge (or its padding) lies in this key block
        pos = torch.arange(s0, s0 + BLOCK_K, device=q_g.device)
        s.masked_fill_(pos[None, None, :] >= vis_M[None, :, None], float("-inf"))
    return s


class _TreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_RHd, k_NHd, v_NHd, plan: AttentionPlan, scale: float):
        R, H, hd = q_RHd.shape
        Hkv = k_NHd.shape[1]
        G = H // Hkv
        dt = torch.promote_types(q_RHd.dtype, torch.float32)
        q = q_RHd.to(dt)
        zero = q.new_zeros(1, Hkv, hd)
        k_t = torch.cat([k_NHd.to(dt), zero]).transpose(0, 1)  # [Hkv, N+1, hd]
        ones = q.new_ones(k_NHd.shape[0] + 1, Hkv, 1)
        v_t = torch.cat([torch.cat([v_NHd.to(dt), zero]), ones], dim=-1).transpose(0, 1)  # [Hkv, N+1, hd+1]
        o_RHd = q.new_empty(R, H, hd)
        lse_RH = q.new_empty(R, H)
        for seg in plan.segments:
            k_seg = k_t.index_select(1, seg.kv)  # [Hkv, Lk, hd]: the segment's keys, once
            v_seg = v_t.index_select(1, seg.kv)
            for b in seg.blocks:
                rows = _rows(b.n, G)
                q_g = _group(q[b.q0 : b.q0 + b.n], Hkv, rows)
                vis = torch.cat([b.visible, b.visible.new_ones(rows - b.n)]).repeat(G)  # [M]
                m = acc = None
                for s0 in range(0, b.n_keys, BLOCK_K):
                    s = _scores(q_g, k_seg, s0, b, vis, scale)
                    m_new = s.amax(dim=-1) if m is None else torch.maximum(m, s.amax(dim=-1))
                    p = s.sub_(m_new[..., None]).exp_()
                    part = torch.bmm(p, v_seg[:, s0 : s0 + BLOCK_K])  # [Hkv, M, hd+1]
                    acc = part if acc is None else acc.mul_((m - m_new).exp_()[..., None]).add_(part)
                    m = m_new
                sl = slice(b.q0, b.q0 + b.n)
                o_RHd[sl] = _ungroup(acc[..., :hd] / acc[..., hd:], b.n, rows)
                lse_RH[sl] = _ungroup((m + acc[..., hd].log())[..., None], b.n, rows)[..., 0]
        ctx.save_for_backward(q_RHd, k_NHd, v_NHd, o_RHd, lse_RH)
        ctx.plan, ctx.scale = plan, scale
        return o_RHd.to(q_RHd.dtype)

    @staticmethod
    def backward(ctx, do_RHd):
        q_RHd, k_NHd, v_NHd, o_RHd, lse_RH = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        R, H, hd = q_RHd.shape
        N, Hkv = k_NHd.shape[0], k_NHd.shape[1]
        G = H // Hkv
        dt = o_RHd.dtype
        q, do = q_RHd.to(dt), do_RHd.to(dt)
        zero = q.new_zeros(1, Hkv, hd)
        k_t = torch.cat([k_NHd.to(dt), zero]).transpose(0, 1)  # [Hkv, N+1, hd]
        v_t = torch.cat([v_NHd.to(dt), zero]).transpose(0, 1)
        delta_RH = (do * o_RHd).sum(-1)
        dq = torch.empty_like(q)
        dk_t = q.new_zeros(Hkv, N + 1, hd)
        dv_t = q.new_zeros(Hkv, N + 1, hd)
        for seg in plan.segments:
            k_seg = k_t.index_select(1, seg.kv)
            v_seg = v_t.index_select(1, seg.kv)
            dk_seg = torch.zeros_like(k_seg)
            dv_seg = torch.zeros_like(v_seg)
            for b in seg.blocks:
                rows = _rows(b.n, G)
                sl = slice(b.q0, b.q0 + b.n)
                q_g = _group(q[sl], Hkv, rows)
                do_g = _group(do[sl], Hkv, rows)
                lse_g = _group(lse_RH[sl][..., None], Hkv, rows)[..., 0]  # [Hkv, M]
                delta_g = _group(delta_RH[sl][..., None], Hkv, rows)[..., 0]
                vis = torch.cat([b.visible, b.visible.new_ones(rows - b.n)]).repeat(G)
                dq_g = torch.zeros_like(q_g)
                for s0 in range(0, b.n_keys, BLOCK_K):
                    ks = slice(s0, s0 + BLOCK_K)
                    p = _scores(q_g, k_seg, s0, b, vis, scale).sub_(lse_g[..., None]).exp_()  # [Hkv, M, K]
                    dv_seg[:, ks] += torch.bmm(p.transpose(1, 2), do_g)
                    dp = torch.bmm(do_g, v_seg[:, ks].transpose(1, 2))
                    ds = p.mul_(dp.sub_(delta_g[..., None])).mul_(scale)
                    dq_g += torch.bmm(ds, k_seg[:, ks])
                    dk_seg[:, ks] += torch.bmm(ds.transpose(1, 2), q_g)
                dq[sl] = _ungroup(dq_g, b.n, rows)
            seg.kv_adds.apply_(dk_t, dk_seg, dim=1)
            seg.kv_adds.apply_(dv_t, dv_seg, dim=1)
        dk = dk_t[:, :N].transpose(0, 1).to(k_NHd.dtype)
        dv = dv_t[:, :N].transpose(0, 1).to(v_NHd.dtype)
        return dq.to(q_RHd.dtype), dk, dv, None, None


def tree_attention_blocked(q_RHd: torch.Tensor, k_NHd: torch.Tensor, v_NHd: torch.Tensor, layout, scale: float) -> torch.Tensor:
    """The "blocked" backend: `fn(q, k, v, layout, scale)` of `kernels.tree_attention` (docs/design/execution.md, "Tree attention").

    Args:
        q_RHd: [R, H, hd] queries (RoPE applied). k_NHd, v_NHd: [N, Hkv, hd] the key table: the
            R local rows, then any imported rows (sharing windows).
        layout: the microbatch's `TreeLayout`.
    Returns:
        [R, H, hd] in q's dtype (computed in at least fp32).
    """
    return _TreeAttention.apply(q_RHd, k_NHd, v_NHd, layout.plan("blocked", attention_plan), float(scale))
