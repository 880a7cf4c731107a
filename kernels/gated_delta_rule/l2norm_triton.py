"""Triton L2 normalisation over the last dim, forward and backward (the gated delta rule's q/k norm).

    y = x rsqrt(sum(x^2) + eps)          dx = rstd (dy - y sum(y dy))

exactly `recurrent_ref.l2norm` (transformers' and fla's form). One program per BR rows; a row (D <= BD
columns) is one tile.

Legend: R rows (T * H), D row length; tiles: BR rows, BD >= D columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gated_delta_rule.recurrent_ref import L2NORM_EPS
from kernels.triton_tuning import autotune, stages


@autotune(stages(4, (2,)), key=["D"])
@triton.jit
def _l2norm_fwd_kernel(x, y, rstd, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, EPS: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BR
    x += row0 * D
    y += row0 * D
    rstd += row0
    o_r = tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < R - row0
    m = m_r[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    # [BR, BD]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    # [BR]
    b_r = tl.rsqrt(tl.sum(b_x * b_x, axis=1) + EPS)
    tl.store(y + p, (b_x * b_r[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + o_r, b_r, mask=m_r)


@autotune(stages(4, (2,)), key=["D"])
@triton.jit
def _l2norm_bwd_kernel(y, rstd, dy, dx, R, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    row0 = tl.program_id(0).to(tl.int64) * BR
    y += row0 * D
    dy += row0 * D
    dx += row0 * D
    rstd += row0
    o_r = tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m_r = o_r < R - row0
    m = m_r[:, None] & (o_d < D)[None, :]
    p = o_r[:, None] * D + o_d[None, :]
    # [BR, BD]
    b_y = tl.load(y + p, mask=m, other=0.0).to(tl.float32)
    b_dy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    # [BR]
    b_r = tl.load(rstd + o_r, mask=m_r, other=0.0)
    b_dx = b_r[:, None] * (b_dy - b_y * tl.sum(b_y * b_dy, axis=1)[:, None])
    tl.store(dx + p, b_dx.to(dx.dtype.element_ty), mask=m)


def _block_rows(D: int) -> tuple[int, int]:
    BD = max(16, triton.next_power_of_2(D))
    return max(1, min(16, 2048 // BD)), BD


def l2norm_fwd(x: torch.Tensor, empty) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): x [..., D] normalised in x's dtype, and the fp32 reciprocal norms [numel / D].

    `empty(shape, dtype, device)` allocates the outputs (tests poison them)."""
    D = x.shape[-1]
    x = x.contiguous()
    R = x.numel() // D
    y = empty(tuple(x.shape), x.dtype, x.device)
    rstd = empty((R,), torch.float32, x.device)
    BR, BD = _block_rows(D)
    if R:
        _l2norm_fwd_kernel[(triton.cdiv(R, BR),)](x=x, y=y, rstd=rstd, R=R, D=D, BR=BR, BD=BD, EPS=L2NORM_EPS)
    return y, rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, dtype: torch.dtype, empty) -> torch.Tensor:
    """dx [..., D] in `dtype` from the saved y, rstd (`l2norm_fwd`) and the gradient dy on y."""
    D = y.shape[-1]
    R = y.numel() // D
    dx = empty(tuple(y.shape), dtype, y.device)
    BR, BD = _block_rows(D)
    if R:
        _l2norm_bwd_kernel[(triton.cdiv(R, BR),)](y=y, rstd=rstd, dy=dy.contiguous(), dx=dx, R=R, D=D, BR=BR, BD=BD)
    return dx
