"""`--model CFG` of the planning commands: a named trainer config or a Qwen3-Next config.json path.

The planner never imports the trainer; the CLI resolves a name (trainer.models.config.NAMED_CONFIGS,
e.g. `tiny`, `small`) into the config.json dict the memory model reads (plan/memory_model.py).
"""
from __future__ import annotations

import json
import os


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
    from trainer.models.config import NAMED_CONFIGS

    if spec not in NAMED_CONFIGS:
        raise ValueError(f"--model: expected a config.json path or one of {', '.join(sorted(NAMED_CONFIGS))}, got {spec!r}")
    return spec, NAMED_CONFIGS[spec]().to_hf_dict()
