"""Inference engines (harts_client.engines): torch-free at import; the transformers engine samples
from the newest export with the trainer's log-probs and follows new exports."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generator_side_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import harts_client.engines, harts_client.engines.base, harts_client.engines.transformers_engine\n"
        "import harts_client.engines.vllm_engine, harts_client.tree_sampling, harts_client.tokenizer\n"
        "import harts_client.tasks, harts_client.tasks.seek, harts_client.tasks.calculator\n"
        "from harts_client.engines import make_engine\n"
        "try:\n"
        "    make_engine('vllm', '.')\n"
        "except ValueError as e:\n"
        "    assert 'vllm package' in str(e), e\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numba', 'planner_service',"
        " 'trainer') and sys.modules[m] is not None)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.fixture(scope="module")
def export_root(tmp_path_factory):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from harts_client.tokenizer import ByteTokenizer
    from trainer.export import point_latest, write_hf_dir
    from trainer.models import Qwen3NextForRL, debugmodel

    root = tmp_path_factory.mktemp("exports")
    tok_dir = root / "tokenizer"
    ByteTokenizer().save(tok_dir)
    model = Qwen3NextForRL(debugmodel())
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # non-trivial weights: a fresh init samples near-uniformly
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    write_hf_dir(root / "step-00000000", model.state_dict(), model.config, dtype=torch.float32,
                 meta={"policy_version": 0}, files_from=tok_dir)
    point_latest(root, "step-00000000")
    return root, model


def _trainer_logprobs(model, seqs):
    import torch

    from kernels.gated_delta_rule import chunk_gated_delta_rule
    from trainer.layout import layout_from_sequences
    from trainer.models import RunOptions

    layout = layout_from_sequences([torch.tensor(s) for s in seqs], conv_kernel=model.config.linear_conv_kernel_dim,
                                   chunk_size=16)
    with torch.no_grad():
        logits = model.logits(model(layout, RunOptions(linear_fn=chunk_gated_delta_rule, chunk_size=16)).hidden).double()
    out, off = [], 0
    for s in seqs:
        lp = torch.log_softmax(logits[off: off + len(s) - 1], -1).gather(1, torch.tensor(s[1:])[:, None])[:, 0]
        out.append(lp.numpy())
        off += len(s)
    return out


def test_transformers_engine_samples_with_the_trainers_logprobs(export_root):
    from harts_client.engines import make_engine

    root, model = export_root
    engine = make_engine("transformers", str(root))
    assert engine.policy_version == 0 and engine.model_dir == root / "step-00000000"
    prompts = [[1, 70, 71, 72], [1] + list(range(40, 90)), [1, 5], [1] + list(range(100, 117))]  # mixed lengths: padded
    for temperature in (1.0, 0.7):
        outs = engine.generate(prompts, n=3, max_new_tokens=10, temperature=temperature, seed=5, stop_ids=[2])
        assert [len(o) for o in outs] == [3, 3, 3, 3]
        seqs = [p + c.token_ids for p, o in zip(prompts, outs) for c in o]
        ref = _trainer_logprobs(model, seqs)
        worst = 0.0
        for p, o, lps in zip(prompts, outs, [ref[i:i + 3] for i in range(0, len(ref), 3)]):
            for c, lp in zip(o, lps):
                assert 1 <= len(c.token_ids) <= 10 and c.finished == (c.token_ids[-1] == 2)
                assert 2 not in c.token_ids[:-1]
                if temperature == 1.0:  # the trainer's log-probs are at temperature 1
                    worst = max(worst, float(abs(lp[len(p) - 1:] - c.logprobs).max()))
        assert worst <= 1e-5, worst
    again = engine.generate(prompts, n=3, max_new_tokens=10, temperature=1.0, seed=5, stop_ids=[2])
    first = engine.generate(prompts, n=3, max_new_tokens=10, temperature=1.0, seed=5, stop_ids=[2])
    assert [[c.token_ids for c in o] for o in again] == [[c.token_ids for c in o] for o in first]
    greedy = engine.generate(prompts[:1], n=2, max_new_tokens=6, temperature=0.0, seed=0, stop_ids=[2])[0]
    assert greedy[0].token_ids == greedy[1].token_ids
    assert greedy[0].logprobs == pytest.approx(_trainer_logprobs(model, [prompts[0] + greedy[0].token_ids])[0][3:], abs=1e-5)


def test_sampling_uses_the_whole_distribution(export_root):
    """No top-k / top-p: a flat distribution over 256 ids shows far more than transformers' default 50."""
    import torch

    from harts_client.engines.transformers_engine import TransformersEngine
    from trainer.export import write_hf_dir
    from trainer.models import Qwen3NextForRL, debugmodel

    root, _ = export_root
    flat = Qwen3NextForRL(debugmodel())
    flat.init_weights(0)  # near-uniform next-token distribution
    path = root.parent / "flat"
    write_hf_dir(path, flat.state_dict(), flat.config, dtype=torch.float32, meta={"policy_version": 0},
                 files_from=root / "tokenizer")
    outs = TransformersEngine(path).generate([[1, 3]], n=400, max_new_tokens=1, temperature=1.0, seed=0, stop_ids=[2])
    assert len({c.token_ids[0] for c in outs[0]}) > 150


def test_engine_follows_the_newest_export(export_root):
    import torch

    from harts_client.engines.transformers_engine import TransformersEngine
    from trainer.export import point_latest, write_hf_dir

    root, model = export_root
    engine = TransformersEngine(root)
    assert engine.reload() is False
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    write_hf_dir(root / "step-00000007", state, model.config, dtype=torch.float32, meta={"policy_version": 7},
                 files_from=root / "tokenizer")
    point_latest(root, "step-00000007")
    assert engine.reload() is True and engine.policy_version == 7 and engine.reload() is False
    point_latest(root, "step-00000000")
    with pytest.raises(ValueError, match="generator.model"):
        TransformersEngine(root / "nowhere")
