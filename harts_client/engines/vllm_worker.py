"""Runs inside vLLM's GPU workers: load a HARTS export's weights into the running model.

    vllm.LLM(model=..., worker_extension_cls="harts_client.engines.vllm_worker.ExportLoader")
    llm.collective_rpc("harts_load_export", args=("runs/rl/hf/step-00000007",))

Streams the export's safetensors tensors, one at a time on the CPU, into the worker's
`model_runner.model.load_weights` (vLLM's own name mapping and tensor-parallel shards). Nothing
here imports vLLM or torch at module level (docs/design/training-loop.md, "Engines").
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

__all__ = ["ExportLoader", "export_tensors"]


def export_tensors(path: str | Path) -> Iterator[tuple]:
    """(name, tensor) of every tensor in the export's safetensors files, one at a time."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: expected an export with .safetensors files, got none")
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class ExportLoader:
    """vLLM worker extension (docs/design/training-loop.md, "Engines")."""

    def harts_load_export(self, path: str) -> int:
        """Load the export at `path` into this worker's model; returns the number of tensors read."""
        count = 0

        def counted() -> Iterator[tuple]:
            nonlocal count
            for item in export_tensors(path):
                count += 1
                yield item

        self.model_runner.model.load_weights(weights=counted())
        return count
