"""`--model CFG` of the planning commands: a named config or a Qwen3-Next config.json path.

The planner never imports the trainer; the CLI resolves a name into the config.json dict the
memory model reads (plan/memory_model.py, plan/cluster_memory.py): the full-size models of
`plan.named_models` (`qwen3-next-80b-a3b`, `hybrid-moe-124b`; torch-free), else a trainer config
(`trainer.models.config.NAMED_CONFIGS`: `tiny`, `small`, ...; importing the trainer imports torch).
"""
from __future__ import annotations

import json
import os

from plan.named_models import NAMED_MODELS


def resolve_model(spec: str) -> tuple[str, dict]:
    """(name for reports, config.json dict) of `spec`: a path to a config.json (or a checkpoint
    directory holding one), else a named config.

    Raises:
        ValueError: neither a readable config.json nor a known name.
    """
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        with open(path) as fh:
            try:
                return path, json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--model {spec}: expected a config.json document, got invalid JSON ({exc})") from None
    if spec in NAMED_MODELS:
        return spec, NAMED_MODELS[spec]()
    from trainer.models.config import NAMED_CONFIGS

    if spec not in NAMED_CONFIGS:
        names = ", ".join(sorted([*NAMED_MODELS, *NAMED_CONFIGS]))
        raise ValueError(f"--model: expected a config.json path or one of {names}, got {spec!r}")
    return spec, NAMED_CONFIGS[spec]().to_hf_dict()
