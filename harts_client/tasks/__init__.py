"""Verifiable multi-turn tasks for RL on the generator side: episodes, tool observations, rewards.

    task = make_task("calculator", operands=3)
    inst = task.instances("train", 8, seed=0)[0]
    task.prompt(inst); task.observe(inst, ["calc 37+45"])   # "= 82\n"; None once the episode is over
    task.reward(episode)                                    # 0.0 .. 1.0, against the ground truth
    task = make_task("examples.plugin_task:LookupTask")     # a plugin, or "path/to/my_task.py:MyTask"

Shipped (`TASKS`): `seek`, `calculator`, `swe`. The protocol (`harts_client.tasks.episode.Task`),
the tasks and user rewards: docs/design/training-loop.md ("Tasks").
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from harts_client.tasks.episode import ROLES, Episode, Message, Observation, RewardFn, Task, Turn

__all__ = ["Turn", "Episode", "Task", "RewardFn", "Message", "Observation", "ROLES", "make_task", "load_reward",
           "load_object", "TASKS"]


def _calculator(**kw) -> Task:
    from harts_client.tasks.calculator import CalculatorTask

    return CalculatorTask(**kw)


def _seek(**kw) -> Task:
    from harts_client.tasks.seek import SeekTask

    return SeekTask(**kw)


def _swe(**kw) -> Task:
    from harts_client.tasks.swe import SWETask

    return SWETask(**kw)


#: task name -> factory(**options)
TASKS: dict[str, Callable[..., Task]] = {"seek": _seek, "calculator": _calculator, "swe": _swe}
_REQUIRED = ("prompt", "observe", "reward")


def load_object(spec: str, field: str):
    """The object `spec` names: "package.module:attr" (importable; the working directory is searched
    too, as `python -m` does) or "path/to/file.py:attr".

    Raises:
        ValueError: naming `field`, for a malformed spec, a module that does not import or a missing attribute.
    """
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{field}: expected 'package.module:name' or 'path/to/file.py:name', got {spec!r}")
    try:
        if module.endswith(".py"):
            path = Path(module)
            if not path.is_file():
                raise ImportError(f"no file {path}")
            name = f"harts_plugin_{path.stem}"
            mod = sys.modules.get(name)
            if mod is None or getattr(mod, "__file__", None) != str(path.resolve()):
                loader = importlib.util.spec_from_file_location(name, path.resolve())
                mod = importlib.util.module_from_spec(loader)
                sys.modules[name] = mod  # dataclasses look their module up while a class is built
                loader.loader.exec_module(mod)
        else:
            if os.getcwd() not in sys.path:
                sys.path.append(os.getcwd())
            mod = importlib.import_module(module)
        return getattr(mod, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: expected an importable name, got {spec!r} ({type(exc).__name__}: {exc})") from None


def make_task(name: str, **options) -> Task:
    """The task `name` (a shipped one, or a plugin "package.module:Class") built with `options`.

    Raises:
        ValueError: naming the field: an unknown name, an option the task refuses, a plugin
            class that does not follow the Task protocol.
    """
    if ":" in name:
        cls = load_object(name, "task.name")
        factory: Callable[..., Task] = cls
    elif name in TASKS:
        factory = TASKS[name]
    else:
        raise ValueError(f"task.name: expected one of {sorted(TASKS)} or a plugin 'package.module:Class', got {name!r}")
    try:
        task = factory(**options)
    except TypeError as exc:
        raise ValueError(f"task.options: {exc}") from None
    missing = [m for m in _REQUIRED if not callable(getattr(task, m, None))]
    if not (callable(getattr(task, "instances", None)) or callable(getattr(task, "from_row", None))):
        missing.append("instances or from_row")
    turns = getattr(task, "max_turns", None)
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
        missing.append(f"max_turns (an int >= 1, got {turns!r})")
    if missing:
        raise ValueError(f"task.name: expected a class with the Task protocol (harts_client.tasks.episode), "
                         f"got {name!r} without {', '.join(missing)}")
    if not getattr(task, "name", None):
        task.name = name
    return task


def load_reward(spec: str) -> RewardFn:
    """A user reward `package.module:function` (called with an Episode, returns a float)."""
    fn = load_object(spec, "task.reward")
    if not callable(fn):
        raise ValueError(f"task.reward: expected a callable, got {spec!r} ({type(fn).__name__})")
    return fn
