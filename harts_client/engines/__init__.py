"""Inference engines for the generator side: sample completions with per-token log-probs.

    engine = make_engine("transformers", "runs/rl_tiny/hf")   # newest export under that root
    engine.reload()                                           # picks up a newer export, if any (in place)
    outs = engine.generate([prompt_ids], n=4, max_new_tokens=16, temperature=1.0, seed=0, stop_ids=[eos_id])
    outs[0][j].token_ids, outs[0][j].logprobs, engine.policy_version

Torch-free at import: an engine module imports its framework when it is built. `transformers`
(what `harts rl` runs), `vllm` and `sglang` (in-place weight updates; tested against fakes, not
run here): docs/design/training-loop.md ("Engines").
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
