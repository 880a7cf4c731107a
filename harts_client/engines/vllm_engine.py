"""vLLM as the generator's production engine (GPU): one `vllm.LLM`, weights updated in place per export.

    engine = VLLMEngine("runs/rl/hf", gpu_memory_utilization=0.5)   # one vllm.LLM on <root>/latest
    engine.reload()              # a newer export: its weights loaded into the running engine, prefix cache reset

Written against vLLM 0.11; not a dependency, imported when an engine is built, not run on a GPU
here. The calls it makes (which tests/harts_client/test_engines.py fakes): docs/design/training-loop.md
("Engines").
"""
from __future__ import annotations

import logging
from pathlib import Path

from harts_client.engines.base import Completion, FollowsExports, architecture, check_generate_args, resolve_model_dir
from harts_client.rollouts import samples_from_vllm

log = logging.getLogger(__name__)

__all__ = ["VLLMEngine", "WORKER_EXTENSION"]

WORKER_EXTENSION = "harts_client.engines.vllm_worker.ExportLoader"


class VLLMEngine(FollowsExports):
    """`vllm.LLM` on an export root or a model directory; `llm_kwargs` go to `vllm.LLM`."""

    def __init__(self, model: str | Path, **llm_kwargs):
        try:
            import vllm
        except ImportError as exc:
            raise ValueError(f"generator.engine 'vllm': expected the vllm package to be installed (a GPU machine), "
                             f"got {exc}; use the 'transformers' engine on this machine") from None
        self._vllm = vllm
        self.root = Path(model)
        path, version = resolve_model_dir(self.root)
        kwargs = {"worker_extension_cls": WORKER_EXTENSION, "logprobs_mode": "processed_logprobs", **llm_kwargs}
        log.info("engine: vllm.LLM on %s (policy_version %d)", path, version)
        self.llm = vllm.LLM(model=str(path), **kwargs)
        self._arch = architecture(path)
        self.model_dir, self.policy_version = path, version

    def load(self, path: str | Path, version: int | None = None) -> None:
        """Load the export at `path` into the running engine (module docstring)."""
        path, version = self.replacement(path, version, "vLLM")
        self.llm.collective_rpc("harts_load_export", args=(str(path),))
        self.llm.reset_prefix_cache()
        self.model_dir, self.policy_version = path, version
        log.debug("engine: %s loaded in place (policy_version %d)", path, version)

    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, seed: int,
                 stop_ids: list[int]) -> list[list[Completion]]:
        check_generate_args(prompts, n, max_new_tokens, temperature)
        params = self._vllm.SamplingParams(n=n, temperature=temperature, max_tokens=max_new_tokens, seed=int(seed),
                                           stop_token_ids=list(stop_ids), logprobs=0)
        inputs = [self._vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        stops = set(int(s) for s in stop_ids)
        out = []
        for request in self.llm.generate(inputs, params, use_tqdm=False):
            out.append([Completion(s.token_ids, s.logprobs or [], bool(s.token_ids) and s.token_ids[-1] in stops)
                        for s in samples_from_vllm(request)])
        return out
