"""Where task instances come from: a task's own generator, or a dataset of rows (JSONL, Hugging Face).

    rows = load_rows("data/train.jsonl")                      # or "hf:openai/gsm8k" (datasets, when installed)
    train, held_out = split_rows(rows, eval_fraction=0.1, seed=0)
    source = DatasetInstances(task, train, held_out, seed=0)  # each row -> task.from_row(row)
    source.train(step=3, count=16); source.eval(32)           # an epoch-wise shuffle; the held-out rows
    source = GeneratedInstances(task, seed=0)                 # task.instances(split, count, seed)

Splits, epochs and the warm start's own stream: docs/design/training-loop.md ("Conversations,
tokenizers and data").
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["load_rows", "split_rows", "DatasetInstances", "GeneratedInstances", "InstanceSource"]

#: seeds of the instances `GeneratedInstances.train(step, ...)` draws: base * 100_003 + step (what `harts rl` has used)
_STEP_SEED = 100_003
#: warm-start batches come from the task's train split at seeds above this (RL steps use seeds below)
WARM_SEED_BASE = 1_000_000


def load_rows(source: str | Path, *, split: str = "train", config: str | None = None) -> list[dict]:
    """Rows of a JSONL file (one JSON object per line, blank lines skipped) or, for "hf:<name>", of a
    Hugging Face dataset's `split` (and `config`).

    Raises:
        ValueError: a missing file, a line that is not a JSON object (naming the line), no rows,
            or "hf:" without the `datasets` package.
    """
    source = str(source)
    if source.startswith("hf:"):
        try:
            import datasets
        except ImportError:
            raise ValueError(f"data.path: {source!r} needs the Hugging Face `datasets` package "
                             "(pip install datasets), got none installed") from None
        rows = [dict(r) for r in datasets.load_dataset(source[3:], config, split=split)]
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"data.path: expected a JSONL file, got {source!r} (no such file)")
        rows = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: expected a JSON object per line, got invalid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object per line, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise ValueError(f"data.path: expected at least one row, got none in {source!r}")
    return rows


def split_rows(rows: list[dict], *, eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out): `rows` shuffled with `seed`, the first round(eval_fraction x n) held out
    (at least one when eval_fraction > 0, and at least one row left to train on)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction: expected in [0, 1), got {eval_fraction}")
    order = np.random.default_rng([seed, 7]).permutation(len(rows))
    n_eval = 0 if eval_fraction == 0 else min(max(1, round(eval_fraction * len(rows))), len(rows) - 1)
    if eval_fraction > 0 and n_eval == 0:
        raise ValueError(f"data.eval_fraction: expected at least 2 rows to hold one out, got {len(rows)}")
    held = [rows[i] for i in order[:n_eval]]
    return [rows[i] for i in order[n_eval:]], held


class InstanceSource:
    """Task instances for training batches, warm-start batches and evaluation."""

    def train(self, step: int, count: int, *, stream: int = 0) -> list:
        """The `count` instances of training batch `step` (`stream` 1: the warm start's batches)."""
        raise NotImplementedError

    def eval(self, count: int) -> list:
        """`count` held-out instances (the same every call)."""
        raise NotImplementedError


class GeneratedInstances(InstanceSource):
    """The task's own instances: `task.instances("train", count, seed)` with a seed per batch."""

    def __init__(self, task, *, seed: int):
        if not callable(getattr(task, "instances", None)):
            raise ValueError(f"data.path: task {getattr(task, 'name', task)!r} has no instances(); expected a dataset "
                             "(data.path) for it, got none")
        self.task, self.seed = task, seed

    def train(self, step: int, count: int, *, stream: int = 0) -> list:
        seed = WARM_SEED_BASE + step if stream else self.seed * _STEP_SEED + step
        return self.task.instances("train", count, seed=seed)

    def eval(self, count: int) -> list:
        return self.task.instances("eval", count, seed=self.seed)


class DatasetInstances(InstanceSource):
    """Rows handed to `task.from_row`, training rows in a seeded order per epoch (module docstring).

    Args:
        train_rows, eval_rows: the split (`split_rows`, or two files); eval_rows may be empty
            (then `eval` raises: no eval_reward without held-out rows).
        seed: the shuffle seed; shuffle: False keeps the file order.
    """

    def __init__(self, task, train_rows: list[dict], eval_rows: list[dict], *, seed: int, shuffle: bool = True):
        if not callable(getattr(task, "from_row", None)):
            raise ValueError(f"data.path: expected a task with from_row(row) to read a dataset, got "
                             f"{getattr(task, 'name', task)!r} without one")
        if not train_rows:
            raise ValueError("data.path: expected at least one training row, got none")
        self.task, self.seed, self.shuffle = task, seed, shuffle
        self.train_rows, self.eval_rows = train_rows, eval_rows
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def _order(self, stream: int, epoch: int) -> np.ndarray:
        key = (stream, epoch)
        if key not in self._orders:
            n = len(self.train_rows)
            self._orders[key] = (np.random.default_rng([self.seed, stream, epoch]).permutation(n) if self.shuffle
                                 else np.arange(n))
        return self._orders[key]

    def train(self, step: int, count: int, *, stream: int = 0) -> list:
        n = len(self.train_rows)
        out = []
        for k in range(step * count, (step + 1) * count):
            epoch, i = divmod(k, n)
            out.append(self._instance(self.train_rows[int(self._order(stream, epoch)[i])], f"train-{k}"))
        return out

    def eval(self, count: int) -> list:
        if not self.eval_rows:
            raise ValueError("data.eval_fraction: expected held-out rows for eval_reward, got none "
                             "(set data.eval_fraction > 0 or data.eval_path, or eval.every = 0)")
        return [self._instance(r, f"eval-{i}") for i, r in enumerate(self.eval_rows[:count])]

    def _instance(self, row: dict, fallback_id: str):
        try:
            return self.task.from_row(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"data row {row.get('id', fallback_id)!r}: {getattr(self.task, 'name', 'task')}.from_row "
                             f"refused it ({type(exc).__name__}: {exc})") from None
