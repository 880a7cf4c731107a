"""Inference engines for the generator side: sample completions with per-token log-probs.

    from harts_client.engines import make_engine
    engine = make_engine("transformers", "runs/rl_tiny/hf")   # newest export under that root
    engine.reload()                                           # picks up a newer export, if any
    outs = engine.generate([prompt_ids], n=4, max_new_tokens=16, temperature=1.0, seed=0,
                           stop_ids=[eos_id])
    outs[0][j].token_ids, outs[0][j].logprobs, engine.policy_version

The interface is torch-free at import (this package imports neither torch nor an engine):
an engine module imports its framework when it is built. Engines:

- `transformers` (`transformers_engine.TransformersEngine`): Hugging Face transformers on the
  trainer's exports, on the CPU or a GPU; what `harts rl` runs here.
- `vllm` (`vllm_engine.VLLMEngine`): `vllm.LLM` on the same exports, re-created when a newer
  export appears. vLLM is not installed on the CPU machines this project is tested on: this
  engine is a thin, untested adapter (see its docstring).

`model` is an export root (a directory with `latest`, `trainer.export`), whose newest export
is loaded and re-loaded by `reload()` when `latest` changes, or a plain model directory.
`policy_version` is the loaded export's (`harts.json`), 0 for a directory without one.
"""
from __future__ import annotations

from harts_client.engines.base import Completion, Engine, resolve_model_dir

__all__ = ["Completion", "Engine", "make_engine", "resolve_model_dir", "ENGINES"]

ENGINES = ("transformers", "vllm")


def make_engine(name: str, model: str, **options) -> Engine:
    """The engine `name` ("transformers" or "vllm") on `model` (an export root or a model directory)."""
    if name == "transformers":
        from harts_client.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model, **options)
    if name == "vllm":
        from harts_client.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model, **options)
    raise ValueError(f"generator.engine: expected one of {ENGINES}, got {name!r}")
