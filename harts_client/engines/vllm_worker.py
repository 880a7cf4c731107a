"""Runs inside vLLM's GPU workers: load a HARTS export's weights into the running model.

    vllm.LLM(model=..., worker_extension_cls="harts_client.engines.vllm_worker.ExportLoader")
    llm.collective_rpc("harts_load_export", args=("runs/rl/hf/step-00000007",))

vLLM mixes `ExportLoader` into its worker class (`worker_extension_cls`), so the method runs on
every worker with `self.model_runner` at hand. It streams the export's tensors (in the Hugging
Face layout `trainer.export` writes: per-expert weights, the original names) from its safetensors
files, one tensor at a time on the CPU, into `self.model_runner.model.load_weights(weights=...)`:
the model's own loader maps names, fuses projections and keeps each worker's tensor-parallel
shard, exactly as at start-up. Nothing here imports vLLM or torch at module level.
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
    """vLLM worker extension (module docstring)."""

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
