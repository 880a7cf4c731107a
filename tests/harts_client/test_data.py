"""Datasets of task instances (harts_client.data): JSONL rows, the Hugging Face loader behind its
import guard, a seeded split, epoch-wise shuffled training batches and the held-out rows."""
from __future__ import annotations

import json
import sys
import types

import pytest

from harts_client.data import DatasetInstances, GeneratedInstances, load_rows, split_rows
from harts_client.tasks import make_task


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return path


class RowTask:
    name = "rows"
    max_turns = 1

    def from_row(self, row):
        return ("inst", row["i"])


def test_jsonl_rows_and_their_errors(tmp_path):
    rows = [{"i": i} for i in range(5)]
    assert load_rows(_jsonl(tmp_path / "a.jsonl", rows)) == rows  # blank lines skipped
    (tmp_path / "bad.jsonl").write_text('{"i": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object per line, got list"):
        load_rows(tmp_path / "bad.jsonl")
    (tmp_path / "bad2.jsonl").write_text('{"i": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad2.jsonl:2: .*invalid JSON"):
        load_rows(tmp_path / "bad2.jsonl")
    with pytest.raises(ValueError, match="no such file"):
        load_rows(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="at least one row"):
        load_rows(tmp_path / "empty.jsonl")


def test_hugging_face_datasets_behind_the_import_guard(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match="pip install datasets"):
        load_rows("hf:org/name")
    calls = []
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: calls.append((name, config, split)) or [{"q": "a"}, {"q": "b"}]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    assert load_rows("hf:org/name", split="test", config="main") == [{"q": "a"}, {"q": "b"}]
    assert calls == [("org/name", "main", "test")]


def test_split_is_seeded_and_disjoint():
    rows = [{"i": i} for i in range(50)]
    train, held = split_rows(rows, eval_fraction=0.2, seed=3)
    assert len(held) == 10 and len(train) == 40
    assert sorted(r["i"] for r in train + held) == list(range(50))
    assert split_rows(rows, eval_fraction=0.2, seed=3) == (train, held)
    assert split_rows(rows, eval_fraction=0.2, seed=4)[1] != held
    assert split_rows(rows, eval_fraction=0.0, seed=0) == (split_rows(rows, eval_fraction=0.0, seed=0)[0], [])
    assert len(split_rows(rows[:3], eval_fraction=0.01, seed=0)[1]) == 1  # at least one held out
    with pytest.raises(ValueError, match="eval_fraction"):
        split_rows(rows, eval_fraction=1.0, seed=0)


def test_training_batches_walk_each_epoch_in_a_seeded_order():
    rows = [{"i": i} for i in range(10)]
    src = DatasetInstances(RowTask(), rows, [{"i": 99}], seed=0)
    epoch0 = [x for s in range(5) for _, x in src.train(s, 2)]
    epoch1 = [x for s in range(5, 10) for _, x in src.train(s, 2)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))  # every row once per epoch
    assert epoch0 != epoch1 and epoch0 != list(range(10))       # a new order each epoch
    assert [x for _, x in DatasetInstances(RowTask(), rows, [], seed=0).train(0, 4)] == epoch0[:4]  # reproducible
    assert [x for _, x in DatasetInstances(RowTask(), rows, [], seed=0, shuffle=False).train(1, 3)] == [3, 4, 5]
    assert [x for _, x in src.train(0, 4, stream=1)] != epoch0[:4]  # the warm start's own stream
    assert src.eval(5) == [("inst", 99)]
    with pytest.raises(ValueError, match="held-out rows"):
        DatasetInstances(RowTask(), rows, [], seed=0).eval(1)


def test_the_task_must_take_rows():
    with pytest.raises(ValueError, match="from_row"):
        DatasetInstances(make_task("seek"), [{"i": 1}], [], seed=0)
    bad = DatasetInstances(make_task("examples/plugin_task.py:LookupTask"), [{"id": "x", "key": "k9", "table": {}}], [], seed=0)
    with pytest.raises(ValueError, match="data row 'x': lookup.from_row refused it"):
        bad.train(0, 1)
    task = make_task("seek", size=6)
    gen = GeneratedInstances(task, seed=2)
    assert gen.train(3, 4) == task.instances("train", 4, seed=2 * 100_003 + 3)  # what harts rl has always drawn
    assert gen.eval(4) == task.instances("eval", 4, seed=2)
    assert gen.train(0, 2, stream=1) == task.instances("train", 2, seed=1_000_000)
