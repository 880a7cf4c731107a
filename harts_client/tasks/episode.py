"""What a task's episodes are made of (messages, turns, episodes) and what a task and a reward are.

    class MyTask:  # max_turns, instances(split, count, seed) and/or from_row(row), prompt(instance),
        ...        # observe(instance, turns) -> text | messages | None, reward(episode), demonstration?

Apart from `harts_client.tasks` (the registry) so that the tasks import it without a circle. The
`Task` protocol every task follows, plugins included (examples/plugin_task.py):
docs/design/training-loop.md ("Tasks").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Union

__all__ = ["Turn", "Episode", "Task", "RewardFn", "Message", "Observation", "ROLES"]

Message = dict
"""A chat message: {"role": one of ROLES, "content": str}."""
Observation = Union[str, list]
"""Plain text, or a list of Message."""
ROLES = ("system", "user", "assistant", "tool")


@dataclass(slots=True)
class Turn:
    """One policy turn and the observation that followed it."""

    token_ids: list[int]
    """What the policy sampled (ends with a stop id when the turn finished within max_new_tokens)."""
    logprobs: list[float]
    """Log-prob of each sampled id under the sampling policy."""
    text: str
    """The decoded turn (special ids dropped)."""
    observation: Observation | None = None
    """What the task answered after the turn (text or messages); None after the last turn."""
    observation_ids: list[int] = field(default_factory=list)
    """The observation's token ids as they follow the turn in the stream (chat-template markup included)."""


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
    """A verifiable multi-turn task (docs/design/training-loop.md, "Tasks": `instances` or `from_row`, and
    `demonstration`, are optional)."""

    name: str
    max_turns: int
    """Policy turns after which an episode ends whatever the policy wrote."""

    def prompt(self, instance: Any) -> Observation: ...

    def observe(self, instance: Any, turns: list[str]) -> Observation | None: ...

    def reward(self, episode: Episode) -> float: ...
