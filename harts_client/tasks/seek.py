"""Walk to a hidden number with a compass tool: a verifiable multi-turn task small policies learn by RL.

    Find the hidden number 0-9. Move with 'up' or 'down'.     prompt, with the tool's first reading:
    at 5: above
    up<eos>                                                   policy turn 1: a tool call (a move)
    at 6: above                                               observation: position and direction
    up<eos>
    at 7: found                                               the episode ends (reward 1.0)

The rules, the reward and the random-move demonstration: docs/design/training-loop.md ("Tasks").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harts_client.tasks.episode import Episode

__all__ = ["SeekTask", "Target"]

_SPLITS = {"train": 0, "eval": 1}
_MOVES = {"up": 1, "down": -1}


@dataclass(frozen=True, slots=True)
class Target:
    """One instance: where the walk starts and the hidden number."""

    id: str
    start: int
    number: int


class SeekTask:
    """Find the hidden number by moving up or down (docs/design/training-loop.md, "Tasks").

    Args:
        size: the number is in [0, size) (3 <= size <= 100).
        max_turns: moves per episode (>= 1; default size - 1).
        random_start: start anywhere (default: at size // 2).
    """

    name = "seek"

    def __init__(self, *, size: int = 10, max_turns: int | None = None, random_start: bool = False):
        if not 3 <= size <= 100:
            raise ValueError(f"task.size: expected 3 <= size <= 100, got {size}")
        max_turns = size - 1 if max_turns is None else max_turns
        if max_turns < 1:
            raise ValueError(f"task.max_turns: expected >= 1, got {max_turns}")
        self.size, self.max_turns, self.random_start = size, max_turns, random_start

    def instances(self, split: str, count: int, seed: int) -> list[Target]:
        """`count` instances of `split` ("train" or "eval": disjoint streams) from `seed`."""
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {sorted(_SPLITS)}, got {split!r}")
        rng = np.random.default_rng([seed, _SPLITS[split], 11])
        out = []
        for i in range(count):
            start = int(rng.integers(0, self.size)) if self.random_start else self.size // 2
            number = int(rng.integers(0, self.size - 1))
            out.append(Target(f"{split}-{seed}-{i}", start, number + (number >= start)))
        return out

    def _reading(self, instance: Target, position: int) -> str:
        if position == instance.number:
            return f"at {position}: found"
        return f"at {position}: {'above' if instance.number > position else 'below'}"

    def prompt(self, instance: Target) -> str:
        return (f"Find the hidden number 0-{self.size - 1}. Move with 'up' or 'down'.\n"
                f"{self._reading(instance, instance.start)}\n")

    def walk(self, instance: Target, turns: list[str]) -> tuple[int, bool, bool]:
        """(position, found, last turn valid) after the moves in `turns`."""
        position, valid = instance.start, True
        for text in turns:
            step = _MOVES.get(text.strip())
            valid = step is not None
            if valid:
                position = min(max(position + step, 0), self.size - 1)
            if position == instance.number:
                return position, True, valid
        return position, False, valid

    def observe(self, instance: Target, turns: list[str]) -> str | None:
        """The tool's answer to the last move; None when the episode is over."""
        position, found, valid = self.walk(instance, turns)
        if found or len(turns) >= self.max_turns:
            return None
        return (self._reading(instance, position) if valid else "invalid") + "\n"

    def reward(self, episode: Episode) -> float:
        return float(self.walk(episode.instance, episode.texts)[1])

    def demonstration(self, instance: Target, rng: np.random.Generator) -> list[str]:
        """Random moves until the number is found or the moves run out."""
        turns: list[str] = []
        while len(turns) < self.max_turns:
            turns.append("up" if rng.random() < 0.5 else "down")
            if self.walk(instance, turns)[1]:
                break
        return turns
