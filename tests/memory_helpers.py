"""Measure what a forward of the trainer's model saves for backward, per row, and compare it with the
memory model (plan/memory_model.py) under an activation-checkpointing mode.

    run = lambda mode: forward_loss(model, layout, mode)      # a scalar to backward from
    got = compare_with_memory_model(model, run, rows=L, mode="full", chunk_size=16)
    got.check()                                               # measured <= model <= slack x measured

The gauge is `benchmarks.peer.SavedTensorBytes` (saved-tensor hooks, every storage once). What a
mode keeps between forward and backward is what the hooks see at the end of its forward: a
non-reentrant `torch.utils.checkpoint` region saves its inputs through them (its `_NoopSaveInputs`)
and hides everything inside it. The recompute transient cannot be seen that way (the backward's
re-forward saves through checkpoint's own hooks), so it is measured as what it re-creates: in a
forward without checkpointing, what each decoder layer (mode "full") or each FFN sub-block, the
post-attention norm and the MLP or MoE (mode "selective"), adds to the saved bytes; its maximum is
the transient the memory model counts.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plan.memory_model import ModelDims, checkpointed_bytes_per_row, layer_bytes_per_row

#: the memory model may exceed a measurement by this factor (MEASURED_FACTOR rounds up per component)
SLACK = 1.6


@dataclass(slots=True, kw_only=True)
class SavedPerRow:
    """Saved bytes per row of one forward."""

    kept: float
    """Saved for backward at the end of the forward."""
    layers: list[float]
    """Per decoder layer: what its forward added."""
    ffns: list[float]
    """Per decoder layer: what its post-attention norm and FFN added."""


def measure_saved_bytes(model, forward: Callable[[], object], rows: int) -> SavedPerRow:
    """Run `forward()` (one microbatch forward of `model`, a `trainer.models.Qwen3NextForRL`, over
    `rows` computed rows) under saved-tensor hooks, with forward hooks on every decoder layer and
    its post-attention norm and FFN; the parameters are not counted. Keeps nothing: what `forward`
    returns is dropped."""
    from benchmarks.peer import SavedTensorBytes

    gauge = SavedTensorBytes(model)
    marks: dict[tuple[int, str], list[int]] = {}
    handles = []

    def hook(key):
        def pre(*_):
            marks.setdefault(key, []).append(gauge.live)

        def post(*_):
            marks[key].append(gauge.live)
        return pre, post

    for i, layer in enumerate(model.model.layers):
        for name, mod in (("layer", layer), ("norm", layer.post_attention_layernorm), ("ffn", layer.mlp)):
            pre, post = hook((i, name))
            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        with gauge:
            out = forward()
            kept = gauge.live
        del out
    finally:
        for h in handles:
            h.remove()

    def added(i: int, name: str) -> float:
        before, after = marks[i, name][:2]  # the forward's own call (a recompute would call again)
        return (after - before) / rows

    n = len(model.model.layers)
    return SavedPerRow(kept=kept / rows, layers=[added(i, "layer") for i in range(n)],
                       ffns=[added(i, "norm") + added(i, "ffn") for i in range(n)])


@dataclass(slots=True, kw_only=True)
class Comparison:
    """Measured against modelled bytes per row under one mode (float32, the CPU's full-logits head)."""

    mode: str
    kept: tuple[float, float]
    """(measured, memory model) kept from forward to backward."""
    transient: tuple[float, float]
    """(measured, memory model) held on top while the backward recomputes a checkpointed block."""
    allowance: float
    """Bytes per row a measurement may exceed the model by: per-microbatch tensors the per-row model
    does not count, each RMSNorm's (1 + weight) in fp32 (4 D per norm, 2 per layer and the final
    one), spread over the rows."""
    layers: list[tuple[float, float]]
    """Per decoder layer (measured, memory model) without checkpointing."""
    ffns: list[tuple[float, float]]
    """Per decoder layer (measured, memory model) of its post-attention norm and FFN, without checkpointing."""

    def check(self, slack: float = SLACK) -> None:
        """Assert measured <= model + allowance and model <= slack x measured: kept, transient, per
        layer and per FFN sub-block."""
        for what, (got, model) in [("kept", self.kept), ("transient", self.transient),
                                   *((f"layer {i}", x) for i, x in enumerate(self.layers)),
                                   *((f"layer {i} FFN", x) for i, x in enumerate(self.ffns))]:
            ok = got <= model + self.allowance and model <= slack * max(got, 1.0)
            assert ok, f"{self.mode} {what}: measured {got:.1f} B/row, model {model:.1f} (+ {self.allowance:.1f})"


def compare_with_memory_model(model, run: Callable[[str], object], *, rows: int, mode: str, chunk_size: int) -> Comparison:
    """Measure `run(mode)` and `run("none")` (each one forward of `model` over `rows` rows, in
    float32 with the full-logits head, returning what its backward would start from) and pair the
    figures with `plan.memory_model.checkpointed_bytes_per_row` and `layer_bytes_per_row`."""
    dims = ModelDims.from_hf_config(model.config.to_hf_dict())
    plain = measure_saved_bytes(model, lambda: run("none"), rows)
    got = plain if mode == "none" else measure_saved_bytes(model, lambda: run(mode), rows)
    kept, transient = checkpointed_bytes_per_row(dims, "float32", chunk_size, checkpointing=mode, head="full")
    layers = layer_bytes_per_row(dims, "float32", chunk_size)
    measured_transient = {"none": 0.0, "full": max(plain.layers), "selective": max(plain.ffns)}[mode]
    allowance = 4 * dims.hidden_size * (2 * len(layers) + 1) / rows
    return Comparison(mode=mode, kept=(got.kept, kept), transient=(measured_transient, transient), allowance=allowance,
                      layers=[(m, sum(x.values())) for m, x in zip(plain.layers, layers)],
                      ffns=[(m, x["post_norm"] + x["ffn"]) for m, x in zip(plain.ffns, layers)])
