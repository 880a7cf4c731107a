"""Numbered step directories under a root, a `latest` pointer written atomically, and retention.

    root/step-00000002/      one checkpoint (trainer.checkpoint) or one export (trainer.export)
    root/step-00000004/
    root/latest              "step-00000004\n": the newest complete one

A reader that follows `latest` never sees a half-written directory: the directory is complete
before `point_latest` replaces the pointer, and every small file goes to a temporary sibling and
is renamed over the old one (`os.replace`, atomic on POSIX; docs/design/training-loop.md).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["LATEST", "PREFIX", "step_name", "write_atomic", "point_latest", "latest_name", "prune"]

LATEST = "latest"
PREFIX = "step-"


def step_name(step: int) -> str:
    """`step-XXXXXXXX` of a number of completed steps."""
    return f"{PREFIX}{step:08d}"


def write_atomic(path: str | Path, text: str) -> None:
    """Replace `path` by `text` so that a reader sees the old or the new content, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def point_latest(root: str | Path, name: str) -> None:
    """Point `root/latest` at the directory `name` (atomically)."""
    write_atomic(Path(root) / LATEST, name + "\n")


def latest_name(root: str | Path) -> str | None:
    """The name `root/latest` points at (None without a pointer)."""
    pointer = Path(root) / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` step directories under `root` (0: keep all), never the one
    `latest` names. Returns the removed directories. Call on one rank."""
    if keep <= 0:
        return []
    root = Path(root)
    current = latest_name(root)
    dirs = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit())
    doomed = [p for p in dirs[:-keep] if p.name != current]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed
