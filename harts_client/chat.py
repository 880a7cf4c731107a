"""How a conversation becomes token ids: plain text (the byte tokenizer's format) or a chat template.

    fmt = load_format("runs/rl/hf/step-00000003")         # chat template if the directory has one
    ids = fmt.prompt_ids(task.prompt(instance))           # system + user messages, then the assistant header
    turn = engine.generate([ids], ..., stop_ids=fmt.stop_ids)[0][0]
    obs = fmt.observation_ids(messages, task.observe(instance, texts), turn.token_ids[-1])

`PlainFormat` puts text in as it is; `ChatTemplateFormat` renders with transformers'
`apply_chat_template` so that trees branch at assistant turns (docs/design/training-loop.md,
"Conversations, tokenizers and data").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from harts_client.tasks.episode import ROLES, Message, Observation
from harts_client.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ConversationFormat", "PlainFormat", "ChatTemplateFormat", "load_format", "as_format", "as_messages",
           "has_chat_template"]

_SENTINEL = "\u2063harts-assistant-content\u2063"


class ConversationFormat(Protocol):
    """What tree sampling and the warm start need to turn a task's conversation into ids."""

    vocab_size: int
    stop_ids: list[int]
    """Ids that end a policy turn (the first is what a demonstrated turn ends with)."""

    def prompt_ids(self, prompt: Observation) -> list[int]: ...

    def observation_ids(self, history: list[Message], observation: Observation, stop_id: int | None) -> list[int]: ...

    def turn_ids(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def as_messages(obs: Observation, role: str) -> list[Message]:
    """`obs` as chat messages (text becomes one message of `role`); ValueError for a malformed message."""
    if isinstance(obs, str):
        return [{"role": role, "content": obs}]
    if not isinstance(obs, list):
        raise ValueError(f"observation: expected text or a list of messages, got {type(obs).__name__}")
    for i, m in enumerate(obs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: expected {{'role': one of {list(ROLES)}, 'content': str}}, got {m!r}")
    return list(obs)


def _plain_text(obs: Observation) -> str:
    if isinstance(obs, str):
        return obs
    return "".join(m["content"] if m["content"].endswith("\n") else m["content"] + "\n" for m in as_messages(obs, "user"))


class PlainFormat:
    """Text as it is: `bos + prompt`, turn + eos, observation (the byte tokenizer's own format)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.stop_ids = [tokenizer.eos_id]

    def prompt_ids(self, prompt: Observation) -> list[int]:
        bos = [self.tokenizer.bos_id] if self.tokenizer.bos_id is not None else []
        return bos + self.tokenizer.encode(_plain_text(prompt))

    def observation_ids(self, history: list[Message], observation: Observation, stop_id: int | None) -> list[int]:
        return self.tokenizer.encode(_plain_text(observation))

    def turn_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text) + [self.tokenizer.eos_id]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def has_chat_template(directory: str | Path) -> bool:
    """Whether a model directory carries a chat template (tokenizer_config.json or chat_template.jinja)."""
    directory = Path(directory)
    if (directory / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((directory / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


class ChatTemplateFormat:
    """A model directory's chat template through transformers' `apply_chat_template` (module docstring).

    Args:
        directory: a model directory with a tokenizer and a chat template.
    """

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        self.hf = AutoTokenizer.from_pretrained(str(directory))
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"{directory}: expected a chat template in tokenizer_config.json or chat_template.jinja, got none")
        self.vocab_size = len(self.hf)
        stops = [self.hf.eos_token_id] if self.hf.eos_token_id is not None else []
        try:
            gen = json.loads((self.directory / "generation_config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError):
            gen = None
        stops += [int(i) for i in (gen if isinstance(gen, list) else [gen] if gen is not None else [])]
        if not stops:
            raise ValueError(f"{directory}: expected an eos token (tokenizer_config.json or generation_config.json), got none")
        self.stop_ids = list(dict.fromkeys(int(s) for s in stops))
        probe = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}])
        if _SENTINEL not in probe:
            raise ValueError(f"{directory}: expected the chat template to render assistant contents, got {probe[:200]!r}")
        self._close = probe[probe.index(_SENTINEL) + len(_SENTINEL):]
        """What the template writes after an assistant message's content (e.g. "<|im_end|>\\n")."""

    def _render(self, messages: list[Message], generation: bool = False) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def _encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def prompt_ids(self, prompt: Observation) -> list[int]:
        return self._encode(self._render(as_messages(prompt, "user"), generation=True))

    def observation_ids(self, history: list[Message], observation: Observation, stop_id: int | None) -> list[int]:
        """Ids between a policy turn that ended with `stop_id` and the next assistant header.

        Args:
            history: the conversation so far, ending with the assistant message just sampled.
        """
        base = self._render(history)
        full = self._render(history + as_messages(observation, "tool"), generation=True)
        if not full.startswith(base):
            raise ValueError(f"{self.directory}: expected the chat template to render a conversation's prefix as its "
                             f"prefix (tree sampling appends to the stream), got a different rendering after "
                             f"{len(history)} messages")
        close = self._close
        stop_text = self.hf.convert_ids_to_tokens(int(stop_id)) if stop_id is not None else None
        if stop_text and close.startswith(stop_text):
            close = close[len(stop_text):]  # the sampled stop id is that markup already
        return self._encode(close + full[len(base):])

    def turn_ids(self, text: str) -> list[int]:
        return self._encode(text) + [self.stop_ids[0]]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)


def load_format(directory: str | Path) -> PlainFormat | ChatTemplateFormat:
    """The conversation format of a model directory: its chat template, else plain text with its tokenizer."""
    if has_chat_template(directory):
        return ChatTemplateFormat(directory)
    return PlainFormat(load_tokenizer(directory))


def as_format(x) -> PlainFormat | ChatTemplateFormat:
    """A conversation format, or a tokenizer wrapped in `PlainFormat`."""
    return x if hasattr(x, "prompt_ids") else PlainFormat(x)
