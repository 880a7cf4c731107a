"""The verifiable tasks (harts_client.tasks): tool answers, episode ends, rewards, demonstrations,
plugins by name."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from harts_client.tasks import Episode, Turn, load_reward, make_task
from harts_client.tasks.calculator import evaluate

ROOT = Path(__file__).resolve().parents[2]


def _episode(task, inst, texts: list[str]) -> Episode:
    return Episode(inst, [], [Turn([], [], t) for t in texts])


def _play(task, inst, policy) -> Episode:
    """Run `policy(observations so far) -> text` through the task's tool until the episode ends."""
    texts, obs = [], [task.prompt(inst)]
    while True:
        texts.append(policy(obs))
        o = task.observe(inst, texts)
        if o is None:
            return _episode(task, inst, texts)
        obs.append(o)


def test_seek_tool_answers_and_rewards():
    task = make_task("seek", size=10)
    inst = task.instances("train", 1, seed=0)[0]
    assert inst.start == 5 and inst.number != 5 and task.max_turns == 9
    assert task.prompt(inst).endswith(f"at 5: {'above' if inst.number > 5 else 'below'}\n")
    toward = "up" if inst.number > 5 else "down"
    assert task.observe(inst, ["sideways"]) == "invalid\n"
    if abs(inst.number - 5) > 1:
        assert task.observe(inst, [toward]).startswith(f"at {5 + (1 if toward == 'up' else -1)}: ")
    # following the compass finds every number, from every start
    compass = lambda obs: "up" if obs[-1].rstrip().endswith("above") else "down"  # noqa: E731
    for rs in (False, True):
        t = make_task("seek", size=10, random_start=rs)
        insts = t.instances("eval", 50, seed=3)
        assert all(t.reward(_play(t, i, compass)) == 1.0 for i in insts)
        assert all(i.number != i.start for i in insts)
    # moving away never finds it within the turn budget when the number is far enough
    away = lambda obs: "down" if obs[-1].rstrip().endswith("above") else "up"  # noqa: E731
    far = [i for i in task.instances("train", 40, seed=1) if abs(i.number - 5) > 1]
    assert far and all(task.reward(_play(task, i, away)) == 0.0 for i in far)


def test_seek_random_demonstrations_find_about_a_third():
    task = make_task("seek", size=10)
    rng = np.random.default_rng(0)
    insts = task.instances("train", 400, seed=0)
    rewards = [task.reward(_episode(task, i, task.demonstration(i, rng))) for i in insts]
    assert 0.2 < np.mean(rewards) < 0.5
    assert all(len(task.demonstration(i, rng)) <= task.max_turns for i in insts[:20])


def test_splits_are_disjoint_streams_and_reproducible():
    task = make_task("seek", size=100, random_start=True)
    a = task.instances("train", 30, seed=4)
    assert a == task.instances("train", 30, seed=4)
    assert [(i.start, i.number) for i in a] != [(i.start, i.number) for i in task.instances("eval", 30, seed=4)]
    with pytest.raises(ValueError, match="split"):
        task.instances("test", 1, seed=0)


@pytest.mark.parametrize("expr,value", [("68-7", 61), ("-16-45", -61), ("3*-2+1", -5), ("12", 12),
                                        ("--41", None), ("1+", None), ("*:19+31", None), ("", None)])
def test_calculator_evaluates_left_to_right(expr, value):
    assert evaluate(expr) == value


def test_calculator_episode_tool_and_reward():
    task = make_task("calculator", operands=3, digits=2)
    inst = task.instances("train", 1, seed=0)[0]
    demo = task.demonstration(inst, np.random.default_rng(0))
    assert len(demo) == 3 and demo[-1] == f"A: {inst.answer}"
    assert task.observe(inst, demo[:1]) == f"= {inst.partials()[0]}\n"
    assert task.observe(inst, demo) is None and task.observe(inst, ["bogus"]) == "error\n"
    assert task.reward(_episode(task, inst, demo)) == 1.0
    assert task.reward(_episode(task, inst, demo[:2] + [f"A: {inst.answer + 1}"])) == 0.0
    partial = make_task("calculator", operands=3, digits=2, partial_credit=True)
    assert partial.reward(_episode(partial, inst, demo[:2] + ["A: x"])) == pytest.approx(2 / 3)
    noisy = make_task("calculator", operands=3, digits=2, demo_accuracy=0.0)
    insts = noisy.instances("train", 50, seed=1)
    rng = np.random.default_rng(1)
    assert np.mean([noisy.reward(_episode(noisy, i, noisy.demonstration(i, rng))) for i in insts]) < 0.2


def test_bad_task_options_name_the_field():
    with pytest.raises(ValueError, match="task.name: expected one of .* or a plugin"):
        make_task("chess")
    with pytest.raises(ValueError, match="task.size"):
        make_task("seek", size=1)
    with pytest.raises(ValueError, match="unexpected keyword"):
        make_task("seek", sizes=4)
    with pytest.raises(ValueError, match="task.ops"):
        make_task("calculator", ops="/")


def test_user_reward_is_loaded_by_name():
    fn = load_reward("harts_client.tasks.calculator:evaluate")
    assert fn("1+2") == 3
    for bad in ("nocolon", "harts_client.tasks:missing", "no.such.module:f"):
        with pytest.raises(ValueError, match="task.reward"):
            load_reward(bad)


def test_plugin_tasks_load_by_module_or_file(tmp_path, monkeypatch):
    """task.name = "module:Class" (the working directory searched, as `python -m` does) or "file.py:Class"."""
    monkeypatch.chdir(ROOT)
    by_module = make_task("examples.plugin_task:LookupTask", max_turns=4)
    by_file = make_task(str(ROOT / "examples" / "plugin_task.py") + ":LookupTask")
    assert type(by_module).__name__ == type(by_file).__name__ == "LookupTask" and by_module.max_turns == 4
    inst = by_module.from_row({"id": "r", "key": "k2", "table": {"k1": "red", "k2": "blue"}})
    demo = by_module.demonstration(inst, np.random.default_rng(0))
    assert by_module.observe(inst, demo[:1]) == [{"role": "tool", "content": "k2 = blue"}]
    assert by_module.observe(inst, demo) is None and by_module.reward(_episode(by_module, inst, demo)) == 1.0
    assert by_module.reward(_episode(by_module, inst, ["get k2", "A: red"])) == 0.0
    with pytest.raises(ValueError, match="task.options: .*unexpected keyword"):
        make_task("examples.plugin_task:LookupTask", size=3)
    with pytest.raises(ValueError, match="task.name: expected an importable name"):
        make_task("examples.plugin_task:Missing")
    with pytest.raises(ValueError, match="task.name: expected an importable name"):
        make_task("no/such/file.py:Task")
    (tmp_path / "half.py").write_text("class Half:\n    max_turns = 0\n    def prompt(self, i): return ''\n")
    with pytest.raises(ValueError, match=r"Task protocol .* without observe, reward, instances or from_row, max_turns"):
        make_task(f"{tmp_path / 'half.py'}:Half")


def test_user_reward_loads_from_a_file(tmp_path):
    (tmp_path / "r.py").write_text("def reward(episode):\n    return 0.5\n")
    assert load_reward(f"{tmp_path / 'r.py'}:reward")(None) == 0.5
