"""`harts gen` through a subprocess, as users and the compose demo run it."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HARTS = [sys.executable, "-m", "harts_cli.main"]


def harts(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*HARTS, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["group", "tree", "percall"])
def test_gen_writes_the_document_and_prints_stats(tmp_path, scheme):
    out = tmp_path / "rollouts.json"
    r = harts("gen", "--scheme", scheme, "--tasks", "2", "--seed", "3", "--scale", "0.02", "-o", str(out))
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    doc = json.loads(out.read_text())
    assert doc["batch_id"] == f"{scheme}-n2-s3" and doc["vocab_size"] == 256
    trajs = doc["trajectories"]
    assert stats["trajectories"] == len(trajs) and stats["scheme"] == scheme
    assert stats["expanded_tokens"] == sum(len(t["tokens"]) for t in trajs)
    assert {t["tree_id"] for t in trajs} == {"task-0", "task-1"}
    assert all(len(t["tokens"]) == len(t["loss_mask"]) and max(t["tokens"]) < 256 for t in trajs)
    # Same seed, same bytes; the library API produces the same document.
    again = tmp_path / "again.json"
    harts("gen", "--scheme", scheme, "--tasks", "2", "--seed", "3", "--scale", "0.02", "-o", str(again))
    assert again.read_bytes() == out.read_bytes()
    from harts_client.synthetic import generate

    assert generate(scheme, 2, 3, 0.02) == doc


def test_gen_to_stdout_explicit_trees_and_knobs():
    r = harts("gen", "--scheme", "tree", "--tasks", "1", "--scale", "0.02", "--form", "tree", "--branching", "3",
              "--levels", "2", "--vocab-size", "1000", "--old-logprobs", "--turns", "20:30", "--batch-id", "b7")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["batch_id"] == "b7" and doc["vocab_size"] == 1000
    [tree] = doc["trees"]
    assert len(tree["trajectories"]) == 9  # 3 ** 2 leaves
    assert all("old_logprobs" in t for t in tree["trajectories"])
    assert json.loads(r.stderr.strip().splitlines()[-1])["trajectories"] == 9


@pytest.mark.slow
def test_gen_bad_arguments_fail_clearly(tmp_path):
    r = harts("gen", "--scheme", "group", "--tasks", "1", "--scale", "-1", "-o", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "scale: expected" in r.stderr and "Traceback" not in r.stderr
    r = harts("gen", "--scheme", "group", "--tasks", "1", "--turns", "ten")
    assert r.returncode == 2 and "LO:HI" in r.stderr
    r = harts("gen", "--scheme", "beam", "--tasks", "1")
    assert r.returncode == 2


def test_gen_help_documents_the_schemes():
    r = harts("gen", "--help")
    assert r.returncode == 0
    for words in ("group", "caterpillar", "turn boundaries", "--scale", "--max-tokens-per-trajectory", "shared by all tasks"):
        assert words in r.stdout, words
