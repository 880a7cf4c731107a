"""The `swe` coding environment (harts_client.tasks.swe): generated repositories whose planted bug
fails exactly the named tests, tool calls in a confined sandbox (private directory, timeout, CPU /
memory / file-size limits, no network), SWE-agent-shaped prompts, per-branch repository state and
the reward of the original tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harts_client.tasks import Episode, Turn, make_task
from harts_client.tasks.swe import parse_call
from harts_client.tasks.swe.repos import FUNCTIONS, generate_repo
from harts_client.tasks.swe.sandbox import Sandbox, SandboxLimits


def _episode(inst, texts):
    return Episode(inst, [], [Turn([], [], t) for t in texts])


@pytest.fixture(scope="module")
def box():
    return Sandbox(SandboxLimits(timeout_s=20, cpu_s=5, memory_mb=256))


@pytest.mark.parametrize("seed", range(12))
def test_the_planted_bug_fails_exactly_its_tests_and_the_fix_passes(box, seed):
    repo = generate_repo(np.random.default_rng(seed), modules=3, functions=3)
    before = box.run(repo.files, "run_tests")
    assert before["failing"] == list(repo.failing) and before["passed"] == 8, before["output"]
    fixed = box.run(repo.files, "edit", path=repo.bug.path, line=repo.bug.line, text=repo.bug.correct)
    after = box.run({**repo.files, **fixed["files"]}, "run_tests")
    assert after["failed"] == 0 and after["passed"] == 9, after["output"]


def test_every_mutation_of_the_library_is_caught():
    seen = set()
    for seed in range(400):
        repo = generate_repo(np.random.default_rng(seed), modules=3, functions=4)
        seen.add((repo.bug.function, repo.bug.buggy.strip()))
    expected = {(f.name, ln.strip().replace(a, b, 1)) for f in FUNCTIONS.values() for a, b in f.mutations
                for ln in f.body.split("\n") if a in ln}
    assert seen == expected  # generate_repo asserts a distinguishing test input for each


def test_sandbox_confines_the_code_it_runs(box, tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("mine")
    evil = {"tests/test_evil.py": (
        "import os, socket\n"
        "def test_network():\n    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
        "def test_write_outside():\n    open('/tmp/harts-swe-escape', 'w').write('x')\n"
        f"def test_delete_outside():\n    os.remove({str(keep)!r})\n"
        "def test_process():\n    os.system('true')\n"
        "def test_memory():\n    bytearray(1 << 30)\n"
        "def test_where():\n    assert os.getcwd().startswith('/') and not os.path.exists('pkg_of_another_instance')\n")}
    out = box.run(evil, "run_tests")
    failing = set(out["failing"])
    names = ("network", "write_outside", "delete_outside", "process", "memory")
    assert failing == {f"tests/test_evil.py::test_{n}" for n in names}, out
    assert keep.read_text() == "mine" and not Path("/tmp/harts-swe-escape").exists()
    assert "PermissionError" in out["output"] and "MemoryError" in out["output"]
    assert box.isolation in ("namespace", "audit-hook")


def test_sandbox_timeout_and_cpu_limit():
    spin = {"tests/test_spin.py": "def test_spin():\n    while True:\n        pass\n"}
    timed = Sandbox(SandboxLimits(timeout_s=1, cpu_s=30)).run(spin, "run_tests")
    assert timed.get("timed_out") and timed["failed"] == 1 and "timed out after 1 s" in timed["output"]
    killed = Sandbox(SandboxLimits(timeout_s=60, cpu_s=1)).run(spin, "run_tests")
    assert not killed.get("timed_out") and killed["failed"] == 1 and "exceeded" in killed["output"]


@pytest.mark.parametrize("text,call", [
    ("read_file pkg/a.py", ("read_file", {"path": "pkg/a.py"})),
    ("edit pkg/a.py 7\n    return a\n", ("edit", {"path": "pkg/a.py", "line": 7, "text": "    return a"})),
    ("write_file x.py\nprint(1)", ("write_file", {"path": "x.py", "content": "print(1)"})),
    (" run_tests ", ("run_tests", {})),
    ('{"name": "edit", "arguments": {"path": "a.py", "line": 2, "text": "x"}}', ("edit", {"path": "a.py", "line": 2, "text": "x"})),
    ('<tool_call>\n{"name": "submit", "arguments": "{}"}\n</tool_call>', ("submit", {})),
    ("rm -rf /", "error: expected one of the tools"),
    ("edit a.py seven\nx", "error: edit PATH LINE: expected a line number"),
    ("read_file", "error: read_file takes 1 argument"),
    ('{"name": "edit"', "error: expected a JSON tool call"),
    ('{"name": "read_file", "arguments": {"path": "a", "files": {}}}', "error: read_file takes the arguments ['path']"),
], ids=["read", "edit", "write", "run", "json", "tagged", "unknown", "badline", "arity", "badjson", "badargs"])
def test_tool_calls_are_parsed(text, call):
    got = parse_call(text)
    assert got == call if isinstance(call, tuple) else got.startswith(call)


def test_episode_prompt_tools_and_reward():
    task = make_task("swe", modules=2, functions=2, max_turns=5)
    inst = task.instances("train", 1, seed=0)[0]
    system, user = task.prompt(inst)
    assert system["role"] == "system" and "run_tests" in system["content"] and len(system["content"]) > 800
    assert user["role"] == "user" and all(p in user["content"] for p in inst.files)  # the whole repository, numbered
    assert task.prompt(task.instances("train", 2, seed=5)[1])[0] == system  # one system prompt for every episode
    demo = task.demonstration(inst, np.random.default_rng(0))
    answers = [task.observe(inst, demo[: k + 1]) for k in range(len(demo))]
    assert demo[0] == "run_tests" and answers[0][0]["content"].strip().endswith(" 1 failed")
    assert answers[1][0]["content"].startswith("edited ") and answers[2][0]["content"].strip().endswith(" 0 failed")
    assert answers[-1] is None and task.reward(_episode(inst, demo)) == 1.0
    assert task.reward(_episode(inst, ["submit"])) == 0.0
    assert task.observe(inst, ["hello"])[0]["content"].startswith("error: expected one of the tools")
    assert task.observe(inst, ["read_file ../../etc/passwd"])[0]["content"].startswith("error:")
    assert task.observe(inst, ["run_tests", "run_tests", "run_tests", "run_tests", "run_tests"]) is None  # max_turns
    # passing by rewriting the tests does not count: the grader restores tests/
    test_file = next(p for p in inst.files if p.startswith("tests/"))
    cheat = [f"write_file {test_file}\ndef test_ok():\n    pass", "submit"]
    assert task.observe(inst, cheat[:1])[0]["content"].startswith("wrote ") and task.reward(_episode(inst, cheat)) == 0.0
    partial = make_task("swe", modules=2, functions=2, partial_credit=True)
    assert 0.5 < partial.reward(_episode(inst, ["submit"])) < 1.0


def test_branches_keep_their_own_files_and_rebuild_them():
    task = make_task("swe", modules=1, functions=2, max_turns=6)
    inst = task.instances("eval", 1, seed=1)[0]
    path, line, text = inst.fix
    fix, wrong = f"edit {path} {line}\n{text}", f"edit {path} {line}\n    return None"
    assert task.observe(inst, [fix, "run_tests"])[0]["content"].strip().endswith(" 0 failed")
    assert " 0 failed" not in task.observe(inst, [wrong, "run_tests"])[0]["content"]  # the sibling branch
    calls = task.sandbox.calls
    task._states.clear()  # a branch whose files were evicted is rebuilt by replaying its edits
    assert task.reward(_episode(inst, [fix, "run_tests", "submit"])) == 1.0
    assert task.sandbox.calls == calls + 2  # the edit re-run, then the grading (run_tests not replayed)
    row = task.from_row({"id": "mine", "files": dict(inst.files), "issue": "fix it", "fix": {"path": path, "line": line, "text": text}})
    assert row.key != inst.key and task.demonstration(row, None) == ["run_tests", fix, "run_tests", "submit"]
    assert make_task("swe", max_turns=3).demonstration(row, None) == [fix, "run_tests", "submit"]
    assert task.from_row({"seed": 7}).files == task.from_row({"seed": 7, "id": "other"}).files
