"""The per-microbatch boundary channel of sharing windows: imports in, exports out, per mixer of every layer.

    bd = Boundary(layout.window, imports)        # one per forward; each decoder block records into bd.scope()
    k_NHd = scope.table("3.attn_k", k_RHd, ATTN)  # local rows + that kind's imported rows; records the exports
    export_layout(model.config, dtype)           # every export's name, kind, row shape and dtype, in order

Export names, kinds and shapes, and why the forward returns its exports: docs/design/windows.md
("What a child reads of its ancestors"); the order windows across ranks send them:
docs/design/cross-rank.md. Legend: R rows, n rows of one kind, l layer index.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from kernels.dtypes import compute_dtype
from plan.memory_model import FULL
from plan.window_exports import ATTN, CONV, KERNEL
from trainer.layout import WindowIO

STATE = "state"
_KIND = {"conv": CONV, "q": KERNEL, "k": KERNEL, "v": KERNEL, "g": KERNEL, "beta": KERNEL,
         "attn_k": ATTN, "attn_v": ATTN, "state": STATE}


def kind_of(name: str) -> str:
    """The kind ("attn", "conv", "kernel" or "state") of an export name "{layer}.{tensor}"."""
    return _KIND[name.split(".", 1)[1]]


def export_layout(cfg, dtype: torch.dtype) -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    """(name, kind, per-row shape, dtype) of every export of a model, in the canonical order of a
    window across ranks (docs/design/windows.md, docs/design/cross-rank.md).

    Args:
        cfg: the model's `trainer.models.ModelConfig`.
        dtype: the activations' dtype (the compute dtype: FSDP2's param_dtype under mixed precision).
    """
    acc = compute_dtype(dtype)
    Hk, Hv, Kd, Vd = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    out = []
    for layer, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            kv = (cfg.num_key_value_heads, cfg.head_dim)
            out += [(f"{layer}.attn_k", ATTN, kv, dtype), (f"{layer}.attn_v", ATTN, kv, dtype)]
        else:
            out += [(f"{layer}.conv", CONV, (2 * Hk * Kd + Hv * Vd,), dtype), (f"{layer}.q", KERNEL, (Hk, Kd), dtype),
                    (f"{layer}.k", KERNEL, (Hk, Kd), dtype), (f"{layer}.v", KERNEL, (Hv, Vd), dtype),
                    (f"{layer}.g", KERNEL, (Hv,), acc), (f"{layer}.beta", KERNEL, (Hv,), dtype),
                    (f"{layer}.state", STATE, (Hv, Kd, Vd), acc)]
    return out


class Boundary:
    """Imports in, exports out, for one microbatch forward."""

    __slots__ = ("window", "imports", "exports")

    def __init__(self, window: WindowIO, imports: Mapping[str, torch.Tensor] | None = None):
        self.window = window
        self.imports = imports or {}
        """name -> imported tensor (the kind's imported rows, in the layout's order)."""
        self.exports: dict[str, torch.Tensor] = {}
        """name -> exported tensor (rows `window.export_rows[kind]` of the table), filled by the forward."""

    def scope(self) -> "Boundary":
        """A boundary with the same window and imports and its own, empty, exports: what one
        decoder block records, returned by the block rather than written here (a block re-run by
        activation checkpointing then changes nothing outside it)."""
        return Boundary(self.window, self.imports)

    def table(self, name: str, local: torch.Tensor, kind: str) -> torch.Tensor:
        """`local` [R, ...] followed by the imported rows of `kind`; records the exported rows."""
        t = local
        if self.window.num_imports(kind):
            imp = self.imports.get(name)
            if imp is None:
                raise ValueError(f"boundary: {name} imports {self.window.num_imports(kind)} rows but none were given")
            t = torch.cat([local, imp])
        rows = None if self.window.export_rows is None else self.window.export_rows[kind]
        if rows is not None and rows.shape[0]:
            self.exports[name] = t.index_select(0, rows)
        return t

    def states(self, name: str) -> torch.Tensor | None:
        """[Q, Hv, Kd, Vd] imported states of a layer (None without state imports)."""
        if STATE not in self.window.import_from:
            return None
        st = self.imports.get(name)
        if st is None:
            raise ValueError(f"boundary: {name} has state imports but none were given")
        return st

    def export_states(self, name: str, table: list[torch.Tensor | None]) -> None:
        """Record the layer's exported states (ids `window.export_states`) from its state table."""
        ids = self.window.export_states
        if ids is not None and ids.shape[0]:
            missing = [int(i) for i in ids.tolist() if table[int(i)] is None]
            if missing:
                raise ValueError(f"boundary: {name} exports states {missing} that no linear call computed")
            self.exports[name] = torch.stack([table[int(i)] for i in ids.tolist()])


class Imports(Mapping):
    """A microbatch's import leaves by name, as the executor hands them to a model forward.

    A read-only mapping that is neither a dict nor a dataclass, on purpose: FSDP2 wraps every
    tensor requiring grad that it finds in a root module's inputs (dicts and dataclasses included)
    in its post-backward function, so the root unit's gradient reduce-scatter would run when the
    imports' gradients are complete instead of in its final callback, as it does on a rank whose
    microbatch imports nothing. Hidden here, every rank reduces the root at the same point of
    every backward (lock-step plans pair collectives across ranks: docs/design/lockstep.md).
    """

    __slots__ = ("_by_name",)

    def __init__(self, by_name: dict[str, torch.Tensor]):
        self._by_name = by_name

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._by_name[name]

    def __iter__(self):
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)
