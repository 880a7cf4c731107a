"""The model's arithmetic primitives, chosen once per run: the CPU's batch-invariant forms or the GPU's.

    ops = select_ops(device, batch_invariant=False)     # EXACT on the CPU, FAST on CUDA
    y = ops.linear(x_RI, w_OI)                           # every module calls its primitives through ops
    h = ops.swiglu(gate, up)                             # and its elementwise chains

`EXACT` (the CPU: row-tiled GEMMs, `exp`-based activations, experts one by one: bitwise tree ==
expanded in fp32), `FAST` (CUDA: cuBLAS, torch's activations, grouped-GEMM experts; deterministic,
not batch-invariant), `compiled_ops()` (FAST with each elementwise chain fused by torch.compile),
`invariant_ops()` (CUDA's batch-invariant mode, `kernels.batch_invariant`).
Why each: docs/design/numerics.md. Legend: R rows, I input features, O output features.
"""
from __future__ import annotations

import dataclasses
import functools
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


def apply_rope(x_RHd: torch.Tensor, cos_Rr: torch.Tensor, sin_Rr: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head (rotate-half convention); cos/sin [R, rotary_dim]."""
    rd = cos_Rr.shape[-1]
    x_rot, x_pass = x_RHd[..., :rd], x_RHd[..., rd:]
    half = rd // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    x_rot = x_rot * cos_Rr[:, None, :] + rotated * sin_Rr[:, None, :]
    return torch.cat([x_rot, x_pass], dim=-1)


def _chains(sigmoid: Callable, silu: Callable, softplus: Callable, rms_norm: Callable,
            softmax: Callable) -> dict[str, Callable]:
    """The model's elementwise chains composed from one path's primitives (`Ops` fields of the same
    names): every path computes them in the same order, op by op."""

    def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu(gate) * up

    def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return sigmoid(gate) * x

    def gated_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, *, eps: float) -> torch.Tensor:
        out = rms_norm(x, w, eps=eps, zero_centered=False)
        return (out * silu(z.to(compute_dtype(z)))).to(x.dtype)

    def gdn_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
        beta = sigmoid(b)
        g = -A_log.to(compute_dtype(A_log)).exp() * softplus(a.to(compute_dtype(a)) + dt_bias)
        return beta, g

    def router(logits: torch.Tensor, *, top_k: int, norm: bool):
        probs = softmax(logits)
        top_w, top_i = torch.topk(probs, top_k, dim=-1)
        if norm:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_i, perm = torch.sort(top_i, dim=-1)
        return probs, top_w.gather(-1, perm).to(logits.dtype), top_i

    return dict(swiglu=swiglu, sigmoid_mul=sigmoid_mul, gated_norm=gated_norm, gdn_gates=gdn_gates, rope=apply_rope,
                router=router)


#: the `Ops` fields `compiled_ops()` fuses with torch.compile (the elementwise chains and norms)
CHAINS = ("rms_norm", "swiglu", "sigmoid_mul", "gated_norm", "gdn_gates", "rope", "router")

EXPERT_IMPLS = ("loop", "grouped")


@dataclass(frozen=True, slots=True, kw_only=True)
class Ops:
    """The primitives of one execution path: EXACT, FAST, `compiled_ops()` or `invariant_ops()`
    (docs/design/numerics.md)."""

    name: str
    """"exact", "fast", "compiled" or "invariant"."""
    invariant: bool
    """Every row's results are independent of the other rows (the MoE combine then sums a row's
    experts one by one in ascending order: `trainer.models.moe.combine`)."""
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
    swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate, up) -> silu(gate) * up (the MLPs and experts)."""
    sigmoid_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """(gate, x) -> sigmoid(gate) * x (attention's output gate, the shared expert's gate)."""
    gated_norm: Callable[..., torch.Tensor]
    """(x, z, w, *, eps) -> rms_norm(x, w) * silu(z) in at least fp32, in x's dtype (Gated DeltaNet's
    output norm)."""
    gdn_gates: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    """(b, a, A_log, dt_bias) -> (beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)), g in at
    least fp32 (Gated DeltaNet's gates)."""
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    """(x [R, H, hd], cos, sin [R, rotary_dim]) -> x rotated (`apply_rope`)."""
    router: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """(logits [R, E], *, top_k, norm) -> (probs [R, E] = softmax in at least fp32, the top-k weights
    [R, k] in the logits' dtype (normalised to sum 1 when `norm`), their experts [R, k] ascending,
    the weights permuted with them) (the MoE router)."""
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


def _ops(*, sigmoid: Callable, silu: Callable, softplus: Callable, rms_norm: Callable, softmax: Callable,
         **fields) -> Ops:
    return Ops(sigmoid=sigmoid, silu=silu, softplus=softplus, rms_norm=rms_norm, softmax=softmax,
               **_chains(sigmoid, silu, softplus, rms_norm, softmax), **fields)


EXACT = _ops(name="exact", invariant=True, linear=row_linear, sigmoid=exp_sigmoid, silu=exp_silu,
             softplus=exp_softplus, rms_norm=rms_norm, logsumexp=logsumexp, softmax=softmax, experts="loop")
FAST = _ops(name="fast", invariant=False, linear=F.linear, sigmoid=torch.sigmoid, silu=F.silu,
            softplus=torch_softplus, rms_norm=rms_norm, logsumexp=logsumexp, softmax=softmax, experts="grouped",
            group_align=8)

@functools.cache
def compiled_ops() -> Ops:
    """FAST with each elementwise chain (`CHAINS`) fused by `torch.compile(dynamic=True,
    fullgraph=True)`: one generated kernel per chain forward and one per backward instead of a
    launch per op; row counts symbolic, so a new microbatch size does not recompile. The first
    call of each chain compiles (seconds); the process's later calls and models reuse it. Not
    batch-invariant, like FAST; deterministic (no atomics in pointwise or row-wise kernels)."""
    fused = {name: torch.compile(getattr(FAST, name), dynamic=True, fullgraph=True) for name in CHAINS}
    return dataclasses.replace(FAST, name="compiled", **fused)


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

    return _ops(name="invariant", invariant=True, linear=linear, sigmoid=torch.sigmoid, silu=F.silu,
                softplus=torch_softplus, rms_norm=bi.rms_norm, logsumexp=bi.logsumexp, softmax=softmax_, experts="loop")


def select_ops(device: torch.device | str, *, batch_invariant: bool = False, compiled: bool = False) -> Ops:
    """The primitives of a run on `device`: EXACT on the CPU; on CUDA FAST (`compiled`: its chains
    fused, `compiled_ops()`), or the batch-invariant ones (which `compiled` leaves as they are)."""
    if torch.device(device).type == "cpu":
        return EXACT
    if batch_invariant:
        return invariant_ops()
    return compiled_ops() if compiled else FAST


__all__ = ["Ops", "EXACT", "FAST", "CHAINS", "ROW_TILE", "EXPERT_IMPLS", "apply_rope", "compiled_ops", "invariant_ops",
           "row_linear", "row_linear_ref", "select_ops", "rms_norm", "logsumexp", "softmax", "exp_sigmoid", "exp_silu",
           "exp_softplus"]
