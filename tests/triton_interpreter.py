"""Run a Triton test module on the CPU: a subprocess with TRITON_INTERPRET=1 set before triton loads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_under_interpreter(test_file: str) -> None:
    """Run tests/`test_file` (a path below tests/) under the Triton interpreter and fail with its output if anything fails."""
    pytest.importorskip("triton")
    path = Path(__file__).parent / test_file
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
