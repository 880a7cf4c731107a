"""Every named model config builds, runs a packed forward pass and gives finite logits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.executor import kernel_backend
from trainer.layout import layout_from_sequences
from trainer.models import NAMED_CONFIGS, RunOptions, build_model


@pytest.mark.parametrize("name", sorted(NAMED_CONFIGS))
def test_named_config_runs(name):
    model = build_model(name, seed=0)
    cfg = model.config
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, cfg.vocab_size, size=n) for n in (5, 19)]
    layout = layout_from_sequences(seqs, conv_kernel=cfg.linear_conv_kernel_dim, chunk_size=8)
    with torch.no_grad():
        h_RD = model(layout, RunOptions(linear_fn=kernel_backend("ref"), chunk_size=8)).hidden
    assert h_RD.shape == (24, cfg.hidden_size)
    assert torch.isfinite(model.logits(h_RD)).all()


def test_small_config_size():
    n = sum(p.numel() for p in build_model("small", seed=0).parameters())
    assert 4.5e6 < n < 5.0e6, n
