"""The `swe` task: fix a planted bug in a small generated Python repository with sandboxed tools.

    task = make_task("swe", modules=2, functions=3, max_turns=6)
    inst = task.instances("train", 1, seed=0)[0]
    task.prompt(inst)                               # [system: tools and rules, user: failing tests + repository view]
    task.observe(inst, ["read_file toolkit/numbers.py"])                  # [tool: the file, numbered]
    task.observe(inst, [..., "run_tests"])                                # [tool: "5 passed, 1 failed ..."]
    task.reward(episode)                                                  # 1.0 when every test passes

The tool calls, the reward, the per-history file cache and dataset rows:
docs/design/training-loop.md ("Tasks").
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from harts_client.tasks.episode import Episode, Message
from harts_client.tasks.swe.repos import generate_repo
from harts_client.tasks.swe.sandbox import Sandbox, SandboxLimits

__all__ = ["SWETask", "SWEInstance", "parse_call", "SYSTEM_PROMPT"]

_SPLITS = {"train": 0, "eval": 1}
_CACHE = 8192
#: tool -> its arguments
_TOOLS = {"read_file": ("path",), "write_file": ("path", "content"), "edit": ("path", "line", "text"),
          "run_tests": (), "submit": ()}
#: tool -> how many of its arguments a command's first line holds (the lines after it are the text)
_FIRST_LINE = {"read_file": 1, "write_file": 1, "edit": 2, "run_tests": 0, "submit": 0}
_CALL_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

SYSTEM_PROMPT = """You are a software engineer working in a Python repository. Some of its tests fail because
of a bug in the package code. Find the bug and fix it so that every test passes, then submit.

Each of your messages is exactly one tool call. The tools:
  read_file PATH          show the file with line numbers
  edit PATH LINE          replace line LINE of PATH by the lines that follow this first line
  write_file PATH         replace the whole file PATH by the lines that follow this first line
  run_tests               run every test in tests/ and report what passed and what failed
  submit                  end the episode; your changes are graded by the original tests
A call may also be JSON: {"name": "edit", "arguments": {"path": "...", "line": 7, "text": "..."}}.

Rules: change the package, not the tests (the grader restores tests/). Keep the indentation of
the line you replace. Tools run in a sandbox without network access, with time and memory
limits. Look at the failing test, read the function it calls, make the smallest fix, run the
tests, and submit when they pass.
"""


@dataclass(frozen=True, slots=True)
class SWEInstance:
    """A repository to fix: its files, the issue text and (generated ones) the fix."""

    id: str
    files: dict
    """path -> text."""
    issue: str
    fix: tuple | None = None
    """(path, line, text): the edit that fixes it (for demonstrations), when known."""
    key: str = ""
    """Identity in the state cache: the id and a digest of the files (set when built)."""

    def __post_init__(self) -> None:
        digest = hashlib.sha1(json.dumps(self.files, sort_keys=True).encode()).hexdigest()[:16]
        object.__setattr__(self, "key", f"{self.id}:{digest}")


def parse_call(text: str) -> tuple[str, dict] | str:
    """(tool, arguments) of a policy message, or the error to answer (docs/design/training-loop.md, "Tasks")."""
    text = text.strip()
    tagged = _CALL_TAG.search(text)
    if tagged or text.startswith("{"):
        try:
            doc = json.loads(tagged.group(1) if tagged else text)
            name, args = doc["name"], doc.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
        except (ValueError, KeyError, TypeError) as exc:
            return f"error: expected a JSON tool call {{\"name\": ..., \"arguments\": {{...}}}}, got {text[:80]!r} ({exc})"
        if name not in _TOOLS or not isinstance(args, dict):
            return f"error: expected one of the tools {', '.join(_TOOLS)}, got {name!r}"
        if set(args) != set(_TOOLS[name]):
            return f"error: {name} takes the arguments {list(_TOOLS[name])}, got {sorted(args)}"
        return name, args
    head, _, rest = text.partition("\n")
    words = head.split()
    if not words or words[0] not in _TOOLS:
        return f"error: expected one of the tools {', '.join(_TOOLS)}, got {head[:60]!r}"
    name, operands = words[0], words[1:]
    want = _FIRST_LINE[name]
    if len(operands) != want:
        return f"error: {name} takes {want} argument(s) on its first line, got {len(operands)}"
    if name == "read_file":
        return name, {"path": operands[0]}
    if name == "write_file":
        return name, {"path": operands[0], "content": rest}
    if name == "edit":
        if not operands[1].isdigit():
            return f"error: edit PATH LINE: expected a line number, got {operands[1]!r}"
        return name, {"path": operands[0], "line": int(operands[1]), "text": rest}
    return name, {}


def _view(files: dict) -> str:
    """The repository as the prompt shows it: the file list, then every file numbered."""
    parts = ["Files:\n" + "".join(f"  {p}\n" for p in sorted(files))]
    for path in sorted(files):
        lines = files[path].split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        parts.append(f"\n{path}:\n" + "".join(f"{i:4d} | {s}\n" for i, s in enumerate(lines, 1)))
    return "".join(parts)


class SWETask:
    """Fix a planted bug with sandboxed tools (docs/design/training-loop.md, "Tasks").

    Args:
        modules, functions, cases: size of a generated repository (`repos.generate_repo`).
        max_turns: tool calls per episode (>= 1).
        partial_credit: reward the fraction of passing tests instead of all-or-nothing.
        timeout_s, cpu_s, memory_mb, file_kb: limits of one tool call (`sandbox.SandboxLimits`).
    """

    name = "swe"

    def __init__(self, *, modules: int = 2, functions: int = 3, cases: int = 3, max_turns: int = 6,
                 partial_credit: bool = False, timeout_s: float = 10.0, cpu_s: int = 5, memory_mb: int = 512,
                 file_kb: int = 256):
        if max_turns < 1:
            raise ValueError(f"task.max_turns: expected >= 1, got {max_turns}")
        generate_repo(np.random.default_rng(0), modules=modules, functions=functions, cases=cases)  # validates
        self.modules, self.functions, self.cases = modules, functions, cases
        self.max_turns, self.partial_credit = max_turns, partial_credit
        self.sandbox = Sandbox(SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, file_kb=file_kb))
        self._states: OrderedDict[tuple[str, tuple[str, ...]], dict] = OrderedDict()

    # -- instances -----------------------------------------------------------------------------
    def _generated(self, rng: np.random.Generator, id: str) -> SWEInstance:
        repo = generate_repo(rng, modules=self.modules, functions=self.functions, cases=self.cases)
        issue = f"These tests fail: {', '.join(repo.failing)}. The bug is in the {repo.package} package."
        return SWEInstance(id, repo.files, issue, (repo.bug.path, repo.bug.line, repo.bug.correct))

    def instances(self, split: str, count: int, seed: int) -> list[SWEInstance]:
        """`count` generated repositories of `split` ("train" or "eval": disjoint streams) from `seed`."""
        if split not in _SPLITS:
            raise ValueError(f"split: expected one of {sorted(_SPLITS)}, got {split!r}")
        return [self._generated(np.random.default_rng([seed, _SPLITS[split], 29, i]), f"{split}-{seed}-{i}")
                for i in range(count)]

    def from_row(self, row: dict) -> SWEInstance:
        """A dataset row: {"seed": n} (a generated repository) or {"id", "files", "issue"?, "fix"?}."""
        if "files" not in row:
            seed = int(row["seed"])
            return self._generated(np.random.default_rng([seed, 2, 29]), str(row.get("id", f"seed-{seed}")))
        files = row["files"]
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError(f"files: expected {{path: text}}, got {type(files).__name__}")
        fix = row.get("fix")
        return SWEInstance(str(row.get("id", "row")), dict(files), str(row.get("issue", "Some tests fail.")),
                           (fix["path"], int(fix["line"]), fix["text"]) if fix else None)

    # -- the episode ---------------------------------------------------------------------------
    def prompt(self, instance: SWEInstance) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{instance.issue}\n\n{_view(instance.files)}"}]

    def _state(self, instance: SWEInstance, turns: tuple[str, ...]) -> dict:
        """The files after `turns` (cached; rebuilt by replaying the edits of the branch)."""
        if not turns:
            return instance.files
        key = (instance.key, turns)
        state = self._states.get(key)
        if state is None:
            state, _ = self._call(self._state(instance, turns[:-1]), turns[-1], replay=True)
            self._remember(key, state)
        return state

    def _remember(self, key: tuple, files: dict) -> None:
        self._states[key] = files
        self._states.move_to_end(key)
        while len(self._states) > _CACHE:
            self._states.popitem(last=False)

    def _call(self, files: dict, text: str, *, replay: bool = False) -> tuple[dict, str | None]:
        """(files after the call `text`, the tool's answer; None for submit); `replay`: only what changes files runs."""
        call = parse_call(text)
        output: str | None
        if isinstance(call, str):
            output = call
        elif call[0] == "submit":
            output = None
        elif replay and call[0] in ("read_file", "run_tests"):  # changes nothing: not re-run
            output = ""
        else:
            result = self.sandbox.run(files, call[0], **call[1])
            if result.get("files"):
                files = {**files, **result["files"]}
            output = result["output"]
        return files, output

    def observe(self, instance: SWEInstance, turns: list[str]) -> list[Message] | None:
        """The tool's answer to the last call (a tool message); None after submit or the last call."""
        history = tuple(turns)
        files, output = self._call(self._state(instance, history[:-1]), history[-1])
        self._remember((instance.key, history), files)
        if output is None or len(turns) >= self.max_turns:
            return None
        return [{"role": "tool", "content": output if output.endswith("\n") else output + "\n"}]

    def reward(self, episode: Episode) -> float:
        """Run the original tests on the episode's final files (edits to tests/ undone) in the sandbox."""
        inst: SWEInstance = episode.instance
        files = self._state(inst, tuple(episode.texts))
        graded = {p: t for p, t in files.items() if not p.startswith("tests/")}
        graded.update({p: t for p, t in inst.files.items() if p.startswith("tests/")})
        result = self.sandbox.run(graded, "run_tests")
        passed, failed = int(result.get("passed", 0)), int(result.get("failed", 1))
        if self.partial_credit:
            return passed / max(1, passed + failed)
        return float(failed == 0 and passed > 0)

    def demonstration(self, instance: SWEInstance, rng: np.random.Generator) -> list[str]:
        """Reproduce (run the tests), put the correct line back (the prompt's view is numbered), run
        the tests again, submit; with max_turns < 4 the reproduction is left out, then the last
        calls. An instance without a known fix runs the tests and submits."""
        if instance.fix is None:
            return ["run_tests", "submit"][: self.max_turns]
        path, line, text = instance.fix
        turns = ["run_tests", f"edit {path} {line}\n{text}", "run_tests", "submit"]
        if self.max_turns < len(turns):
            turns = turns[1:]
        return turns[: self.max_turns]
