"""An example task plugin for `harts rl`: look a key up with a tool, then answer (examples/rl_plugin.toml).

    [task]
    name = "examples.plugin_task:LookupTask"          # or "examples/plugin_task.py:LookupTask"
    [data]
    path = "examples/data/lookup.jsonl"               # rows handed to LookupTask.from_row

A plugin is any class with the Task protocol (`harts_client.tasks.episode`): `harts rl` imports
it by name (the working directory is searched, as `python -m` does), builds it with the
`[task.options]` keywords and checks that it has the protocol's methods. This one reads dataset
rows {"id", "key", "table": {key: value}}; the table is hidden from the policy, which calls the
tool (`get KEY` -> "KEY = VALUE") and answers `A: VALUE`. Prompt and tool results are chat
messages: a model directory with a chat template renders them with it, the byte tokenizer joins
their contents as plain text. The reward is 1.0 for the table's value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_GET = re.compile(r"^get\s+(\S+)$")
_ANSWER = re.compile(r"^A:\s*(.+)$")


@dataclass(frozen=True)
class Lookup:
    id: str
    key: str
    table: dict


class LookupTask:
    """Find the value of a key with a lookup tool (module docstring).

    Args:
        max_turns: tool calls and answers per episode.
    """

    name = "lookup"

    def __init__(self, *, max_turns: int = 3):
        if max_turns < 2:
            raise ValueError(f"task.max_turns: expected >= 2 (a lookup and an answer), got {max_turns}")
        self.max_turns = max_turns

    def from_row(self, row: dict) -> Lookup:
        if row["key"] not in row["table"]:
            raise ValueError(f"key {row['key']!r} is not in the row's table")
        return Lookup(str(row["id"]), str(row["key"]), dict(row["table"]))

    def prompt(self, inst: Lookup) -> list[dict]:
        return [{"role": "system", "content": "Look keys up with 'get KEY'. Answer with 'A: VALUE'."},
                {"role": "user", "content": f"What is {inst.key}?"}]

    def observe(self, inst: Lookup, turns: list[str]) -> list[dict] | None:
        last = turns[-1].strip()
        if _ANSWER.match(last) or len(turns) >= self.max_turns:
            return None
        call = _GET.match(last)
        if call is None:
            return [{"role": "tool", "content": "error: say 'get KEY' or 'A: VALUE'"}]
        key = call.group(1)
        return [{"role": "tool", "content": f"{key} = {inst.table.get(key, 'unknown')}"}]

    def reward(self, episode) -> float:
        answer = _ANSWER.match(episode.texts[-1].strip()) if episode.turns else None
        return float(answer is not None and answer.group(1).strip() == episode.instance.table[episode.instance.key])

    def demonstration(self, inst: Lookup, rng) -> list[str]:
        return [f"get {inst.key}", f"A: {inst.table[inst.key]}"]
