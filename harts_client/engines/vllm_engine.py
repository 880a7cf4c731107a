"""vLLM as the generator's engine (GPU): a thin adapter, untested on the CPU machines of this project.

    engine = VLLMEngine("runs/rl/hf", gpu_memory_utilization=0.5)   # loads <root>/latest
    engine.reload()                                                  # a new export -> a new vllm.LLM

vLLM is not a dependency and is not installed where the test suite runs; this module imports it
when an engine is built and says so when it is missing. What it relies on (vLLM >= 0.6): `vllm.LLM`
on an export directory (a Qwen3-Next Hugging Face directory with its tokenizer, which
`trainer.export` writes), `SamplingParams(n, temperature, max_tokens, seed, stop_token_ids,
logprobs=0)` and `TokensPrompt(prompt_token_ids=...)`. `reload()` re-creates the LLM on the newest
export (simple and correct; a production generator would update weights in place, e.g. with
`collective_rpc` / a weight-sync extension). vLLM returns the log-probs of the raw logits by
default; pass `logprobs_mode="processed_logprobs"` (an LLM keyword) when sampling at a temperature
other than 1 so that they are those of the sampling distribution, as `Completion.logprobs` says.
"""
from __future__ import annotations

from pathlib import Path

from harts_client.engines.base import Completion, check_generate_args, resolve_model_dir
from harts_client.rollouts import samples_from_vllm

__all__ = ["VLLMEngine"]


class VLLMEngine:
    """`vllm.LLM` on an export root or a model directory; `llm_kwargs` go to `vllm.LLM`."""

    def __init__(self, model: str | Path, **llm_kwargs):
        try:
            import vllm
        except ImportError as exc:
            raise ValueError(f"generator.engine 'vllm': expected the vllm package to be installed (a GPU machine), "
                             f"got {exc}; use the 'transformers' engine on this machine") from None
        self._vllm = vllm
        self.root = Path(model)
        self.llm_kwargs = llm_kwargs
        self.llm = None
        self.model_dir: Path | None = None
        self.policy_version = -1
        self.reload()

    def reload(self) -> bool:
        path, version = resolve_model_dir(self.root)
        if path == self.model_dir:
            return False
        self.llm = None  # free the previous engine's memory before loading the next one
        self.llm = self._vllm.LLM(model=str(path), **self.llm_kwargs)
        self.model_dir, self.policy_version = path, version
        return True

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
