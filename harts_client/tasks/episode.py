"""What a task's episodes are made of (messages, turns, episodes) and what a task and a reward are.

Apart from `harts_client.tasks` (the registry) so that the tasks import it without a circle.

The Task protocol (what `harts rl`, the warm start and `harts_client.tree_sampling` call; a plugin
`task.name = "package.module:Class"` implements it, see examples/plugin_task.py):

    task.max_turns                       policy turns after which an episode ends whatever it wrote
    task.instances(split, count, seed)   generated instances ("train" / "eval": disjoint streams)
    task.from_row(row)                   one dataset row (a JSON object) -> an instance
                                         (a task has at least one of the two)
    task.prompt(instance)                reset: the first observation, text or messages
    task.observe(instance, turns)        step: the tool results after the model's latest message
                                         (turns[-1]; turns = every policy message of this branch,
                                         decoded), text or messages; None: the episode is over
    task.reward(episode)                 the verifier: a finite float
    task.demonstration(instance, rng)    optional: policy messages of a good episode (warm start)

`prompt` and `observe` return either plain text, which goes into the token stream as it is
(the byte tokenizer's format: what `seek` and `calculator` do), or a list of chat messages
(`{"role": "system" | "user" | "assistant" | "tool", "content": str}`), which a model
directory's chat template renders (`harts_client.chat`); without a template the messages'
contents are joined as plain text. `observe` is a function of the branch's whole history, so
branches of a tree never share mutable state; a task whose state is costly to rebuild (the `swe`
sandbox) caches it by history.
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
    """A verifiable multi-turn task (see the module docstring: `instances` or `from_row`, and
    `demonstration`, are optional)."""

    name: str
    max_turns: int
    """Policy turns after which an episode ends whatever the policy wrote."""

    def prompt(self, instance: Any) -> Observation: ...

    def observe(self, instance: Any, turns: list[str]) -> Observation | None: ...

    def reward(self, episode: Episode) -> float: ...
