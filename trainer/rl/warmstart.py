"""Supervised warm-start of the policy on a task's demonstrations, in this process.

    path, log = warm_start(cfg, task, tokenizer, out / "warmstart", plan_batch=plan_batch)   # HF directory, version 0

Each step plays `warmup.batch` demonstrated episodes (`Task.demonstration`: the policy turns, the
tool's observations between them) as flat trajectories without log-probs and with advantage 1:
the trainer's objective is then on-policy (ratio 1) and its gradient is the token-mean
cross-entropy of the demonstrated turns (observations and prompts carry no loss). Batches go
through the same planner and executor as RL (in this process: one rank, no service; the caller
passes the planner in as `plan_batch(batch_json, model_config) -> Plan`, e.g. `harts_cli.rl.run`'s
`plan_batch` on `planner_service.planner.plan_step`), so the warm start is exactly the trainer's
arithmetic. The instances come from the task's train split at
seeds above 10**6 (RL steps use seeds below). The result is written as an export
(`trainer.export.write_hf_dir`, float32, tokenizer files, policy_version 0) that the trainer ranks
load as their model and the generator samples from first.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from harts_client.rollouts import RolloutBatchBuilder, Trajectory

log = logging.getLogger("harts.rl")

__all__ = ["warm_start", "demonstration_batch", "build_policy", "WARM_SEED_BASE"]

#: warm-start batch w uses the task's train instances of seed WARM_SEED_BASE + w
WARM_SEED_BASE = 1_000_000


def demonstration_batch(task, tokenizer, batch_id: str, count: int, seed: int, rng: np.random.Generator,
                        vocab_size: int) -> RolloutBatchBuilder:
    """`count` demonstrated episodes as flat trajectories (policy turns: loss, advantage 1)."""
    batch = RolloutBatchBuilder(batch_id, vocab_size=vocab_size)
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    for j, inst in enumerate(task.instances("train", count, seed=seed)):
        traj = Trajectory(f"{batch_id}/{j}", bos + tokenizer.encode(task.prompt(inst)), group_id=f"{batch_id}/{j}")
        texts: list[str] = []
        for turn in task.demonstration(inst, rng):
            traj.add_completion(tokenizer.encode(turn) + [tokenizer.eos_id])
            texts.append(turn)
            obs = task.observe(inst, texts)
            if obs is None:
                break
            traj.add_observation(tokenizer.encode(obs))
        traj.advantage = 1.0
        batch.add(traj)
    return batch


def build_policy(cfg, tokenizer):
    """The policy model of `model.name` (named: random weights from run.seed), checked against the tokenizer."""
    from trainer.models import build_model

    model = build_model(cfg.model.name, seed=cfg.run.seed)
    if model.config.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.name: expected a vocabulary of at least the tokenizer's {tokenizer.vocab_size} ids, "
                         f"got {model.config.vocab_size}")
    return model


def warm_start(cfg, task, tokenizer, out_dir: str | Path, *, plan_batch: Callable, tokenizer_files: dict[str, str] | None = None,
               model_dir: Path | None = None) -> tuple[Path, list[dict]]:
    """Train the policy on demonstrations and write it to `out_dir`; returns (out_dir, per-step log).

    Args:
        cfg: the `RLConfig` (model, warmup, plan, run.seed).
        plan_batch: `(batch JSON document, trainer.models.config.ModelConfig) -> Plan` of one rank.
        tokenizer_files: {name: text} written beside the weights (the project tokenizer's HF files).
        model_dir: a Hugging Face model directory the policy came from (its tokenizer files are copied).
    """
    import torch

    from trainer.executor import Executor, ExecutorConfig
    from trainer.export import write_hf_dir
    from trainer.optim import make_optimizer

    torch.manual_seed(cfg.run.seed)
    model = build_policy(cfg, tokenizer)
    w = cfg.warmup
    executor = Executor(model, ExecutorConfig(chunk_size=cfg.plan.chunk_size, want_logprobs=True))
    opt = make_optimizer(model.parameters(), lr=w.lr)
    rng = np.random.default_rng([cfg.run.seed, 17])
    history: list[dict] = []
    t0 = time.perf_counter()
    for step in range(w.steps):
        batch = demonstration_batch(task, tokenizer, f"warmup-{step}", w.batch, WARM_SEED_BASE + step, rng,
                                    model.config.vocab_size)
        res = executor.run_step(plan_batch(batch.to_json("flat"), model.config))
        opt.step()
        opt.zero_grad(set_to_none=True)
        lp = np.concatenate(list(res.logprobs.values()))  # NaN where a position has no loss term
        history.append({"step": step + 1, "nll": float(-np.nanmean(lp)), "seconds": time.perf_counter() - t0})
        if step == 0 or (step + 1) % 10 == 0 or step + 1 == w.steps:
            log.info("warm start %d/%d: demonstrated-token NLL %.3f (%.1f s)", step + 1, w.steps, history[-1]["nll"],
                     history[-1]["seconds"])
    staging = Path(tempfile.mkdtemp(prefix="harts-rl-tokenizer-"))
    try:
        for name, text in (tokenizer_files or {}).items():
            (staging / name).write_text(text, encoding="utf-8")
        src = model_dir if model_dir is not None else staging
        out = write_hf_dir(out_dir, model.state_dict(), model.config, dtype=torch.float32, files_from=src,
                           meta={"policy_version": 0, "warm_start_steps": w.steps, "task": cfg.task.name})
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out, history

