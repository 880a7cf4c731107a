"""trainer.models.state_dict_adapter: our names <-> the Hugging Face Qwen3-Next checkpoint's, both ways,
and row slices that read only what a shard covers (the seam meta-device loading uses)."""
from __future__ import annotations

import pytest
import torch

from trainer.models import Qwen3NextForRL, debugmodel
from trainer.models.state_dict_adapter import StateDictAdapter


def _model(tied: bool) -> Qwen3NextForRL:
    cfg = debugmodel()
    cfg.tie_word_embeddings = tied
    model = Qwen3NextForRL(cfg)
    model.init_weights(3)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_to_hf_then_from_hf_is_the_identity(tied):
    model = _model(tied)
    adapter = StateDictAdapter(model.config)
    ours = model.state_dict()
    hf = adapter.to_hf(ours)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in hf and "model.layers.0.mlp.experts.gate_up_proj" not in hf
    assert ("lm_head.weight" in hf) is not tied
    back = adapter.from_hf({**hf, "mtp.layers.0.weight": torch.zeros(1)})  # mtp.* is ignored
    assert sorted(back) == sorted(ours)
    for k, v in ours.items():
        assert torch.equal(back[k], v), k


def test_read_rows_equals_the_slice_of_the_whole_tensor_in_both_expert_layouts():
    model = _model(False)
    adapter = StateDictAdapter(model.config)
    ours = model.state_dict()
    per_expert = adapter.to_hf(ours)
    for source in (per_expert, ours):  # the checkpoint layout, and transformers v5's stacked layout
        for name, full in ours.items():
            n = full.shape[0]
            for rows in (slice(0, n), slice(1, min(3, n)), slice(n - 1, n)):
                assert torch.equal(adapter.read(name, source, rows), full[rows]), (name, rows)


def test_a_missing_tensor_is_named():
    model = _model(False)
    adapter = StateDictAdapter(model.config)
    hf = adapter.to_hf(model.state_dict())
    del hf["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight: expected in the checkpoint"):
        adapter.from_hf(hf)
