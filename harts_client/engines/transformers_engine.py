"""Hugging Face transformers as the generator's engine, on the trainer's newest export.

    engine = TransformersEngine("runs/rl_tiny/hf")        # loads <root>/latest (harts.json: policy_version)
    engine.reload()                                       # True when a newer export was loaded
    outs = engine.generate(prompts, n=4, max_new_tokens=16, temperature=1.0, seed=3, stop_ids=[2])

Runs on the CPU (what `harts rl` uses on this machine) or a GPU (`device="cuda"`). torch and
transformers are imported when the engine is built, not when this module is. All prompts of a
call are generated together in one `generate` call, left-padded (n completions each): a masked
position adds nothing to the linear-attention states and the convolution (they stay zero, as at
the start of a sequence) and softmax attention with RoPE depends on relative positions only, so
the log-probs are the trainer's on the same weights up to float rounding (tested within 1e-5).
Sampling is plain multinomial over softmax(logits / temperature) (no top-k / top-p), temperature
0 is greedy; a call is seeded from `seed`, so it is reproducible.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from harts_client.engines.base import Completion, check_generate_args, resolve_model_dir

log = logging.getLogger(__name__)

__all__ = ["TransformersEngine"]


class TransformersEngine:
    """transformers `AutoModelForCausalLM` on an export root or a model directory.

    Args:
        model: an export root (its `latest` export is loaded and followed) or a model directory.
        device: torch device of the model ("cpu", "cuda", ...).
        dtype: "float32" (default: the trainer's fp32 log-probs) or "bfloat16".
    """

    def __init__(self, model: str | Path, *, device: str = "cpu", dtype: str = "float32"):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"generator.dtype: expected 'float32' or 'bfloat16', got {dtype!r}")
        if device == "cpu":
            # ENV.md: with fla importable, transformers binds its GPU kernels even for CPU tensors.
            sys.modules.setdefault("fla", None)
        import torch
        import transformers

        self._torch, self._transformers = torch, transformers
        self.root = Path(model)
        self.device = device
        self.dtype = getattr(torch, dtype)
        self.model = None
        self.model_dir: Path | None = None
        self.policy_version = -1
        self.reload()

    def reload(self) -> bool:
        path, version = resolve_model_dir(self.root)
        if path == self.model_dir:
            return False
        log.info("engine: loading %s (policy_version %d)", path, version)
        model = self._transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype)
        self.model = model.to(self.device).eval()
        self.model_dir, self.policy_version = path, version
        return True

    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, seed: int,
                 stop_ids: list[int]) -> list[list[Completion]]:
        check_generate_args(prompts, n, max_new_tokens, temperature)
        torch = self._torch
        stops = set(int(s) for s in stop_ids)
        greedy = temperature == 0
        per_prompt = 1 if greedy else n  # greedy: one decode, repeated n times
        pad = min(stops) if stops else 0
        config = self._transformers.GenerationConfig(
            do_sample=not greedy, max_new_tokens=max_new_tokens, num_return_sequences=per_prompt, top_k=0, top_p=1.0,
            eos_token_id=sorted(stops) or None, pad_token_id=pad,
            output_logits=True, return_dict_in_generate=True, **({} if greedy else {"temperature": temperature}))
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: masked positions leave every layer's state at zero
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        torch.manual_seed(int(seed) % (1 << 62))
        with torch.no_grad():
            res = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), generation_config=config)
        new = res.sequences[:, width:]
        logits = torch.stack(res.logits, 1).float()  # [B*n, steps, V], before any processing
        lp = torch.log_softmax(logits if greedy else logits / temperature, -1)
        lp = lp.gather(-1, new[..., None]).squeeze(-1).cpu()
        new = new.cpu()
        out: list[list[Completion]] = [[] for _ in prompts]
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end = next((t + 1 for t, tok in enumerate(tokens) if tok in stops), None)
            cut = len(tokens) if end is None else end
            done = Completion(tokens[:cut], lp[row, :cut].tolist(), end is not None)
            out[row // per_prompt].extend([done] * (n // per_prompt))
        return out
