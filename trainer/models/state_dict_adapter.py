"""Our parameter names and layouts <-> the Hugging Face Qwen3-Next checkpoint's, in one place.

    adapter = StateDictAdapter(cfg)
    hf = adapter.to_hf(model.state_dict())              # what `harts export` writes
    ours = adapter.from_hf(hf)                          # what `load_model` loads
    rows = adapter.read(name, source, slice(r0, r1))    # rows r0..r1 of one of our parameters

Every name is the Hugging Face module name except the stacked routed experts and a tied lm head;
`read` takes rows along dim 0, the dimension FSDP2 shards (docs/design/execution.md, "Building
the model without holding it").
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from trainer.models.config import ModelConfig

__all__ = ["StateDictAdapter"]

_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


class StateDictAdapter:
    """The name and layout mapping of one model config (docs/design/execution.md, "Building the model
    without holding it")."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def to_hf(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our full tensors (any subset of the names, e.g. one FSDP unit) -> checkpoint names and layouts.

        Per-expert tensors are views of the stacked ones; a tied `lm_head.weight` is left out.
        """
        out: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            m = _STACKED.match(name)
            if m and m.group(2) == "gate_up_proj":
                inner = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{m.group(1)}.{e}.gate_proj.weight"] = t[e, :inner]
                    out[f"{m.group(1)}.{e}.up_proj.weight"] = t[e, inner:]
            elif m:
                for e in range(t.shape[0]):
                    out[f"{m.group(1)}.{e}.down_proj.weight"] = t[e]
            elif name == _HEAD and self.cfg.tie_word_embeddings:
                continue
            else:
                out[name] = t
        return out

    def from_hf(self, source: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole checkpoint's tensors -> our full state dict (experts stacked, `lm_head` tied).

        Raises:
            ValueError: an incomplete set of per-expert tensors.
        """
        return {name: self.read(name, source) for name in self.names_from_hf(source)}

    def names_from_hf(self, hf_names: Iterable[str]) -> list[str]:
        """Our parameter names that checkpoint tensors `hf_names` provide (sorted)."""
        ours = set()
        for n in hf_names:
            if n.startswith("mtp."):
                continue
            m = _PER_EXPERT.match(n)
            if m:
                ours.update((f"{m.group(1)}.gate_up_proj", f"{m.group(1)}.down_proj"))
            else:
                ours.add(n)
        if self.cfg.tie_word_embeddings and _EMBED in ours:
            ours.add(_HEAD)
        return sorted(ours)

    def read(self, name: str, source: Mapping, rows: slice = slice(None)) -> torch.Tensor:
        """Rows `rows` (dim 0) of our parameter `name`, read from the checkpoint tensors in `source`.

        Args:
            name: one of our parameter names.
            source: HF name -> tensor or lazy slice (indexable as `x[a:b]`).
            rows: a step-1 slice of dim 0 (experts for stacked expert weights).
        Raises:
            ValueError: a tensor the checkpoint lacks (names it).
        """
        m = _STACKED.match(name)
        if m and f"{m.group(1)}.0.down_proj.weight" in source:
            experts = range(self.cfg.num_experts)[rows]
            if m.group(2) == "gate_up_proj":
                parts = [torch.cat([_rows(source, f"{m.group(1)}.{e}.gate_proj.weight"),
                                    _rows(source, f"{m.group(1)}.{e}.up_proj.weight")], 0) for e in experts]
            else:
                parts = [_rows(source, f"{m.group(1)}.{e}.down_proj.weight") for e in experts]
            if not parts:
                raise ValueError(f"{name}: expected rows in [0, {self.cfg.num_experts}), got {rows}")
            return torch.stack(parts)
        if name == _HEAD and self.cfg.tie_word_embeddings:
            name = _EMBED
        return _rows(source, name, rows)


def _rows(source: Mapping, hf_name: str, rows: slice = slice(None)) -> torch.Tensor:
    if hf_name not in source:
        raise ValueError(f"checkpoint tensor {hf_name}: expected in the checkpoint, got none")
    return source[hf_name][rows]
