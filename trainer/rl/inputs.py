"""What an RL run reads before it trains: the task, its instances and the conversation format.

    task, reward_fn = run_task(cfg)                    # task.name (shipped or a plugin), task.reward
    fmt, tokenizer_dir = conversation(cfg)             # chat template, tokenizer.json or the byte tokenizer
    source = instance_source(cfg, task)                # the task's generator or data.path's rows

Torch-free: the config's sections only, and `harts_client`. `harts rl` and the RL benchmark share it.
"""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("harts.rl")

__all__ = ["run_task", "conversation", "instance_source"]


def run_task(cfg):
    """(task, reward function or None) of the `task` section."""
    from harts_client.tasks import load_reward, make_task

    task = make_task(cfg.task.name, **cfg.task.options)
    return task, (load_reward(cfg.task.reward) if cfg.task.reward else None)


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def conversation(cfg):
    """(conversation format, the directory its tokenizer files come from or None) of the run:
    model.tokenizer, else model.name when it is a directory with a tokenizer, else the byte tokenizer
    in its plain format. A directory with a chat template gets `ChatTemplateFormat`.

    Raises:
        ValueError: model.tokenizer is not a directory with a tokenizer.
    """
    from harts_client.chat import PlainFormat, load_format
    from harts_client.tokenizer import ByteTokenizer

    if cfg.model.tokenizer:
        path = Path(cfg.model.tokenizer)
        if not (path.is_dir() and _has_tokenizer(path)):
            raise ValueError(f"model.tokenizer: expected a directory with tokenizer.json or tokenizer_config.json, "
                             f"got {cfg.model.tokenizer!r}")
        return load_format(path), path
    path = Path(cfg.model.name)
    if path.is_dir() and _has_tokenizer(path):
        return load_format(path), path
    return PlainFormat(ByteTokenizer()), None


def instance_source(cfg, task):
    """The run's `harts_client.data.InstanceSource`: data.path's rows (split, shuffled with run.seed)
    handed to `task.from_row`, or the task's own `instances`.

    Raises:
        ValueError: a dataset that cannot be read, a task that cannot take it, or no held-out rows
            while eval.every asks for eval_reward.
    """
    from harts_client.data import DatasetInstances, GeneratedInstances, load_rows, split_rows

    d = cfg.data
    if not d.path:
        return GeneratedInstances(task, seed=cfg.run.seed)
    rows = load_rows(d.path, split=d.hf_split, config=d.hf_config or None)
    if d.eval_path:
        train, held = rows, load_rows(d.eval_path, split=d.hf_split, config=d.hf_config or None)
    else:
        train, held = split_rows(rows, eval_fraction=d.eval_fraction, seed=cfg.run.seed)
    if cfg.eval.every and not held:
        raise ValueError("data.eval_fraction: expected held-out rows for eval_reward (eval.every > 0), got none; "
                         "set data.eval_fraction > 0, data.eval_path, or eval.every = 0")
    log.info("data: %d training rows, %d held out (%s)", len(train), len(held), d.path)
    return DatasetInstances(task, train, held, seed=cfg.run.seed, shuffle=d.shuffle)
