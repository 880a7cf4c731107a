"""The trainer's optimizer: AdamW on torch's fused kernel (one kernel per parameter, CPU and CUDA).

torch's default AdamW runs a Python loop of a dozen tensor ops per parameter; the fused one does the
same update (up to rounding) in one kernel. Measured on this machine's CPU for the `small` model
(66 parameters, 4.7M values, one thread): 15.1 ms per step by default, 8.7 ms with foreach, 2.5 ms
fused. The step is a fixed cost per optimizer step whatever the batch, so it weighs most on
compressed (tree) steps. Every caller that steps the model's weights builds it here, so training,
the demo, the benchmarks and the tests that compare against a training run update weights the same way.
"""
from __future__ import annotations

import torch


def make_optimizer(params, *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW over `params` with the fused implementation (weight decay decoupled, as in AdamW)."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
