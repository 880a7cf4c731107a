"""`harts export`: a training checkpoint -> a Hugging Face directory that transformers loads with the
same log-probs as the trainer's model (the weights the generators get back), and that
`trainer.models.load_model` reads back bit for bit."""
from __future__ import annotations

import json
import sys

import pytest
import torch

sys.modules.setdefault("fla", None)  # transformers must not bind fla's GPU kernels on CPU

from harts_cli.main import main as harts  # noqa: E402
from kernels.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from trainer import checkpoint  # noqa: E402
from trainer.distributed import DistContext  # noqa: E402
from trainer.export import write_hf_dir  # noqa: E402
from trainer.layout import layout_from_sequences  # noqa: E402
from trainer.models import ModelConfig, Qwen3NextForRL, RunOptions, debugmodel, load_model  # noqa: E402

transformers = pytest.importorskip("transformers")
C = 16


def _trained_like(cfg: ModelConfig, seed: int = 0) -> Qwen3NextForRL:
    """Random weights with non-trivial norms and gates (a fresh init has exact 0/1 there)."""
    model = Qwen3NextForRL(cfg)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _logprobs(model: Qwen3NextForRL, seqs) -> list[torch.Tensor]:
    cfg = model.config
    layout = layout_from_sequences(seqs, conv_kernel=cfg.linear_conv_kernel_dim, chunk_size=C)
    with torch.no_grad():
        logits = model.logits(model(layout, RunOptions(linear_fn=chunk_gated_delta_rule, chunk_size=C)).hidden).double()
    out, off = [], 0
    for s in seqs:
        lp = torch.log_softmax(logits[off : off + len(s) - 1], -1)
        out.append(lp.gather(1, s[1:, None].long())[:, 0])
        off += len(s)
    return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_with_the_same_logprobs(tmp_path, tied):
    cfg = debugmodel()
    cfg.tie_word_embeddings = tied
    model = _trained_like(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = checkpoint.save(tmp_path / "ckpt", step=3, model=model, optimizer=opt, ctx=DistContext(),
                           meta={"step_ids": ["a", "b", "c"], "model": "tiny", "model_config": cfg.to_hf_dict()})
    out = tmp_path / "hf"
    assert harts(["export", str(tmp_path / "ckpt"), "--out", str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "harts.json").read_text())["policy_version"] == 3
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in index  # the per-expert Qwen3-Next layout
    assert ("lm_head.weight" in index) is not tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in (70, 33, 5)]
    worst = 0.0
    for s, ours in zip(seqs, _logprobs(model, seqs)):
        with torch.no_grad():
            ref = torch.log_softmax(hf(s[None]).logits[0].double(), -1)[:-1].gather(1, s[1:, None])[:, 0]
        worst = max(worst, float((ref - ours).abs().max()))
    print(f"export parity tied={tied}: max |log-prob difference| {worst:.3g}")
    assert worst <= 1e-5, f"max |log-prob difference| {worst:.3g}"
    back = load_model(out)  # the trainer's own loader reads the export back exactly
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert ckpt.is_dir()


def test_export_shards_and_bf16(tmp_path):
    model = _trained_like(debugmodel())
    out = write_hf_dir(tmp_path / "hf", model.state_dict(), model.config, dtype=torch.bfloat16,
                       max_shard_bytes=100_000, meta={"policy_version": 7})
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    back = load_model(out)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16).float()), k
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_export_of_a_non_checkpoint_is_one_clear_line(tmp_path, capsys):
    assert harts(["export", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "expected a HARTS checkpoint directory" in err and "Traceback" not in err


def test_named_model_export_loads_into_autotokenizer_and_generates(tmp_path):
    """A named model (no source directory) exports the byte tokenizer, its special token ids and an
    explicit context length: AutoTokenizer encodes a prompt and generate() runs and stops at eos."""
    model = _trained_like(debugmodel())
    out = write_hf_dir(tmp_path / "hf", model.state_dict(), model.config, dtype=torch.float32, meta={"policy_version": 1})
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["max_position_embeddings"], cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (32768, 1, 2, 0)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["top_k"] == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tok("hello", return_tensors="pt").input_ids
    assert ids.tolist() == [list(b"hello")] and tok.eos_token_id == 2 and tok.decode([104, 105, 2]) == "hi<|eos|>"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert hf.config.max_position_embeddings == 32768 and hf.generation_config.eos_token_id == 2
    with torch.no_grad():
        seq = hf.generate(ids, max_new_tokens=6, do_sample=False)
    assert seq.shape[1] > ids.shape[1]


def test_export_carries_the_source_directorys_config_and_tokenizer(tmp_path):
    """max_position_embeddings and special ids from the source's config.json, its tokenizer files
    (the chat template too) and generation config, copied as they are."""
    from harts_client.tokenizer import ByteTokenizer

    src = tmp_path / "src"
    ByteTokenizer().save(src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1], "temperature": 0.7}))
    model = _trained_like(debugmodel())
    (src / "config.json").write_text(json.dumps({**model.config.to_hf_dict(), "max_position_embeddings": 4096,
                                                 "eos_token_id": [2, 1], "bos_token_id": 1, "pad_token_id": 0}))
    out = write_hf_dir(tmp_path / "hf", model.state_dict(), model.config, dtype=torch.float32, files_from=src)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 4096 and cfg["eos_token_id"] == [2, 1]
    assert (out / "chat_template.jinja").read_text() == (src / "chat_template.jinja").read_text()
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [2, 1], "temperature": 0.7}
    assert transformers.AutoConfig.from_pretrained(str(out)).max_position_embeddings == 4096
    assert load_model(out).config.vocab_size == 256  # the trainer reads it back
