"""Inference engines (harts_client.engines): torch-free at import; the transformers engine samples
from the newest export with the trainer's log-probs and loads new exports in place; the vLLM and
SGLang engines against fakes of exactly the calls they make (neither is installed here)."""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generator_side_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
        "import harts_client.engines, harts_client.engines.base, harts_client.engines.transformers_engine\n"
        "import harts_client.engines.vllm_engine, harts_client.engines.vllm_worker, harts_client.engines.sglang_engine\n"
        "import harts_client.tree_sampling, harts_client.tokenizer, harts_client.chat, harts_client.data\n"
        "import harts_client.tasks.swe, harts_client.tasks.swe.sandbox\n"
        "import harts_client.tasks, harts_client.tasks.seek, harts_client.tasks.calculator\n"
        "from harts_client.engines import make_engine\n"
        "for name in ('vllm', 'sglang'):\n"
        "    try:\n"
        "        make_engine(name, '.')\n"
        "    except ValueError as e:\n"
        "        assert f'{name} package' in str(e), e\n"
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


def test_new_exports_load_in_place_with_from_pretrained_weights(export_root, tmp_path):
    """reload() copies a new export into the loaded model (per-expert weights stacked as transformers
    keeps them): the same parameters as a model built from the export, without a rebuild."""
    import torch

    from harts_client.engines.transformers_engine import TransformersEngine
    from trainer.export import point_latest, write_hf_dir

    root, model = export_root
    engine = TransformersEngine(root, device="auto")
    assert engine.device == ("cuda" if torch.cuda.is_available() else "cpu")
    built = engine.model
    state = {k: v * 0.9 + 0.003 for k, v in model.state_dict().items()}
    write_hf_dir(root / "step-00000009", state, model.config, dtype=torch.float32, meta={"policy_version": 9},
                 files_from=root / "tokenizer")
    point_latest(root, "step-00000009")
    try:
        assert engine.reload() and engine.model is built and engine.in_place_loads == 1 and engine.policy_version == 9
        fresh = TransformersEngine(root / "step-00000009")
        mine, want = engine.model.state_dict(), fresh.model.state_dict()
        assert mine.keys() == want.keys() and any(k.endswith("experts.gate_up_proj") for k in mine)
        for k in want:
            assert torch.equal(mine[k].cpu(), want[k].cpu()), k
        engine.load(root / "step-00000000")  # back to a given export (what evaluation does)
        assert engine.policy_version == 0 and engine.in_place_loads == 2
    finally:
        point_latest(root, "step-00000000")


def test_greedy_decoding_passes_no_sampling_flags(export_root, capfd):
    """No "generation flags are not valid ['top_k']" warning: greedy calls carry no top-k / top-p."""
    from transformers.utils import logging as hf_logging

    from harts_client.engines.transformers_engine import TransformersEngine

    hf_logging.warning_once.cache_clear()
    TransformersEngine(export_root[0]).generate([[1, 70]], n=2, max_new_tokens=3, temperature=0.0, seed=0, stop_ids=[2])
    assert "generation flags" not in capfd.readouterr().err


class _FakeVLLM:
    """A stand-in of exactly what VLLMEngine calls in vllm 0.11: LLM(model, **kw), LLM.generate,
    LLM.collective_rpc, LLM.reset_prefix_cache, SamplingParams(**kw), inputs.TokensPrompt."""

    def __init__(self, worker_cls):
        self.llms, self.events = [], []
        fake = self

        class LLM:
            def __init__(self, model, **kw):
                fake.llms.append((model, kw))
                self.worker = worker_cls()

            def generate(self, inputs, params, use_tqdm):
                fake.events.append(("generate", params, use_tqdm))
                out = []
                for i, p in enumerate(inputs):
                    comps = []
                    for j in range(params["n"]):
                        ids = [10 + i, 20 + j, params["stop_token_ids"][0]] if j % 2 == 0 else [30 + i] * params["max_tokens"]
                        comps.append(types.SimpleNamespace(token_ids=ids, logprobs=[{t: types.SimpleNamespace(logprob=-0.5 * k)}
                                                                                     for k, t in enumerate(ids)]))
                    out.append(types.SimpleNamespace(prompt_token_ids=p["prompt_token_ids"], outputs=comps))
                return out

            def collective_rpc(self, method, args=()):
                fake.events.append(("collective_rpc", method, args))
                return [getattr(self.worker, method)(*args)]  # the extension's method on the (one) worker

            def reset_prefix_cache(self):
                fake.events.append(("reset_prefix_cache",))

        self.module = types.ModuleType("vllm")
        self.module.LLM = LLM
        self.module.SamplingParams = lambda **kw: dict(kw)
        self.module.inputs = types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids})


def _worker_class():
    from harts_client.engines.vllm_worker import ExportLoader

    class Worker(ExportLoader):  # vLLM mixes the extension into its worker class the same way
        def __init__(self):
            self.loaded = []
            self.model_runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self._load))

        def _load(self, weights):
            self.loaded.append({name: t.clone() for name, t in weights})

    return Worker


def _exports(root: Path, versions: int):
    import torch

    from trainer.export import point_latest, write_hf_dir
    from trainer.models import Qwen3NextForRL, debugmodel

    model = Qwen3NextForRL(debugmodel())
    model.init_weights(0)
    for v in range(versions):
        state = {k: t + 0.01 * v for k, t in model.state_dict().items()}
        write_hf_dir(root / f"step-{v:08d}", state, model.config, dtype=torch.float32, meta={"policy_version": v})
    point_latest(root, "step-00000000")
    return root


def test_vllm_engine_updates_weights_in_place(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from safetensors.torch import load_file

    from harts_client.engines import make_engine
    from trainer.export import point_latest

    fake = _FakeVLLM(_worker_class())
    monkeypatch.setitem(sys.modules, "vllm", fake.module)
    root = _exports(tmp_path / "hf", 2)
    engine = make_engine("vllm", str(root), gpu_memory_utilization=0.5)
    assert fake.llms == [(str(root / "step-00000000"), {"worker_extension_cls": "harts_client.engines.vllm_worker.ExportLoader",
                                                          "logprobs_mode": "processed_logprobs", "gpu_memory_utilization": 0.5})]
    outs = engine.generate([[1, 2, 3], [4]], n=2, max_new_tokens=4, temperature=0.7, seed=9, stop_ids=[2])
    _, params, use_tqdm = fake.events[-1]
    assert params == {"n": 2, "temperature": 0.7, "max_tokens": 4, "seed": 9, "stop_token_ids": [2], "logprobs": 0}
    assert not use_tqdm and outs[1][0].token_ids == [11, 20, 2] and outs[1][0].finished and not outs[1][1].finished
    assert outs[0][0].logprobs == [0.0, -0.5, -1.0]
    assert engine.reload() is False
    point_latest(root, "step-00000001")
    assert engine.reload() is True and engine.policy_version == 1 and len(fake.llms) == 1  # no new vllm.LLM
    assert fake.events[-2][:2] == ("collective_rpc", "harts_load_export") and fake.events[-1] == ("reset_prefix_cache",)
    path = fake.events[-2][2][0]
    assert path == str(root / "step-00000001")
    worker = engine.llm.worker
    want = {}
    for f in (root / "step-00000001").glob("*.safetensors"):
        want.update(load_file(f))
    assert worker.loaded[-1].keys() == want.keys() and all((worker.loaded[-1][k] == want[k]).all() for k in want)
    other = tmp_path / "other"
    other.mkdir()
    for f in (root / "step-00000001").iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 8}))
    with pytest.raises(ValueError, match="architecture"):
        engine.load(other)


def test_sglang_engine_updates_weights_from_disk(tmp_path, monkeypatch):
    """A stand-in of exactly what SGLangEngine calls in sglang 0.5: Engine(model_path, skip_tokenizer_init,
    **kw), Engine.generate(input_ids, sampling_params, return_logprob), Engine.update_weights_from_disk."""
    pytest.importorskip("torch")
    from harts_client.engines import make_engine
    from trainer.export import point_latest

    made, events = [], []

    class Engine:
        def __init__(self, model_path, skip_tokenizer_init, **kw):
            made.append((model_path, skip_tokenizer_init, kw))
            self.ok = True

        def generate(self, input_ids, sampling_params, return_logprob):
            events.append(("generate", input_ids, sampling_params, return_logprob))
            return [{"output_ids": [7, k, 2], "meta_info": {"output_token_logprobs": [(-0.1, 7, None), (-0.2, k, None),
                                                                                       (-0.3, 2, None)]}}
                    for k in range(len(input_ids))]

        def update_weights_from_disk(self, model_path):
            events.append(("update_weights_from_disk", model_path))
            return (self.ok, "ok" if self.ok else "shape mismatch", 0)

    module = types.ModuleType("sglang")
    module.Engine = Engine
    monkeypatch.setitem(sys.modules, "sglang", module)
    root = _exports(tmp_path / "hf", 3)
    engine = make_engine("sglang", str(root), mem_fraction_static=0.4)
    assert made == [(str(root / "step-00000000"), True, {"mem_fraction_static": 0.4})]
    outs = engine.generate([[1, 2], [3]], n=2, max_new_tokens=5, temperature=1.0, seed=4, stop_ids=[2])
    _, ids, params, logprob = events[-1]
    assert ids == [[1, 2], [1, 2], [3], [3]] and logprob is True
    assert [p["sampling_seed"] for p in params] == [4_000_012, 4_000_013, 4_000_014, 4_000_015]
    assert params[0] == {"max_new_tokens": 5, "temperature": 1.0, "stop_token_ids": [2], "sampling_seed": 4_000_012,
                         "skip_special_tokens": False}
    assert [c.token_ids for c in outs[1]] == [[7, 2, 2], [7, 3, 2]] and outs[1][0].logprobs == [-0.1, -0.2, -0.3]
    point_latest(root, "step-00000002")
    assert engine.reload() and engine.policy_version == 2 and len(made) == 1
    assert events[-1] == ("update_weights_from_disk", str(root / "step-00000002"))
    engine.engine.ok = False
    with pytest.raises(RuntimeError, match="shape mismatch"):
        engine.load(root / "step-00000001")
    assert engine.policy_version == 2  # a failed update keeps the loaded version
