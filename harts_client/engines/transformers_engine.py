"""Hugging Face transformers as the generator's engine, on the trainer's newest export.

    engine = TransformersEngine("runs/rl_tiny/hf")        # loads <root>/latest (harts.json: policy_version)
    engine.reload()                                       # True when a newer export was loaded (in place)
    engine.load("runs/rl_tiny/hf/step-00000005")          # a given export (what evaluation uses)
    outs = engine.generate(prompts, n=4, max_new_tokens=16, temperature=1.0, seed=3, stop_ids=[2])

GPU when there is one, else the CPU (with `fla` hidden); one batched, left-padded `generate` per
call, log-probs within 1e-5 of the trainer's; new exports copied in place
(docs/design/training-loop.md, "Engines").
"""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from harts_client.engines.base import Completion, FollowsExports, architecture, check_generate_args, resolve_model_dir

log = logging.getLogger(__name__)

__all__ = ["TransformersEngine"]

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class TransformersEngine(FollowsExports):
    """transformers `AutoModelForCausalLM` on an export root or a model directory.

    Args:
        model: an export root (its `latest` export is loaded and followed) or a model directory.
        device: "auto" (cuda when available, else cpu), or a torch device ("cpu", "cuda:1", ...).
        dtype: "float32" (default: the trainer's fp32 log-probs) or "bfloat16".
    """

    def __init__(self, model: str | Path, *, device: str = "auto", dtype: str = "float32"):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"generator.dtype: expected 'float32' or 'bfloat16', got {dtype!r}")
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            # with fla importable, transformers binds its GPU kernels even for CPU tensors
            sys.modules.setdefault("fla", None)
        import transformers

        self._torch, self._transformers = torch, transformers
        self.root = Path(model)
        self.device = device
        self.dtype = getattr(torch, dtype)
        self.model = None
        self.model_dir: Path | None = None
        self.policy_version = -1
        self.in_place_loads = 0
        """Exports loaded into the existing model (the rest were built by from_pretrained)."""
        self._arch: dict | None = None
        self.reload()

    def load(self, path: str | Path, version: int | None = None) -> None:
        """Load the export at `path` (in place when the architecture is the loaded one's)."""
        path = Path(path)
        if version is None:
            version = resolve_model_dir(path)[1]
        arch = architecture(path)
        if self.model is not None and arch == self._arch and self._load_in_place(path):
            self.in_place_loads += 1
            log.debug("engine: %s loaded in place (policy_version %d)", path, version)
        else:
            log.info("engine: building the model from %s (policy_version %d) on %s", path, version, self.device)
            model = self._transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype)
            self.model = model.to(self.device).eval()
            self._arch = arch
        self.model_dir, self.policy_version = path, version

    def _load_in_place(self, path: Path) -> bool:
        """Copy the export's tensors into the model's parameters; False (nothing changed) when a
        parameter has no source in the export."""
        from safetensors import safe_open

        torch = self._torch
        files = sorted(path.glob("*.safetensors"))
        handles = [safe_open(str(f), framework="pt") for f in files]
        where = {k: h for h in handles for k in h.keys()}
        params = self.model.state_dict()
        plan, storages = {}, set()
        for name, p in params.items():
            if p.data_ptr() in storages:  # tied to a parameter filled already (lm head = embeddings)
                continue
            storages.add(p.data_ptr())
            if name in where:
                plan[name] = lambda name=name: where[name].get_tensor(name)
                continue
            m = _STACKED.match(name)
            if m is None:
                return False
            prefix, kind = m.groups()
            parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
            keys = [[f"{prefix}.{e}.{part}.weight" for part in parts] for e in range(p.shape[0])]
            if any(k not in where for ks in keys for k in ks):
                return False
            plan[name] = lambda keys=keys: torch.stack([torch.cat([where[k].get_tensor(k) for k in ks], 0) for ks in keys])
        with torch.no_grad():
            for name, get in plan.items():
                src = get()
                if src.shape != params[name].shape:
                    raise ValueError(f"{path}: {name}: expected shape {tuple(params[name].shape)}, got {tuple(src.shape)}")
                params[name].copy_(src)
        return True

    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, seed: int,
                 stop_ids: list[int]) -> list[list[Completion]]:
        check_generate_args(prompts, n, max_new_tokens, temperature)
        torch = self._torch
        stops = set(int(s) for s in stop_ids)
        greedy = temperature == 0
        per_prompt = 1 if greedy else n  # greedy: one decode, repeated n times
        pad = min(stops) if stops else 0
        sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        config = self._transformers.GenerationConfig(
            do_sample=not greedy, max_new_tokens=max_new_tokens, num_return_sequences=per_prompt, use_cache=True,
            eos_token_id=sorted(stops) or None, pad_token_id=pad, output_logits=True, return_dict_in_generate=True,
            **sampling)
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
