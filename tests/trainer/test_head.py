"""The chunked log-prob head (`trainer.models.head`) against the full head, values and gradients."""
from __future__ import annotations

import pytest
import torch

from trainer.models.head import chunked_logprobs, full_logprobs


def _case(seed: int, dtype=torch.float64, U=13, D=24, V=101, P=40):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(U, D, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(V, D, generator=gen, dtype=dtype, requires_grad=True)
    inv = torch.randint(0, U, (P,), generator=gen)
    label = torch.randint(0, V, (P,), generator=gen)
    label[:5] = label[5]  # several entries on one (row, label): trajectories through the same row
    inv[:5] = inv[5]
    return h, w, inv, label, gen


@pytest.mark.parametrize("chunk", [1, 7, 32, 101, 4096], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("entropy", [False, True], ids=["logprob", "logprob+entropy"])
def test_chunked_head_matches_full_head(chunk, entropy):
    h, w, inv, label, gen = _case(0)
    got_lp, got_ent = chunked_logprobs(h, w, inv, label, chunk=chunk, entropy=entropy)
    want_lp, want_ent = full_logprobs(h @ w.t(), inv, label, entropy=entropy)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-12, atol=1e-12)
    gl = torch.randn(got_lp.shape, generator=gen, dtype=h.dtype)
    loss_got, loss_want = (got_lp * gl).sum(), (want_lp * gl).sum()
    if entropy:
        torch.testing.assert_close(got_ent, want_ent, rtol=1e-12, atol=1e-12)
        ge = torch.randn(got_ent.shape, generator=gen, dtype=h.dtype)
        loss_got, loss_want = loss_got + (got_ent * ge).sum(), loss_want + (want_ent * ge).sum()
    for a, b in zip(torch.autograd.grad(loss_got, (h, w)), torch.autograd.grad(loss_want, (h, w))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_chunked_head_gradcheck():
    h, w, inv, label, _ = _case(1, U=4, D=5, V=9, P=7)
    assert torch.autograd.gradcheck(lambda a, b: chunked_logprobs(a, b, inv, label, chunk=4, entropy=True), (h, w))


def test_chunked_head_fp32_and_no_entries():
    h, w, inv, label, _ = _case(2, dtype=torch.float32)
    got, _ = chunked_logprobs(h, w, inv, label, chunk=16)
    want, _ = full_logprobs(h @ w.t(), inv, label)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    empty = torch.zeros(0, dtype=torch.long)
    lp, _ = chunked_logprobs(h[:0], w, empty, empty, chunk=16)
    assert lp.shape == (0,)
    with pytest.raises(ValueError, match="chunk: expected >= 1"):
        chunked_logprobs(h, w, inv, label, chunk=0)
