"""The engine contract shared by every inference engine (torch-free)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harts_client.rollouts import latest_export

__all__ = ["Completion", "Engine", "FollowsExports", "resolve_model_dir", "architecture", "check_generate_args"]


@dataclass(slots=True)
class Completion:
    """One sampled completion of a prompt."""

    token_ids: list[int]
    """Sampled ids; the stop id that ended it is the last one (a policy token like the others)."""
    logprobs: list[float]
    """Per sampled id: its log-prob under the sampling distribution (softmax(logits / temperature);
    the model's own log-probs at temperature 1 and for greedy decoding)."""
    finished: bool
    """Ended with a stop id (False: cut at max_new_tokens)."""


class Engine(Protocol):
    """What a generator needs of an inference engine."""

    policy_version: int
    """Version of the loaded weights (the export's `policy_version`)."""
    model_dir: Path | None
    """The directory the weights were loaded from."""

    def reload(self) -> bool:
        """Load the newest export when it differs from the loaded one; returns whether it did."""
        ...

    def load(self, path: str | Path, version: int | None = None) -> None:
        """Load the export at `path` (version: its harts.json's when None) into the engine."""
        ...

    def generate(self, prompts: list[list[int]], *, n: int, max_new_tokens: int, temperature: float, seed: int,
                 stop_ids: list[int]) -> list[list[Completion]]:
        """`n` completions per prompt (temperature 0: greedy, the n are then equal); deterministic in `seed`."""
        ...


class FollowsExports:
    """`reload()` for an engine with `root`, `model_dir` and `load(path, version)`: follow `root`'s newest export."""

    root: Path
    model_dir: Path | None

    def reload(self) -> bool:
        path, version = resolve_model_dir(self.root)
        if path == self.model_dir:
            return False
        self.load(path, version)
        return True

    def replacement(self, path: str | Path, version: int | None, engine: str) -> tuple[Path, int]:
        """(path, policy version) of an export to load in place: its version read from it when not
        given; ValueError when its architecture is not the loaded model's (`_arch`)."""
        path = Path(path)
        if version is None:
            version = resolve_model_dir(path)[1]
        if architecture(path) != self._arch:
            raise ValueError(f"{path}: expected an export of the loaded model's architecture (config.json) to update "
                             f"{engine} in place, got another one; start a new engine for it")
        return path, version


def architecture(path: str | Path) -> dict:
    """An export's config.json without what exports of one model may change (dtype, versions):
    equal for exports whose weights can replace each other in a running engine."""
    doc = json.loads((Path(path) / "config.json").read_text())
    return {k: v for k, v in doc.items() if k not in ("torch_dtype", "dtype", "transformers_version")}


def resolve_model_dir(model: str | Path) -> tuple[Path, int]:
    """(directory, policy_version) of `model`: an export root's newest export (its `latest`), or a
    model directory itself (version from its harts.json, else 0).

    Raises:
        ValueError: neither an export root with a `latest` nor a directory with config.json.
    """
    newest = latest_export(model)
    if newest is not None:
        return newest
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"generator.model: expected an export root (with `latest`) or a model directory "
                         f"(with config.json), got {str(model)!r}")
    try:
        meta = json.loads((path / "harts.json").read_text())
        version = int(meta.get("policy_version", 0))
    except (OSError, ValueError):
        version = 0
    return path, version


def check_generate_args(prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float) -> None:
    """ValueError naming the argument for what no engine can run."""
    if n < 1:
        raise ValueError(f"n: expected >= 1, got {n}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature: expected >= 0 (0: greedy), got {temperature}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}]: expected at least one token, got none")
