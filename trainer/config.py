"""The trainer's configuration: typed sections, loaded from TOML or YAML, overridden on the command line.

    cfg = load_config("examples/train_tiny_fsdp.toml", ["--objective.clip_high", "0.28", "--job.steps", "4"])
    python -m trainer.train --config examples/train_tiny_fsdp.toml --objective.clip_high 0.28

Precedence: the dataclass defaults, then the file (`--config`, .toml / .yaml / .yml), then dotted
flags (`--section.field value`, one per leaf field; `--help` lists them with their docstrings and
defaults). The short flags of earlier releases (`--steps`, `--lr`, `--planner-url`, ...) remain
aliases of their dotted fields. Every section validates itself in `__post_init__` and errors name
the dotted field (`optimizer.lr: expected > 0, got 0.0`); unknown keys in a file are errors.

Sections (`TrainerConfig` fields): planner, job, model, parallelism, executor, objective
(`trainer.objectives.ObjectiveConfig`), optimizer, lr_schedule, checkpoint, metrics, staleness.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from trainer.objectives import ObjectiveConfig

__all__ = [
    "PlannerConfig", "JobConfig", "ModelSection", "ParallelismConfig", "ExecutorSection", "OptimizerConfig",
    "LRScheduleConfig", "CheckpointConfig", "MetricsConfig", "StalenessConfig", "TrainerConfig", "ConfigError",
    "add_config_arguments", "config_from_namespace", "load_config", "read_config_file", "to_dict", "field_docs",
]


class ConfigError(ValueError):
    """A configuration the trainer cannot run (one line, names the dotted field)."""


@dataclass(slots=True, kw_only=True)
class PlannerConfig:
    """The planner service the ranks poll."""

    url: str = "http://127.0.0.1:8000"
    """Base URL of the planner's HTTP API (env HARTS_PLANNER_URL when not given); several
    replicas' URLs separated by commas fail over to one another."""
    token: str | None = None
    """Bearer token (env HARTS_TOKEN when not given; None: no Authorization header)."""
    plan_timeout: float = 600.0
    """Seconds to wait for one step's plan slice (long-poll)."""
    ready_timeout: float = 120.0
    """Seconds to wait for the planner to answer /readyz at start-up."""
    retry_seconds: float = 600.0
    """Seconds of planner outage (a restart, a failover) the ranks wait out before they stop."""

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("url: expected a base URL such as http://127.0.0.1:8000, got ''")
        if self.plan_timeout <= 0 or self.ready_timeout <= 0:
            raise ValueError(f"plan_timeout/ready_timeout: expected > 0, got {self.plan_timeout}, {self.ready_timeout}")
        if not 0 <= self.retry_seconds < float("inf"):
            raise ValueError(f"retry_seconds: expected a finite number of seconds >= 0, got {self.retry_seconds}")


@dataclass(slots=True, kw_only=True)
class JobConfig:
    """Which planner steps the run trains."""

    steps: int = 1
    """Total number of steps of the run (a resumed run continues up to this count)."""
    step_prefix: str = "step-"
    """Step i (0-based) is `<step_prefix><i>` unless step_ids is given."""
    step_ids: list[str] = field(default_factory=list)
    """Explicit planner step ids, one per step (at least `steps`; comma-separated on the command line)."""
    seed: int = 0
    """Seed of the random weights of a named model (every rank builds the same ones)."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")
        if self.step_ids and len(self.step_ids) < self.steps:
            raise ValueError(f"step_ids: expected at least steps={self.steps} ids, got {len(self.step_ids)}")
        if any(not s for s in self.step_ids):
            raise ValueError(f"step_ids: expected non-empty ids, got {self.step_ids}")

    def step_id(self, i: int) -> str:
        return self.step_ids[i] if self.step_ids else f"{self.step_prefix}{i}"


@dataclass(slots=True, kw_only=True)
class ModelSection:
    """The policy model."""

    name: str = "tiny"
    """A named config (tiny, tiny-dense, tiny-deep, small: random weights from job.seed) or a Qwen3-Next HF directory."""


DATA_PARALLEL = ("fsdp", "replicate")
PARAM_DTYPES = ("auto", "bfloat16", "float32")


@dataclass(slots=True, kw_only=True)
class ParallelismConfig:
    """How ranks share the model (`trainer.parallelize`)."""

    data_parallel: str = "fsdp"
    """"fsdp": FSDP2 fully_shard per decoder block + a root unit (embeddings, final norm, lm head);
    "replicate": a full replica per rank and one bucketed SUM all-reduce per step."""
    param_dtype: str = "auto"
    """Compute dtype of the FSDP2 MixedPrecisionPolicy: "auto" (bfloat16 on CUDA, float32 on CPU/gloo),
    "bfloat16" or "float32". Master weights, gradients and optimizer state stay float32."""
    reduce_dtype: str = "float32"
    """Gradient reduce-scatter dtype of FSDP2 (float32 keeps SUM exact to fp32 rounding)."""

    def __post_init__(self) -> None:
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel: expected one of {DATA_PARALLEL}, got {self.data_parallel!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"param_dtype: expected one of {PARAM_DTYPES}, got {self.param_dtype!r}")
        if self.reduce_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"reduce_dtype: expected 'float32' or 'bfloat16', got {self.reduce_dtype!r}")


@dataclass(slots=True, kw_only=True)
class ExecutorSection:
    """How plans run (`trainer.executor.ExecutorConfig`)."""

    chunk_size: int = 64
    """Linear-attention kernel chunk size C; the plans must be made for it."""
    backend: str = "ref"
    """Gated delta rule kernel backend: "ref" (PyTorch) or "triton"."""
    aux_loss_coef: float = 0.0
    """Weight of the occurrence-weighted MoE load-balancing loss."""
    attention_backend: str = "auto"
    """Tree-attention backend: "auto" ("blocked" on the CPU, "triton" on a GPU), "blocked", "triton" or "ref"."""

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "blocked", "triton", "ref"):
            raise ValueError(f"attention_backend: expected auto, blocked, triton or ref, got {self.attention_backend!r}")
        c = self.chunk_size
        if c < 1 or c & (c - 1):
            raise ValueError(f"chunk_size: expected a power of two, got {c}")
        if self.backend not in ("ref", "triton"):
            raise ValueError(f"backend: expected 'ref' or 'triton', got {self.backend!r}")
        if self.aux_loss_coef < 0:
            raise ValueError(f"aux_loss_coef: expected >= 0, got {self.aux_loss_coef}")


@dataclass(slots=True, kw_only=True)
class OptimizerConfig:
    """AdamW (torch's fused kernel) and gradient clipping."""

    name: str = "adamw"
    """Only "adamw" (decoupled weight decay)."""
    lr: float = 1e-4
    """Peak learning rate (after warmup)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas (two numbers; comma-separated on the command line)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    max_grad_norm: float = 0.0
    """Clip the global gradient norm to this (0: no clipping; the norm is logged either way)."""

    def __post_init__(self) -> None:
        if self.name != "adamw":
            raise ValueError(f"name: expected 'adamw', got {self.name!r}")
        if self.lr <= 0:
            raise ValueError(f"lr: expected > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps/weight_decay: expected eps > 0 and weight_decay >= 0, got {self.eps}, {self.weight_decay}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm: expected >= 0 (0: no clipping), got {self.max_grad_norm}")


LR_DECAYS = ("constant", "cosine", "linear")


@dataclass(slots=True, kw_only=True)
class LRScheduleConfig:
    """Learning rate per step: linear warmup, then constant, cosine or linear decay."""

    warmup_steps: int = 0
    """Steps of linear warmup from lr / (warmup_steps + 1) up to lr."""
    decay: str = "constant"
    """After warmup: "constant", "cosine" (to min_lr_ratio * lr) or "linear" (likewise)."""
    decay_steps: int = 0
    """Length of the decay after warmup (0: until job.steps)."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError(f"warmup_steps/decay_steps: expected >= 0, got {self.warmup_steps}, {self.decay_steps}")
        if self.decay not in LR_DECAYS:
            raise ValueError(f"decay: expected one of {LR_DECAYS}, got {self.decay!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio: expected in [0, 1], got {self.min_lr_ratio}")


@dataclass(slots=True, kw_only=True)
class CheckpointConfig:
    """Sharded DCP checkpoints, retention and Hugging Face exports for the generators."""

    dir: str | None = None
    """Where checkpoints go (None: none)."""
    every: int = 0
    """Checkpoint every K completed steps (0: only after the last step)."""
    resume: bool = False
    """Continue from the newest checkpoint in dir (a fresh start when there is none)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (0: keep all)."""
    export_every: int = 0
    """Export a Hugging Face directory every K completed steps (0: never), `export_dir/step-XXXXXXXX`."""
    export_dir: str | None = None
    """Where exports go (None: `<dir>/hf` when dir is set)."""
    keep_last_exports: int = 0
    """Keep only the newest N exports (0: keep all)."""
    export_dtype: str = "bfloat16"
    """dtype of the exported weights: "bfloat16", "float16" or "float32"."""

    def __post_init__(self) -> None:
        for name in ("every", "keep_last", "export_every", "keep_last_exports"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.resume and not self.dir:
            raise ValueError("resume: expected a checkpoint dir to resume from, got none; pass --checkpoint.dir")
        if self.export_dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"export_dtype: expected 'bfloat16', 'float16' or 'float32', got {self.export_dtype!r}")
        if self.export_every and not (self.export_dir or self.dir):
            raise ValueError("export_every: expected checkpoint.export_dir or checkpoint.dir to export to, got neither")

    @property
    def exports(self) -> str | None:
        return self.export_dir or (str(Path(self.dir) / "hf") if self.dir else None)


@dataclass(slots=True, kw_only=True)
class MetricsConfig:
    """Per-step metrics, written by rank 0 only."""

    jsonl: str | None = None
    """Append one JSON line per step here (its folder is created)."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars here (`tensorboard --logdir DIR`)."""
    entropy: bool = True
    """Compute the policy entropy of every loss token for the metrics (one softmax per logits row)."""


STALENESS_MODES = ("reject", "downweight")


@dataclass(slots=True, kw_only=True)
class StalenessConfig:
    """Bound on how old the policy that sampled a batch may be (AReaL's max_staleness)."""

    max_staleness: int = -1
    """Largest accepted `trainer version - batch policy_version` (-1: unbounded). The trainer's
    version is the number of completed steps, which is also what an export carries."""
    mode: str = "reject"
    """For a batch beyond the bound: "reject" (skip the step: no update, a metrics line with
    skipped=1) or "downweight" (scale its gradient by decay ** (staleness - max_staleness))."""
    decay: float = 0.5
    """Per-version factor of "downweight"."""

    def __post_init__(self) -> None:
        if self.max_staleness < -1:
            raise ValueError(f"max_staleness: expected >= 0 or -1 (unbounded), got {self.max_staleness}")
        if self.mode not in STALENESS_MODES:
            raise ValueError(f"mode: expected one of {STALENESS_MODES}, got {self.mode!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay: expected in (0, 1], got {self.decay}")


@dataclass(slots=True, kw_only=True)
class TrainerConfig:
    """One training run of `trainer.train` (every rank parses the same one)."""

    planner: PlannerConfig = field(default_factory=PlannerConfig)
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelSection = field(default_factory=ModelSection)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    executor: ExecutorSection = field(default_factory=ExecutorSection)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    staleness: StalenessConfig = field(default_factory=StalenessConfig)

    def step_id(self, i: int) -> str:
        return self.job.step_id(i)

    @classmethod
    def from_dict(cls, doc: dict, *, where: str = "config") -> "TrainerConfig":
        """Build from a nested dict ({section: {field: value}}); values are coerced to the field types.

        Raises:
            ConfigError: an unknown section or field, a value of the wrong type, a failed validation.
        """
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        kw = {}
        for name, value in doc.items():
            if name not in sections:
                raise ConfigError(f"{where}: unknown section {name!r}; expected one of {', '.join(sections)}")
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {name}: expected a table of fields, got {type(value).__name__}")
            kw[name] = _build(_SECTIONS[name], value, name, where)
        return cls(**kw)


_SECTIONS: dict[str, type] = {
    "planner": PlannerConfig, "job": JobConfig, "model": ModelSection, "parallelism": ParallelismConfig,
    "executor": ExecutorSection, "objective": ObjectiveConfig, "optimizer": OptimizerConfig,
    "lr_schedule": LRScheduleConfig, "checkpoint": CheckpointConfig, "metrics": MetricsConfig,
    "staleness": StalenessConfig,
}

#: Flags of earlier releases, kept as aliases of their dotted fields.
ALIASES: dict[str, str] = {
    "planner.url": "--planner-url", "planner.token": "--token", "planner.plan_timeout": "--plan-timeout",
    "planner.ready_timeout": "--ready-timeout", "job.steps": "--steps", "job.step_prefix": "--step-prefix",
    "job.step_ids": "--step-ids", "job.seed": "--seed", "model.name": "--model", "optimizer.lr": "--lr",
    "optimizer.weight_decay": "--weight-decay", "optimizer.max_grad_norm": "--max-grad-norm",
    "executor.backend": "--backend", "executor.chunk_size": "--chunk-size", "checkpoint.dir": "--checkpoint-dir",
    "checkpoint.every": "--checkpoint-every", "checkpoint.resume": "--resume", "checkpoint.keep_last": "--keep-last",
    "checkpoint.export_every": "--export-every", "metrics.jsonl": "--metrics-jsonl",
    "metrics.tensorboard_dir": "--tensorboard-dir", "parallelism.data_parallel": "--data-parallel",
}


def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source; "" where none)."""
    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            out[node.target.id] = " ".join(nxt.value.value.split())
    return out


def _coerce(value, hint, name: str):
    """`value` (from a file or the command line) as the field type `hint`; ValueError if it is not one."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)
    if origin in (list, tuple):
        elem = args[0] if args else str
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"expected a list, got {value!r}")
        return [_coerce(v, elem, name) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"expected a string, got {value!r}")
        return str(value)
    raise AssertionError(f"{name}: unsupported field type {hint}")


def _build(cls: type, values: dict, section: str, where: str):
    hints = _hints(cls)
    kw = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{where}: unknown field {section}.{key}; expected one of {', '.join(hints)}")
        try:
            kw[key] = _coerce(value, hints[key], f"{section}.{key}")
        except ValueError as exc:
            raise ConfigError(f"{where}: {section}.{key}: {exc}") from None
    try:
        return cls(**kw)
    except ValueError as exc:
        raise ConfigError(f"{section}.{exc}") from None


def read_config_file(path: str | Path) -> dict:
    """The nested dict of a .toml, .yaml or .yml file.

    Raises:
        ConfigError: missing file, another extension, a parse error, not a table at the top.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: expected a TOML or YAML file, got no such file")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            import tomllib

            doc = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text) or {}
        else:
            raise ConfigError(f"--config {path}: expected a .toml, .yaml or .yml file, got {path.suffix or 'no extension'!r}")
    except ConfigError:
        raise
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError
        raise ConfigError(f"--config {path}: expected valid {path.suffix[1:].upper()}, got {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"--config {path}: expected a table of sections at the top, got {type(doc).__name__}")
    return doc


def _metavar(hint) -> str:
    text = getattr(hint, "__name__", None) or str(hint)
    return text.replace("typing.", "").replace(" | None", "|none").upper()


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """`--config FILE` and one `--section.field` flag per leaf field (old flat flags as aliases).

    Every flag defaults to argparse.SUPPRESS: only what the command line sets overrides the file.
    """
    p.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE",
                   help="TOML or YAML trainer config (see examples/); dotted flags below override it")
    for section, cls in _SECTIONS.items():
        group = p.add_argument_group(f"{section}", (cls.__doc__ or "").strip().split("\n")[0])
        docs = field_docs(cls)
        defaults = to_dict(cls())
        for name, hint in _hints(cls).items():
            dest = f"{section}.{name}"
            flags = [f"--{dest}"] + ([ALIASES[dest]] if dest in ALIASES else [])
            default = defaults[name]
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            kw = dict(dest=dest, default=argparse.SUPPRESS, help=f"{docs.get(name, '')} (default: {shown})")
            if hint is bool:
                kw.update(nargs="?", const="true", metavar="BOOL")
            else:
                kw.update(metavar=_metavar(hint))
            group.add_argument(*flags, **kw)


def config_from_namespace(args: argparse.Namespace) -> TrainerConfig:
    """TrainerConfig of parsed arguments: defaults < --config file < flags < env (token and URL, only when unset)."""
    doc: dict = {}
    ns = vars(args)
    if ns.get("config"):
        doc = read_config_file(ns["config"])
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    for dest, value in ns.items():
        if "." in dest and dest.split(".", 1)[0] in _SECTIONS:
            section, name = dest.split(".", 1)
            if not isinstance(doc.setdefault(section, {}), dict):
                raise ConfigError(f"config: {section}: expected a table of fields, got {type(doc[section]).__name__}")
            doc[section][name] = value
    planner = doc.setdefault("planner", {})
    if "url" not in planner and os.environ.get("HARTS_PLANNER_URL"):
        planner["url"] = os.environ["HARTS_PLANNER_URL"]
    if "token" not in planner and os.environ.get("HARTS_TOKEN"):
        planner["token"] = os.environ["HARTS_TOKEN"]
    return TrainerConfig.from_dict(doc, where=f"--config {ns['config']}" if ns.get("config") else "config")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainerConfig:
    """Defaults < file < dotted overrides (`["--objective.clip_high", "0.28"]`), as the CLI does."""
    p = argparse.ArgumentParser(add_help=False)
    add_config_arguments(p)
    args = p.parse_args([*(["--config", str(path)] if path else []), *(overrides or [])])
    return config_from_namespace(args)


def to_dict(cfg) -> dict:
    """A config (or section) as plain nested dicts and lists, e.g. for harts.json and the metrics."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = to_dict(v) if dataclasses.is_dataclass(v) else (list(v) if isinstance(v, (list, tuple)) else v)
    return out
