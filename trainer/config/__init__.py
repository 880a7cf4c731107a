"""The trainer's configuration: typed sections, loaded from TOML or YAML, overridden on the command line.

    cfg = load_config("examples/train_tiny_fsdp.toml", ["--objective.clip_high", "0.28", "--job.steps", "4"])
    python -m trainer.train --config examples/train_tiny_fsdp.toml --objective.clip_high 0.28

Three modules: `schema` (the slotted `*Section` dataclasses and `TrainerConfig`), `loader` (files,
coercion, dotted overrides; `sections_from_dict` also reads `harts rl`'s files), `cli` (argparse).
Sections, precedence, aliases and errors: docs/design/training-loop.md ("Configuration").
"""
from trainer.config.cli import ALIASES, add_config_arguments, config_from_namespace, field_docs, load_config
from trainer.config.loader import config_from_dict, read_config_file, to_dict, with_overrides
from trainer.config.schema import (
    SECTIONS,
    CheckpointSection,
    ConfigError,
    ExecutorSection,
    JobSection,
    LRScheduleSection,
    MetricsSection,
    ModelSection,
    OptimizerSection,
    ParallelismSection,
    PlannerSection,
    StalenessSection,
    TrainerConfig,
)

__all__ = [
    "PlannerSection", "JobSection", "ModelSection", "ParallelismSection", "ExecutorSection", "OptimizerSection",
    "LRScheduleSection", "CheckpointSection", "MetricsSection", "StalenessSection", "TrainerConfig", "ConfigError",
    "SECTIONS", "ALIASES", "add_config_arguments", "config_from_namespace", "config_from_dict", "load_config",
    "read_config_file", "with_overrides", "to_dict", "field_docs",
]
