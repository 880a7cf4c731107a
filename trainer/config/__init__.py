"""The trainer's configuration: typed sections, loaded from TOML or YAML, overridden on the command line.

    cfg = load_config("examples/train_tiny_fsdp.toml", ["--objective.clip_high", "0.28", "--job.steps", "4"])
    python -m trainer.train --config examples/train_tiny_fsdp.toml --objective.clip_high 0.28

Precedence: the dataclass defaults, then the file (`--config`, .toml / .yaml / .yml), then dotted
flags (`--section.field value`, one per leaf field; `--help` lists them with their docstrings and
defaults). The short flags of earlier releases (`--steps`, `--lr`, `--planner-url`, ...) remain
aliases of their dotted fields. Every section validates itself in `__post_init__` and errors name
the dotted field (`optimizer.lr: expected > 0, got 0.0`); unknown keys in a file are errors.

Three modules: `schema` (the slotted dataclasses), `loader` (files, coercion, dotted overrides),
`cli` (argparse). Sections (`TrainerConfig` fields): planner, job, model, parallelism, executor,
objective (`trainer.objectives.ObjectiveConfig`), optimizer, lr_schedule, checkpoint, metrics,
staleness.
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
