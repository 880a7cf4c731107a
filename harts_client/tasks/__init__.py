"""Verifiable multi-turn tasks for RL on the generator side: episodes, tool observations, rewards.

    from harts_client.tasks import make_task
    task = make_task("calculator", operands=3)
    inst = task.instances("train", 8, seed=0)[0]
    task.prompt(inst)                    # "<system line>Q: 37+45-12\n" (the tokenizer adds nothing)
    task.observe(inst, ["calc 37+45"])   # "= 82\n": the tool's answer, context for the next turn
    task.observe(inst, [..., "A: 70"])   # None: the episode is over
    task.reward(episode)                 # 0.0 .. 1.0, checked against the instance's ground truth

An episode alternates policy turns (sampled ids and their log-probs, ending with the tokenizer's
eos id) and observations (tool results: context, no loss). `Task.reward(episode) -> float` is the
verifier; a user reward is any callable with the same signature (`RewardFn`), given to the
sampler instead (`harts_client.tree_sampling.sample_trees(reward_fn=...)`, or `task.reward =
"package.module:function"` in `harts rl` configs). `Task.demonstration(instance, rng)` writes the
policy turns of a correct episode for a supervised warm-start.
"""
from __future__ import annotations

import importlib
from typing import Callable

from harts_client.tasks.episode import Episode, RewardFn, Task, Turn

__all__ = ["Turn", "Episode", "Task", "RewardFn", "make_task", "load_reward", "TASKS"]


def _calculator(**kw) -> Task:
    from harts_client.tasks.calculator import CalculatorTask

    return CalculatorTask(**kw)


def _seek(**kw) -> Task:
    from harts_client.tasks.seek import SeekTask

    return SeekTask(**kw)


#: task name -> factory(**options)
TASKS: dict[str, Callable[..., Task]] = {"seek": _seek, "calculator": _calculator}


def make_task(name: str, **options) -> Task:
    """The task `name` with its options (ValueError naming the field for an unknown name or option)."""
    if name not in TASKS:
        raise ValueError(f"task.name: expected one of {sorted(TASKS)}, got {name!r}")
    try:
        return TASKS[name](**options)
    except TypeError as exc:
        raise ValueError(f"task: {exc}") from None


def load_reward(spec: str) -> RewardFn:
    """A user reward `package.module:function` (called with an Episode, returns a float)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"task.reward: expected 'package.module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"task.reward: expected an importable function, got {spec!r} ({exc})") from None
    if not callable(fn):
        raise ValueError(f"task.reward: expected a callable, got {spec!r} ({type(fn).__name__})")
    return fn
