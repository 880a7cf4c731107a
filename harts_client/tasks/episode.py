"""What a task's episodes are made of (turns, episodes) and what a task and a reward are.

Apart from `harts_client.tasks` (the registry) so that the tasks import it without a circle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

__all__ = ["Turn", "Episode", "Task", "RewardFn"]


@dataclass(slots=True)
class Turn:
    """One policy turn and the observation that followed it."""

    token_ids: list[int]
    """What the policy sampled (ends with eos when the turn finished within max_new_tokens)."""
    logprobs: list[float]
    """Log-prob of each sampled id under the sampling policy."""
    text: str
    """The decoded turn (special ids dropped)."""
    observation: str | None = None
    """The tool's answer appended after the turn; None after the last turn."""
    observation_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Episode:
    """One trajectory of a task instance: the prompt, then policy turns and observations."""

    instance: Any
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)

    @property
    def texts(self) -> list[str]:
        return [t.text for t in self.turns]


RewardFn = Callable[[Episode], float]


class Task(Protocol):
    """A verifiable multi-turn task (see the module docstring)."""

    name: str
    max_turns: int
    """Policy turns after which an episode ends whatever the policy wrote."""

    def instances(self, split: str, count: int, seed: int) -> list[Any]: ...

    def prompt(self, instance: Any) -> str: ...

    def observe(self, instance: Any, turns: list[str]) -> str | None: ...

    def reward(self, episode: Episode) -> float: ...

    def demonstration(self, instance: Any, rng) -> list[str]: ...
