"""Skip or fail a test of the shared store (`planner_service.store.postgres`) without a PostgreSQL server.

`require_postgres` skips a test locally when the server binaries are missing and fails it under CI
(`CI` set), so that a CI machine without the server cannot pass these tests by skipping them
(`.ci/run` installs them). The server itself is `benchmarks.postgres_server.PostgresServer`.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.postgres_server import find_binaries

__all__ = ["require_postgres"]


def require_postgres() -> Path:
    """The binaries' folder; skips the test when there are none, fails it under CI."""
    folder = find_binaries()
    if folder is None:
        why = "PostgreSQL server binaries (initdb, pg_ctl) not found: `apt-get install postgresql`"
        if os.environ.get("CI"):
            pytest.fail(f"{why}; .ci/run installs them, so CI must have them")
        pytest.skip(why)
    return folder
