"""trainer.optim: the trainer's AdamW runs on torch's fused kernel and makes the same update as the
default (for-loop) AdamW up to rounding."""
from __future__ import annotations

import copy

import torch

from trainer.models import build_model
from trainer.optim import make_optimizer


def test_fused_adamw_matches_the_default_update():
    model = build_model("tiny", seed=0)
    twin = copy.deepcopy(model)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    fused = make_optimizer(model.parameters(), **kw)
    plain = torch.optim.AdamW(twin.parameters(), **kw)
    assert fused.defaults["fused"] is True and not plain.defaults.get("fused")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(model.parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name
