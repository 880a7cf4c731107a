"""Supervised warm-start of the policy on a task's demonstrations, in this process.

    path, log = warm_start(cfg, task, fmt, out / "warmstart", plan_batch=plan_batch)   # HF directory, version 0

Demonstrated episodes go as flat trajectories with advantage 1 and no log-probs (on-policy: the
gradient is the token-mean cross-entropy of the demonstrated turns) through the same planner and
executor as RL; the caller passes the planner in as `plan_batch(batch_json, model_config) -> Plan`,
so the trainer never imports it. Details: docs/design/training-loop.md ("`harts rl`").
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harts_client.chat import as_format, as_messages
from harts_client.data import GeneratedInstances, InstanceSource
from harts_client.rollouts import RolloutBatchBuilder, Trajectory
from harts_client.tokenizer import check_vocab

log = logging.getLogger("harts.rl")

__all__ = ["warm_start", "demonstration_batch", "build_policy"]


def demonstration_batch(task, fmt, batch_id: str, instances: list, rng: np.random.Generator,
                        vocab_size: int) -> RolloutBatchBuilder:
    """The demonstrated episodes of `instances` as flat trajectories (policy turns: loss, advantage 1),
    rendered by the conversation format `fmt` (`harts_client.chat`) as the generator renders them,
    in one prefix-merging namespace (`tree_id`): a prompt prefix they share is computed once."""
    batch = RolloutBatchBuilder(batch_id, vocab_size=vocab_size)
    for j, inst in enumerate(instances):
        first = task.prompt(inst)
        traj = Trajectory(f"{batch_id}/{j}", fmt.prompt_ids(first), group_id=f"{batch_id}/{j}", tree_id=batch_id)
        messages, texts = as_messages(first, "user"), []
        for turn in task.demonstration(inst, rng):
            ids = fmt.turn_ids(turn)
            traj.add_completion(ids)
            texts.append(turn)
            obs = task.observe(inst, texts)
            if obs is None:
                break
            messages = messages + [{"role": "assistant", "content": turn}]
            traj.add_observation(fmt.observation_ids(messages, obs, ids[-1]))
            messages += as_messages(obs, "tool")
        traj.advantage = 1.0
        batch.add(traj)
    return batch


def build_policy(cfg, fmt):
    """The policy model of `model.name` (named: random weights from run.seed), its vocabulary checked
    against the tokenizer first (`harts_client.tokenizer.check_vocab`: one line, before any weights)."""
    from trainer.models import build_model
    from trainer.models.loading import model_config

    check_vocab(fmt, model_config(cfg.model.name).vocab_size, model=cfg.model.name)
    return build_model(cfg.model.name, seed=cfg.run.seed)


def warm_start(cfg, task, fmt, out_dir: str | Path, *, plan_batch: Callable, instances: InstanceSource | None = None,
               tokenizer_files: dict[str, str] | None = None, tokenizer_dir: Path | None = None) -> tuple[Path, list[dict]]:
    """Train the policy on demonstrations and write it to `out_dir`; returns (out_dir, per-step log).

    Args:
        cfg: the `RLConfig` (model, warmup, plan, run.seed).
        fmt: the conversation format (`harts_client.chat`), or a tokenizer (plain text).
        plan_batch: `(batch JSON document, trainer.models.config.ModelConfig) -> Plan` of one rank.
        instances: where the demonstrated instances come from (default: the task's generator).
        tokenizer_files: {name: text} written beside the weights (a tokenizer held in memory).
        tokenizer_dir: the directory whose tokenizer files, chat template and generation config
            the export carries (model.name's or model.tokenizer); the context length and token ids
            come from model.name's config.json when it is a directory (`trainer.export`).
    """
    import torch

    from trainer.executor import Executor, ExecutorConfig
    from trainer.export import TOKENIZER_FILES, write_hf_dir
    from trainer.optim import make_optimizer

    fmt = as_format(fmt)
    w = cfg.warmup
    if w.steps and not callable(getattr(task, "demonstration", None)):
        raise ValueError(f"warmup.steps: expected 0 for task {cfg.task.name!r} (it has no demonstration()), got {w.steps}")
    instances = instances or GeneratedInstances(task, seed=cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model = build_policy(cfg, fmt)
    executor = Executor(model, ExecutorConfig(chunk_size=cfg.plan.chunk_size, want_logprobs=True))
    opt = make_optimizer(model.parameters(), lr=w.lr)
    rng = np.random.default_rng([cfg.run.seed, 17])
    history: list[dict] = []
    t0 = time.perf_counter()
    for step in range(w.steps):
        batch = demonstration_batch(task, fmt, f"warmup-{step}", instances.train(step, w.batch, stream=1), rng,
                                    model.config.vocab_size)
        res = executor.run_step(plan_batch(batch.to_json("flat"), model.config))
        opt.step()
        opt.zero_grad(set_to_none=True)
        lp = np.concatenate(list(res.logprobs.values()))  # NaN where a position has no loss term
        history.append({"step": step + 1, "nll": float(-np.nanmean(lp)), "seconds": time.perf_counter() - t0})
        if step == 0 or (step + 1) % 10 == 0 or step + 1 == w.steps:
            log.info("warm start %d/%d: demonstrated-token NLL %.3f (%.1f s)", step + 1, w.steps, history[-1]["nll"],
                     history[-1]["seconds"])
    staging = Path(tempfile.mkdtemp(prefix="harts-rl-files-"))
    try:
        sources = [(tokenizer_dir, TOKENIZER_FILES), (Path(cfg.model.name), ("config.json",))]
        for directory, names in sources:
            for name in names:
                if directory is not None and (directory / name).is_file():
                    shutil.copyfile(directory / name, staging / name)
        for name, text in (tokenizer_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        out = write_hf_dir(out_dir, model.state_dict(), model.config, dtype=torch.float32, files_from=staging,
                           meta={"policy_version": 0, "warm_start_steps": w.steps, "task": cfg.task.name})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, history
