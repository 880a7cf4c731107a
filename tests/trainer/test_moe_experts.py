"""`Experts.forward` (one gather, one index_add for all experts) against the per-expert reference."""
from __future__ import annotations

import pytest
import torch

from trainer.models.qwen3_next import Experts


@pytest.mark.parametrize("seed", range(5))
def test_experts_sorted_dispatch_bitwise_equals_per_expert_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    E, D, I, k = 8, 64, 32, 2
    ex = Experts(E, D, I)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(E, 2 * I, D, generator=gen) * 0.1)
        ex.down_proj.copy_(torch.randn(E, D, I, generator=gen) * 0.1)
    R = int(torch.randint(1, 200, (1,), generator=gen))
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    probs = torch.rand(R, E, generator=gen)
    if seed % 2:
        probs[:, : E // 2] += 1.0  # some experts unused
    w, idx = torch.topk(probs, k, dim=-1)
    w = w.requires_grad_()
    got, want = ex(x, idx, w), ex.forward_ref(x, idx, w)
    assert torch.equal(got, want)
    g = torch.randn(got.shape, generator=gen)
    for a, b in zip(torch.autograd.grad((got * g).sum(), (x, w, ex.gate_up_proj, ex.down_proj)),
                    torch.autograd.grad((want * g).sum(), (x, w, ex.gate_up_proj, ex.down_proj))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
