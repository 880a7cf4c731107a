"""SGLang as the generator's engine (GPU): one `sglang.Engine`, weights updated from disk per export.

    engine = SGLangEngine("runs/rl/hf", mem_fraction_static=0.5)   # sglang.Engine on <root>/latest
    engine.reload()                                                 # a newer export -> update_weights_from_disk

Written against SGLang 0.5; not a dependency, imported when an engine is built, not run on a GPU
here. The calls it makes (which tests/harts_client/test_engines.py fakes): docs/design/training-loop.md
("Engines").
"""
from __future__ import annotations

import logging
from pathlib import Path

from harts_client.engines.base import Completion, FollowsExports, architecture, check_generate_args, resolve_model_dir
from harts_client.rollouts import samples_from_sglang

log = logging.getLogger(__name__)

__all__ = ["SGLangEngine"]


class SGLangEngine(FollowsExports):
    """`sglang.Engine` on an export root or a model directory; `engine_kwargs` go to `sglang.Engine`."""

    def __init__(self, model: str | Path, **engine_kwargs):
        try:
            import sglang
        except ImportError as exc:
            raise ValueError(f"generator.engine 'sglang': expected the sglang package to be installed (a GPU machine), "
                             f"got {exc}; use the 'transformers' engine on this machine") from None
        self.root = Path(model)
        path, version = resolve_model_dir(self.root)
        log.info("engine: sglang.Engine on %s (policy_version %d)", path, version)
        self.engine = sglang.Engine(model_path=str(path), skip_tokenizer_init=True, **engine_kwargs)
        self._arch = architecture(path)
        self.model_dir, self.policy_version = path, version

    def load(self, path: str | Path, version: int | None = None) -> None:
        """Load the export at `path` into the running engine (update_weights_from_disk)."""
        path, version = self.replacement(path, version, "SGLang")
        answer = self.engine.update_weights_from_disk(str(path))
        ok, message = (answer[0], answer[1]) if isinstance(answer, (tuple, list)) else (bool(answer), "")
        if not ok:
            raise RuntimeError(f"sglang update_weights_from_disk({path}) failed: {message}")
        self.model_dir, self.policy_version = path, version

    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, seed: int,
                 stop_ids: list[int]) -> list[list[Completion]]:
        check_generate_args(prompts, n, max_new_tokens, temperature)
        inputs = [list(p) for p in prompts for _ in range(n)]
        params = [{"max_new_tokens": max_new_tokens, "temperature": temperature, "stop_token_ids": list(stop_ids),
                   "sampling_seed": int(seed) * 1_000_003 + k, "skip_special_tokens": False} for k in range(len(inputs))]
        answers = self.engine.generate(input_ids=inputs, sampling_params=params, return_logprob=True)
        if len(answers) != len(inputs):
            raise RuntimeError(f"sglang generate: expected {len(inputs)} answers, got {len(answers)}")
        stops = set(int(s) for s in stop_ids)
        out: list[list[Completion]] = [[] for _ in prompts]
        for k, (ids, answer) in enumerate(zip(inputs, answers)):
            s = samples_from_sglang(answer, ids)
            out[k // n].append(Completion(s.token_ids, s.logprobs or [], bool(s.token_ids) and s.token_ids[-1] in stops))
        return out
