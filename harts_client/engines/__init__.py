"""Inference engines for the generator side: sample completions with per-token log-probs.

    from harts_client.engines import make_engine
    engine = make_engine("transformers", "runs/rl_tiny/hf")   # newest export under that root
    engine.reload()                                           # picks up a newer export, if any (in place)
    engine.load("runs/rl_tiny/hf/step-00000005")              # a given export
    outs = engine.generate([prompt_ids], n=4, max_new_tokens=16, temperature=1.0, seed=0,
                           stop_ids=[eos_id])
    outs[0][j].token_ids, outs[0][j].logprobs, engine.policy_version

The interface is torch-free at import (this package imports neither torch nor an engine):
an engine module imports its framework when it is built. Engines:

- `transformers` (`transformers_engine.TransformersEngine`): Hugging Face transformers on the
  trainer's exports, batched generation with the KV cache, on the GPU when there is one, else
  the CPU; a new export is copied into the model in place. What `harts rl` runs here.
- `vllm` (`vllm_engine.VLLMEngine`): the production engine: one `vllm.LLM`, each new export
  loaded into its workers in place (`vllm_worker.ExportLoader` through `collective_rpc`), no
  rebuild.
- `sglang` (`sglang_engine.SGLangEngine`): one `sglang.Engine`, each new export loaded with
  `update_weights_from_disk`.

vLLM and SGLang are not installed on the CPU machines this project is tested on: their engines
are tested against fakes of exactly the calls they make (tests/harts_client/test_engines.py) and
were not run here.

`model` is an export root (a directory with `latest`, `trainer.export`), whose newest export
is loaded and re-loaded by `reload()` when `latest` changes, or a plain model directory.
`policy_version` is the loaded export's (`harts.json`), 0 for a directory without one.
"""
from __future__ import annotations

from harts_client.engines.base import Completion, Engine, resolve_model_dir

__all__ = ["Completion", "Engine", "make_engine", "resolve_model_dir", "ENGINES"]

ENGINES = ("transformers", "vllm", "sglang")


def make_engine(name: str, model: str, **options) -> Engine:
    """The engine `name` (one of ENGINES) on `model` (an export root or a model directory);
    `options` go to the engine (`device`, `dtype` for transformers; vllm.LLM / sglang.Engine keywords)."""
    if name == "transformers":
        from harts_client.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model, **options)
    if name == "vllm":
        from harts_client.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model, **options)
    if name == "sglang":
        from harts_client.engines.sglang_engine import SGLangEngine

        return SGLangEngine(model, **options)
    raise ValueError(f"generator.engine: expected one of {ENGINES}, got {name!r}")
