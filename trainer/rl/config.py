"""The `harts rl` configuration: typed sections read from TOML, plus the trainer ranks' config.

    cfg = load_rl_config("examples/rl_tiny.toml", steps=10, out="runs/x")
    trainer_doc = cfg.trainer_doc(planner_url=url, model_dir=path, out=Path(cfg.run.out))  # -> OUT/trainer.yaml

Sections (`RLConfig` fields, read by `trainer.config.loader.sections_from_dict`): run, task, data,
model (`PolicySection`), warmup, sampling, generator, plan, eval, metrics (`RLMetricsSection`), and
`trainer`: the trainer ranks' own sections. The fields that tie the ranks to this run
(`FORCED_TRAINER_FIELDS`) are set by `harts rl` and are errors in the file
(docs/design/training-loop.md, "Configuration").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from trainer.config.loader import config_from_dict, read_config_file, sections_from_dict
from trainer.config.schema import ConfigError

__all__ = ["RLConfig", "load_rl_config", "FORCED_TRAINER_FIELDS"]


@dataclass(slots=True, kw_only=True)
class RunSection:
    """The run: where it writes, how long, how many trainer ranks."""

    out: str = "runs/rl"
    """Output folder (recreated): warm start, exports, rollouts, planner database, logs, metrics, plot."""
    steps: int = 40
    """RL steps (one rollout batch and one trainer step each)."""
    seed: int = 0
    """Seed of the model, the warm start, the task instances and the sampling."""
    nproc: int = 2
    """Trainer ranks (torchrun --nproc_per_node; FSDP2 on gloo on the CPU)."""
    max_staleness: int = 1
    """The generator samples step n with weights of version >= n - max_staleness, so it works on
    step n + 1 while step n trains (1); 0: strictly on-policy (the generator waits for every step)."""
    step_prefix: str = "rl-"
    """Planner step ids are <step_prefix><i>."""
    timeout: float = 600.0
    """Seconds to wait for one export or one trainer step before giving up."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps: expected >= 1, got {self.steps}")
        if self.nproc < 1:
            raise ValueError(f"nproc: expected >= 1, got {self.nproc}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness: expected >= 0, got {self.max_staleness}")
        if not self.out:
            raise ValueError("out: expected a folder, got ''")
        if self.timeout <= 0:
            raise ValueError(f"timeout: expected > 0, got {self.timeout}")


@dataclass(slots=True, kw_only=True)
class TaskSection:
    """The task the policy plays (`harts_client.tasks`)."""

    name: str = "seek"
    """A shipped task of harts_client.tasks.TASKS ("seek", "calculator", "swe") or a plugin class
    "package.module:Class" / "path/to/file.py:Class" with the Task protocol (harts_client.tasks.episode)."""
    options: dict = field(default_factory=dict)
    """Keyword options of the task (e.g. size = 10)."""
    reward: str = ""
    """A user reward "package.module:function" (called with an Episode, returns a float); "": the task's."""


@dataclass(slots=True, kw_only=True)
class DataSection:
    """A dataset of task instances (`harts_client.data`): rows handed to the task's from_row."""

    path: str = ""
    """A JSONL file (one JSON object per row) or "hf:<name>" (Hugging Face `datasets`, when
    installed); "": the task generates its instances."""
    eval_path: str = ""
    """Held-out rows from this file (same forms) instead of a fraction of `path`."""
    eval_fraction: float = 0.1
    """Share of `path`'s rows held out for eval_reward (shuffled with run.seed; ignored with eval_path)."""
    shuffle: bool = True
    """Walk the training rows in a new seeded order every epoch (False: file order)."""
    hf_split: str = "train"
    """Split of a Hugging Face dataset (an eval_path "hf:..." is read with the same split and configuration)."""
    hf_config: str = ""
    """Configuration name of a Hugging Face dataset ("": its default)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction: expected in [0, 1), got {self.eval_fraction}")
        if self.eval_path and not self.path:
            raise ValueError(f"eval_path: expected data.path to be set too, got only eval_path {self.eval_path!r}")


@dataclass(slots=True, kw_only=True)
class PolicySection:
    """The policy."""

    name: str = "tiny"
    """A named config (tiny, tiny-dense, tiny-deep, small: random weights from run.seed) or a
    Qwen3-Next Hugging Face directory."""
    tokenizer: str = ""
    """A directory whose tokenizer (and chat template, if it has one) the run uses; "": model.name's
    when it is a directory with one, else the project's byte tokenizer (256 ids). Checked against
    the model's vocabulary before the warm start."""


@dataclass(slots=True, kw_only=True)
class WarmupSection:
    """Supervised warm-start on the task's demonstrations (`Task.demonstration`) before RL."""

    steps: int = 40
    """Optimizer steps (0: none; the policy starts from model.name as it is)."""
    batch: int = 32
    """Demonstrated episodes per step."""
    lr: float = 3e-3
    """AdamW learning rate."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.batch < 1 or self.lr <= 0:
            raise ValueError(f"steps/batch/lr: expected steps >= 0, batch >= 1, lr > 0, got {self.steps}, {self.batch}, {self.lr}")


@dataclass(slots=True, kw_only=True)
class SamplingSection:
    """GRPO tree sampling (`harts_client.tree_sampling.SamplingConfig`)."""

    tasks_per_step: int = 16
    """Task instances per rollout batch (one tree and one GRPO group each)."""
    branching: list[int] = field(default_factory=lambda: [4, 2])
    """Completions per open branch at each policy turn (later turns: 1)."""
    max_new_tokens: int = 8
    """Longest policy turn."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs are at 1."""
    scale_by_std: bool = True
    """GRPO advantage = (reward - group mean) / group std (False: not divided, Dr. GRPO)."""
    shared_prefix: bool = False
    """One tree per batch rooted at the prompt prefix all instances share (a long system prompt,
    computed once per batch); False: one tree per instance."""

    def __post_init__(self) -> None:
        if self.tasks_per_step < 1:
            raise ValueError(f"tasks_per_step: expected >= 1, got {self.tasks_per_step}")

    def sampling(self):
        from harts_client.tree_sampling import SamplingConfig

        return SamplingConfig(branching=list(self.branching), max_new_tokens=self.max_new_tokens,
                              temperature=self.temperature, scale_by_std=self.scale_by_std,
                              shared_prefix=self.shared_prefix)


@dataclass(slots=True, kw_only=True)
class GeneratorSection:
    """The inference engine (`harts_client.engines`)."""

    engine: str = "transformers"
    """"transformers" (GPU when there is one, else CPU), "vllm" or "sglang" (GPU; not run here)."""
    device: str = "auto"
    """Device of the transformers engine: "auto" (cuda when available), "cpu", "cuda", "cuda:1", ..."""
    options: dict = field(default_factory=dict)
    """Keywords of the engine: transformers `dtype`; vllm.LLM's (gpu_memory_utilization,
    tensor_parallel_size, ...); sglang.Engine's (mem_fraction_static, tp_size, ...)."""

    def __post_init__(self) -> None:
        from harts_client.engines import ENGINES

        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {list(ENGINES)}, got {self.engine!r}")

    def engine_options(self) -> dict:
        """The keywords `make_engine` gets."""
        return {"device": self.device, **self.options} if self.engine == "transformers" else dict(self.options)


@dataclass(slots=True, kw_only=True)
class PlanSection:
    """How batches reach the planner and how it plans them."""

    microbatch_tokens: int = 2048
    """Planner token budget per microbatch."""
    chunk_size: int = 16
    """Linear-attention chunk size (the trainer's executor.chunk_size)."""
    no_sharing: bool = False
    """Plan the trajectory-expanded baseline instead of trees (`harts rl --no-sharing`)."""
    no_windows: bool = False
    """Duplicate prefixes instead of sharing windows (ablation)."""
    form: str = "tree"
    """Wire form: "tree" (explicit trees, per-token fields on the nodes) or "flat"."""
    protobuf: bool = False
    """Send protobuf bodies instead of JSON."""

    def __post_init__(self) -> None:
        if self.form not in ("tree", "flat"):
            raise ValueError(f"form: expected 'tree' or 'flat', got {self.form!r}")
        if self.microbatch_tokens < 1:
            raise ValueError(f"microbatch_tokens: expected >= 1, got {self.microbatch_tokens}")


@dataclass(slots=True, kw_only=True)
class EvalSection:
    """Greedy evaluation on held-out instances (no training)."""

    every: int = 5
    """Evaluate the policy of every K-th version (and the warm start and the final policy; 0: never)."""
    instances: int = 32
    """Held-out instances per evaluation (the task's "eval" split)."""

    def __post_init__(self) -> None:
        if self.every < 0 or self.instances < 1:
            raise ValueError(f"every/instances: expected every >= 0 and instances >= 1, got {self.every}, {self.instances}")


@dataclass(slots=True, kw_only=True)
class RLMetricsSection:
    """Where the per-step metrics go besides OUT/metrics.jsonl and OUT/tb."""

    wandb_project: str = ""
    """Also log to this Weights & Biases project (needs the wandb package; "": no W&B)."""
    wandb_mode: str = ""
    """W&B mode: "online", "offline" (no network; `wandb sync` later) or "" ($WANDB_MODE, else online)."""
    plot: bool = True
    """Write OUT/rl.png (reward and compression per step)."""

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("", "online", "offline", "disabled"):
            raise ValueError(f"wandb_mode: expected '', 'online', 'offline' or 'disabled', got {self.wandb_mode!r}")


#: trainer fields that `harts rl` sets (an error in the file's [trainer] sections)
FORCED_TRAINER_FIELDS = {
    "planner": ("url",), "job": ("steps", "step_prefix", "step_ids", "seed"), "model": ("name",),
    "executor": ("chunk_size",), "checkpoint": ("export_every", "export_dir", "export_dtype"),
    "staleness": ("max_staleness",), "metrics": ("jsonl", "tensorboard_dir"),
}

_SECTIONS = {"run": RunSection, "task": TaskSection, "data": DataSection, "model": PolicySection, "warmup": WarmupSection,
             "sampling": SamplingSection, "generator": GeneratorSection, "plan": PlanSection, "eval": EvalSection,
             "metrics": RLMetricsSection}


@dataclass(slots=True, kw_only=True)
class RLConfig:
    """One `harts rl` run."""

    run: RunSection = field(default_factory=RunSection)
    task: TaskSection = field(default_factory=TaskSection)
    data: DataSection = field(default_factory=DataSection)
    model: PolicySection = field(default_factory=PolicySection)
    warmup: WarmupSection = field(default_factory=WarmupSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    plan: PlanSection = field(default_factory=PlanSection)
    eval: EvalSection = field(default_factory=EvalSection)
    metrics: RLMetricsSection = field(default_factory=RLMetricsSection)
    trainer: dict = field(default_factory=dict)
    """The trainer ranks' sections (trainer.config.TrainerConfig), without the forced fields."""

    def trainer_doc(self, *, planner_url: str, model_dir: Path, out: Path) -> dict:
        """The trainer ranks' config document (written to OUT/trainer.yaml)."""
        doc = {k: dict(v) for k, v in self.trainer.items()}
        doc.setdefault("planner", {})["url"] = planner_url
        doc.setdefault("job", {}).update(steps=self.run.steps, step_prefix=self.run.step_prefix, seed=self.run.seed)
        doc.setdefault("model", {})["name"] = str(model_dir)
        doc.setdefault("executor", {})["chunk_size"] = self.plan.chunk_size
        doc.setdefault("checkpoint", {}).update(export_every=1, export_dir=str(out / "hf"), export_dtype="float32")
        doc.setdefault("staleness", {})["max_staleness"] = self.run.max_staleness
        doc.setdefault("metrics", {})["jsonl"] = str(out / "trainer.jsonl")
        return doc

    def to_dict(self) -> dict:
        return {f.name: (dataclasses.asdict(getattr(self, f.name)) if f.name != "trainer" else self.trainer)
                for f in dataclasses.fields(self)}


def load_rl_config(path: str | Path | None = None, **overrides) -> RLConfig:
    """Defaults < the TOML (or YAML) file < `overrides` (run.<name> = value, e.g. steps=10, out="runs/x"),
    read by the trainer's loader (`trainer.config.loader`: values coerced to the field types).

    Raises:
        ConfigError: missing file, parse errors, unknown or forced fields, failed validation,
            and trainer sections that `trainer.config.TrainerConfig` rejects.
    """
    doc: dict = read_config_file(path) if path is not None else {}
    unknown = sorted(set(doc) - set(_SECTIONS) - {"trainer"})
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section; expected one of {', '.join([*_SECTIONS, 'trainer'])}")
    run = dict(doc.get("run", {}))
    run.update({k: v for k, v in overrides.items() if v is not None})
    doc["run"] = run
    kw = sections_from_dict({name: dict(doc.get(name, {})) for name in _SECTIONS}, _SECTIONS, where=str(path or "harts rl"))
    trainer = doc.get("trainer", {})
    for section, names in FORCED_TRAINER_FIELDS.items():
        for name in names:
            if name in trainer.get(section, {}):
                raise ConfigError(f"trainer.{section}.{name}: set by harts rl (from the run/plan sections); remove it")
    cfg = RLConfig(**kw, trainer={k: dict(v) for k, v in trainer.items()})
    try:
        config_from_dict(cfg.trainer_doc(planner_url="http://127.0.0.1:1", model_dir=Path("."), out=Path(cfg.run.out)),
                         where="trainer")
    except ConfigError as exc:
        raise ConfigError(f"trainer: {exc}") from None
    return cfg
