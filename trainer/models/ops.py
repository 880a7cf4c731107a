"""The model's arithmetic primitives, chosen once per run: the CPU's batch-invariant forms or the GPU's.

    ops = select_ops(device, batch_invariant=False)     # EXACT on the CPU, FAST on CUDA
    y = ops.linear(x_RI, w_OI)                           # every module calls its primitives through ops

`EXACT` (the CPU: row-tiled GEMMs, `exp`-based activations, experts one by one: bitwise tree ==
expanded in fp32), `FAST` (CUDA: cuBLAS, torch's activations, grouped-GEMM experts; deterministic,
not batch-invariant), `invariant_ops()` (CUDA's batch-invariant mode, `kernels.batch_invariant`).
Why each: docs/design/numerics.md. Legend: R rows, I input features, O output features.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.dtypes import compute_dtype

#: rows per tile of row_linear; every tile is one same-shape GEMM.
ROW_TILE = 32


def row_linear(x_RI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T + b`, batch-invariant on the CPU: each row's result is independent of the other rows.

    Pads the rows to a multiple of ROW_TILE and runs one GEMM over them (the same kernel as a
    matmul of [ROW_TILE, I] tiles, which torch folds into it); the padded row count keeps the CPU
    GEMM's blocking independent of R. Without padding the result is the GEMM's output itself.
    """
    R = x_RI.shape[0]
    pad = (-R) % ROW_TILE
    y_PO = torch.mm(F.pad(x_RI, (0, 0, 0, pad)) if pad else x_RI.contiguous(), w_OI.t())
    y_RO = y_PO[:R] if pad else y_PO
    return y_RO if b_O is None else y_RO + b_O


def row_linear_ref(x_RI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None) -> torch.Tensor:
    """Plain reference of `row_linear` (not batch-invariant)."""
    return F.linear(x_RI, w_OI, b_O)


def exp_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)): unlike torch.sigmoid on the CPU, bitwise the same wherever x sits in the tensor."""
    return 1.0 / (1.0 + torch.exp(-x))


def exp_silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), position-independent on the CPU (torch's silu rounds its vector body and tail differently)."""
    return x / (1.0 + torch.exp(-x))


def exp_softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)) with torch's threshold of 20, position-independent on the CPU."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp_max(20.0))))


def torch_softplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x, beta=1.0, threshold=20.0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, zero_centered: bool) -> torch.Tensor:
    """RMSNorm over the last dim, x / rms(x) in at least fp32 (`compute_dtype`), in x's dtype:
    `x_hat (1 + w)` (zero_centered: the decoder's norms) or `w x_hat` with x_hat rounded to x's dtype
    first (the Gated DeltaNet output norm, before its gate)."""
    xf = x.to(compute_dtype(x))
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (x_hat * (1.0 + weight.to(x_hat.dtype))).type_as(x)
    return weight * x_hat.to(x.dtype)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(x))) over the last dim, in x's dtype (the head casts logits to at least fp32 first)."""
    return torch.logsumexp(x, dim=-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax of the last dim in at least fp32."""
    return torch.softmax(x, dim=-1, dtype=compute_dtype(x))


EXPERT_IMPLS = ("loop", "grouped")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ops:
    """The primitives of one execution path: EXACT, FAST or `invariant_ops()` (docs/design/numerics.md)."""

    name: str
    """"exact", "fast" or "invariant"."""
    linear: Callable[..., torch.Tensor]
    """(x [R, I], w [O, I], b [O] | None) -> [R, O]."""
    sigmoid: Callable[[torch.Tensor], torch.Tensor]
    silu: Callable[[torch.Tensor], torch.Tensor]
    softplus: Callable[[torch.Tensor], torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    """(x [..., n], w [n], *, eps, zero_centered) -> normalised x in x's dtype (`rms_norm`)."""
    logsumexp: Callable[[torch.Tensor], torch.Tensor]
    """Row-wise logsumexp of the last dim (the full head's)."""
    softmax: Callable[[torch.Tensor], torch.Tensor]
    """Softmax of the last dim in at least fp32 (the router)."""
    experts: str
    """Routed experts: "loop" (expert by expert through `linear`; one host read of the counts per
    MoE layer) or "grouped" (grouped GEMMs, counts stay on the device; bf16 on CUDA)."""
    group_align: int = 1
    """Rows each expert's group is padded to a multiple of in the expert-sorted buffer (grouped
    GEMMs read each group at a 16-byte aligned row offset: 8 rows of bf16)."""

    def __post_init__(self) -> None:
        if self.experts not in EXPERT_IMPLS:
            raise ValueError(f"experts: expected one of {EXPERT_IMPLS}, got {self.experts!r}")
        if self.group_align < 1:
            raise ValueError(f"group_align: expected >= 1, got {self.group_align}")


EXACT = Ops(name="exact", linear=row_linear, sigmoid=exp_sigmoid, silu=exp_silu, softplus=exp_softplus,
            rms_norm=rms_norm, logsumexp=logsumexp, softmax=softmax, experts="loop")
FAST = Ops(name="fast", linear=F.linear, sigmoid=torch.sigmoid, silu=F.silu, softplus=torch_softplus,
           rms_norm=rms_norm, logsumexp=logsumexp, softmax=softmax, experts="grouped", group_align=8)


def invariant_ops() -> Ops:
    """The batch-invariant GPU primitives (`kernels.batch_invariant`): fixed-tile GEMMs without
    split-K, row-wise norms, softmax and logsumexp whose reduction order depends on the row length
    only; torch's elementwise CUDA kernels already give every element the same bits wherever it sits.
    Routed experts run expert by expert through the same GEMM."""
    from kernels import batch_invariant as bi

    def linear(x_RI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None) -> torch.Tensor:
        y = bi.linear(x_RI, w_OI.to(x_RI.dtype))
        return y if b_O is None else y + b_O

    def softmax_(x: torch.Tensor) -> torch.Tensor:
        return bi.softmax(x, dtype=compute_dtype(x))

    return Ops(name="invariant", linear=linear, sigmoid=torch.sigmoid, silu=F.silu, softplus=torch_softplus,
               rms_norm=bi.rms_norm, logsumexp=bi.logsumexp, softmax=softmax_, experts="loop")


def select_ops(device: torch.device | str, *, batch_invariant: bool = False) -> Ops:
    """The primitives of a run on `device`: EXACT on the CPU; on CUDA FAST, or the batch-invariant ones."""
    if torch.device(device).type == "cpu":
        return EXACT
    return invariant_ops() if batch_invariant else FAST


__all__ = ["Ops", "EXACT", "FAST", "ROW_TILE", "EXPERT_IMPLS", "invariant_ops", "row_linear", "row_linear_ref",
           "select_ops", "rms_norm", "logsumexp", "softmax", "exp_sigmoid", "exp_silu", "exp_softplus"]
