"""Parity of trainer.models with transformers' Qwen3-Next on the same weights (docs/design/execution.md)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

sys.modules.setdefault("fla", None)  # transformers must not bind fla's GPU kernels on CPU

from kernels.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from trainer import tree_ops  # noqa: E402
from trainer.layout import layout_from_sequences  # noqa: E402
from kernels.tree_attention import tree_attention  # noqa: E402
from trainer.models import ModelConfig, RunOptions, debugmodel, debugmodel_dense, load_model  # noqa: E402
from trainer.models.loading import build_model  # noqa: E402
from trainer.models.ops import row_linear, row_linear_ref  # noqa: E402

transformers = pytest.importorskip("transformers")



def _save_random_hf(cfg: ModelConfig, path, seed: int = 0) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    hf = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**cfg.to_hf_dict())).float().eval()
    with torch.no_grad():  # HF initialises norms to exactly 0/1: perturb so that they matter
        for name, p in hf.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("cfg", [debugmodel(), debugmodel_dense()], ids=["tiny-moe", "tiny-dense"])
def test_logits_match_transformers(cfg, tmp_path):
    hf = _save_random_hf(cfg, tmp_path)
    model = load_model(tmp_path)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (70, 5, 33, 1)]
    layout = layout_from_sequences(seqs, conv_kernel=cfg.linear_conv_kernel_dim, chunk_size=16)
    with torch.no_grad():
        logits = model.logits(model(layout, RunOptions(linear_fn=chunk_gated_delta_rule, chunk_size=16)).hidden)
        off = 0
        for s in seqs:
            ref = hf(s[None]).logits[0]
            diff = (ref - logits[off : off + len(s)]).abs().max().item()
            assert diff <= 1e-4, f"trajectory of length {len(s)}: max abs logit diff {diff}"
            off += len(s)


def test_load_rejects_non_qwen3_next(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="model_type: expected 'qwen3_next', got 'llama'"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="expected a Hugging Face Qwen3-Next checkpoint with config.json"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="--model: expected one of"):
        build_model(str(tmp_path / "nowhere"))


def test_load_rejects_capacity_factor_and_missing_weights(tmp_path):
    doc = debugmodel().to_hf_dict()
    (tmp_path / "config.json").write_text(json.dumps({**doc, "capacity_factor": 1.25}))
    with pytest.raises(ValueError, match="capacity_factor: expected none"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="expected \\*.safetensors weights"):
        load_model(tmp_path)
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.zeros(64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path)


def test_row_linear_is_batch_invariant_and_matches_reference():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    x = torch.randn(300, 64, generator=gen)
    full = row_linear(x, w)
    torch.testing.assert_close(full, row_linear_ref(x, w), rtol=1e-5, atol=1e-5)
    for start, n in [(0, 1), (5, 3), (17, 40), (100, 200)]:
        assert torch.equal(row_linear(x[start : start + n], w), full[start : start + n])


def test_ancestry_conv_matches_conv1d():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    layout = layout_from_sequences([list(range(20))], conv_kernel=4, chunk_size=8)
    got = tree_ops.ancestry_conv(x, w, layout.conv_src)
    torch.testing.assert_close(got, tree_ops.causal_conv_ref(x, w), rtol=1e-6, atol=1e-6)


def test_tree_attention_matches_dense_reference():
    gen = torch.Generator().manual_seed(0)
    L = 70
    q, k, v = torch.randn(L, 4, 16, generator=gen), torch.randn(L, 2, 16, generator=gen), torch.randn(L, 2, 16, generator=gen)
    lay = layout_from_sequences([list(range(L))], conv_kernel=4, chunk_size=16)
    full = tree_attention(q, k, v, lay.attention, scale=0.25, backend="blocked")
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * 0.25
    p = torch.softmax(s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf")), dim=-1)
    torch.testing.assert_close(full, torch.einsum("hqk,khd->qhd", p, vv), rtol=1e-5, atol=1e-6)