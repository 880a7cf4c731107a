"""`harts tree`: one JSON object of forest statistics on stdout; exit 2 naming the field on bad input."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from planner_service.ingest import json_to_proto

DOC = {
    "batch_id": "cli",
    "vocab_size": 32,
    "trajectories": [
        {"id": "a", "tree_id": "t", "tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
        {"id": "b", "tree_id": "t", "tokens": [1, 2, 5]},
        {"id": "c", "tree_id": "t", "tokens": [1, 2]},
    ],
    "trees": [{"id": "e", "nodes": [{"id": 0, "tokens": [9, 9]}, {"id": 1, "parent": 0, "tokens": [8]}],
               "trajectories": [{"id": "d", "node": 1}]}],
}
EXPECTED = {"batch_id": "cli", "trajectories": 4, "trees": 2, "segments": 5, "unique_tokens": 8,
            "expanded_tokens": 12, "compression": 1.5, "max_depth": 4}


def _harts(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harts_cli.main", "tree", *args], input=stdin,
                          capture_output=True, timeout=120)


def _stats(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().strip().splitlines()
    assert len(lines) == 1, "stdout must hold exactly one JSON object"
    stats = json.loads(lines[0])
    assert stats.pop("build_seconds") >= 0
    return stats


@pytest.mark.slow
def test_tree_json_file_pb_file_and_stdin(tmp_path: pathlib.Path):
    path = tmp_path / "rollouts.json"
    path.write_text(json.dumps(DOC))
    assert _stats(_harts(str(path))) == EXPECTED
    pb = tmp_path / "rollouts.pb"
    pb.write_bytes(json_to_proto(DOC).SerializeToString())
    assert _stats(_harts(str(pb))) == EXPECTED
    assert _stats(_harts("-", stdin=path.read_bytes())) == EXPECTED


def test_tree_rejects_a_bad_batch_with_exit_2(tmp_path: pathlib.Path):
    bad = json.loads(json.dumps(DOC))
    bad["trajectories"][1]["tokens"][2] = 32
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    proc = _harts(str(path))
    assert proc.returncode == 2
    assert proc.stdout == b""
    last = proc.stderr.decode().strip().splitlines()[-1]
    assert last.startswith("harts tree: error: trajectories[1].tokens: expected token ids in [0, 32), got 32")


def test_a_command_imports_only_its_own_module(tmp_path: pathlib.Path):
    """`harts tree` pays for no other command's imports: not torch (`harts train`'s arguments)."""
    path = tmp_path / "rollouts.json"
    path.write_text(json.dumps(DOC))
    code = ("import sys; from harts_cli.main import main; rc = main(['tree', sys.argv[1]]); "
            "print(rc, 'torch' in sys.modules, file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=120)
    assert proc.stderr.decode().strip().splitlines()[-1] == "0 False", proc.stderr.decode()
