"""Log-probs and entropies from final hidden states, without a [rows, vocab] fp32 tensor (the GPU head).

    logprob_P, entropy_P = chunked_logprobs(h_UD, W_VD, inv_P, label_P, chunk=8192, entropy=True)

The vocabulary in chunks of `chunk` columns with an online logsumexp, the backward recomputing each
chunk's logits, so the largest tensor is [U, chunk]; the CPU keeps the full head (`trainer.loss`),
and tests compare the two. The formulas: docs/design/execution.md ("The head").
Legend: U distinct rows, D hidden, V vocabulary, P log-prob entries, c a chunk of columns.
"""
from __future__ import annotations

import torch

#: default columns per chunk: [U, 8192] fp32 is 256 MB at U = 8,192 rows
DEFAULT_CHUNK = 8192


def _chunks(V: int, chunk: int):
    for c0 in range(0, V, chunk):
        yield c0, min(c0 + chunk, V)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_UD, w_VD, inv_P, label_P, chunk: int, want_entropy: bool):
        U, V = h_UD.shape[0], w_VD.shape[0]
        acc = torch.promote_types(h_UD.dtype, torch.float32)
        m_U = torch.full((U,), float("-inf"), dtype=acc, device=h_UD.device)
        s_U = torch.zeros(U, dtype=acc, device=h_UD.device)
        t_U = torch.zeros(U, dtype=acc, device=h_UD.device) if want_entropy else None
        label_logit_P = torch.zeros(label_P.shape[0], dtype=acc, device=h_UD.device)
        for c0, c1 in _chunks(V, chunk):
            logit_Uc = (h_UD @ w_VD[c0:c1].t()).to(acc)
            m_new = torch.maximum(m_U, logit_Uc.amax(-1))
            e_Uc = torch.exp(logit_Uc - m_new[:, None])
            scale = torch.exp(m_U - m_new)
            s_U = s_U * scale + e_Uc.sum(-1)
            if want_entropy:
                t_U = t_U * scale + (e_Uc * logit_Uc).sum(-1)
            m_U = m_new
            inside = (label_P >= c0) & (label_P < c1)
            picked = logit_Uc[inv_P, (label_P - c0).clamp(0, c1 - c0 - 1)]
            label_logit_P = torch.where(inside, picked, label_logit_P)
        lse_U = m_U + torch.log(s_U)
        mean_U = t_U / s_U if want_entropy else None  # E_p[logit]
        ctx.save_for_backward(h_UD, w_VD, inv_P, label_P, lse_U, *((mean_U,) if want_entropy else ()))
        ctx.chunk, ctx.want_entropy = chunk, want_entropy
        logprob_P = label_logit_P - lse_U.index_select(0, inv_P)
        entropy_P = (lse_U - mean_U).index_select(0, inv_P) if want_entropy else None
        return (logprob_P, entropy_P) if want_entropy else (logprob_P,)

    @staticmethod
    def backward(ctx, dlogprob_P, dentropy_P=None):
        h_UD, w_VD, inv_P, label_P, lse_U, *rest = ctx.saved_tensors
        mean_U = rest[0] if rest else None
        U, V = h_UD.shape[0], w_VD.shape[0]
        acc = lse_U.dtype
        a_U = torch.zeros(U, dtype=acc, device=h_UD.device).index_add_(0, inv_P, dlogprob_P.to(acc))
        b_U = None
        if mean_U is not None and dentropy_P is not None:
            b_U = torch.zeros(U, dtype=acc, device=h_UD.device).index_add_(0, inv_P, dentropy_P.to(acc))
        dh_UD = torch.zeros(h_UD.shape, dtype=acc, device=h_UD.device)
        dw_VD = torch.empty_like(w_VD)
        for c0, c1 in _chunks(V, ctx.chunk):
            w_c = w_VD[c0:c1]
            logit_Uc = (h_UD @ w_c.t()).to(acc)
            p_Uc = torch.exp(logit_Uc - lse_U[:, None])
            dl_Uc = p_Uc * (-a_U[:, None])
            if b_U is not None:
                dl_Uc = dl_Uc - b_U[:, None] * p_Uc * (logit_Uc - mean_U[:, None])
            inside = (label_P >= c0) & (label_P < c1)
            col = (label_P - c0).clamp(0, c1 - c0 - 1)
            dl_Uc.index_put_((inv_P, col), torch.where(inside, dlogprob_P.to(acc), 0.0), accumulate=True)
            dl = dl_Uc.to(h_UD.dtype)
            dh_UD += (dl @ w_c).to(acc)
            dw_VD[c0:c1] = dl.t() @ h_UD
        return dh_UD.to(h_UD.dtype), dw_VD, None, None, None, None


def chunked_logprobs(h_UD: torch.Tensor, w_VD: torch.Tensor, inv_P: torch.Tensor, label_P: torch.Tensor, *,
                     chunk: int = DEFAULT_CHUNK, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [P] (and entropies [P] when asked) in at least fp32, differentiable w.r.t. h and W.

    Args:
        h_UD: [U, D] final normed hidden states of the rows with log-prob entries.
        w_VD: [V, D] the lm head (or tied embedding) weight.
        inv_P, label_P: long [P] each entry's row in h and its token.
        chunk: vocabulary columns per step.
    """
    if chunk < 1:
        raise ValueError(f"chunk: expected >= 1 vocabulary columns, got {chunk}")
    out = _ChunkedHead.apply(h_UD, w_VD, inv_P, label_P, int(chunk), bool(entropy))
    return (out[0], out[1]) if entropy else (out[0], None)


def full_logprobs(logits_UV: torch.Tensor, inv_P: torch.Tensor, label_P: torch.Tensor, *, entropy: bool = False,
                  logsumexp=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: log-probs (and entropies) from materialised logits, in at least fp32.

    Args:
        logsumexp: the row-wise logsumexp (default torch's; `trainer.models.ops.Ops.logsumexp`)."""
    logits_UV = logits_UV.to(torch.promote_types(logits_UV.dtype, torch.float32))
    lse_U = torch.logsumexp(logits_UV, dim=-1) if logsumexp is None else logsumexp(logits_UV)
    logprob_P = logits_UV[inv_P, label_P] - lse_U[inv_P]
    entropy_P = None
    if entropy:
        p_UV = torch.softmax(logits_UV, dim=-1)
        entropy_P = (lse_U - (p_UV * logits_UV).sum(-1))[inv_P]
    return logprob_P, entropy_P


__all__ = ["DEFAULT_CHUNK", "chunked_logprobs", "full_logprobs"]
