"""Run one tool call of the coding environment in a subprocess: private directory, limits, no network.

    box = Sandbox(SandboxLimits(timeout_s=10, cpu_s=5, memory_mb=512))
    result = box.run(files, "run_tests")                        # {"output", "passed", "failed", ...}
    result = box.run(files, "edit", path="toolkit/numbers.py", line=7, text="    return a")
    result["files"]                                             # the files the call changed

This side: a fresh 0700 directory, `python -I -S _runner.py` in a new session, the wall-clock
timeout; the child's confinement is `_runner` (docs/design/training-loop.md, "Tasks").
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["Sandbox", "SandboxLimits", "RUNNER"]

RUNNER = Path(__file__).with_name("_runner.py")


@dataclass(slots=True, kw_only=True, frozen=True)
class SandboxLimits:
    """Limits of one tool call."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the call's process session is killed."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space in MiB (RLIMIT_AS)."""
    file_kb: int = 256
    """Largest file the call may write, KiB (RLIMIT_FSIZE)."""

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "file_kb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"task.{name}: expected > 0, got {getattr(self, name)}")


class Sandbox:
    """Runs tool calls of `_runner.py` under `limits` (docs/design/training-loop.md, "Tasks")."""

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self.isolation: str | None = None
        """How the last call was kept off the network: "namespace" or "audit-hook"."""
        self.calls = 0

    def run(self, files: dict[str, str], tool: str, **args) -> dict:
        """Run `tool` with `args` on a private copy of `files`; the runner's result dict."""
        request = {"tool": tool, "args": args, "limits": {k: v for k, v in asdict(self.limits).items() if k != "timeout_s"}}
        self.calls += 1
        with tempfile.TemporaryDirectory(prefix="harts-swe-") as tmp:
            root = Path(tmp)
            for path, text in files.items():
                dest = root / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_text(text, encoding="utf-8")
            proc = subprocess.Popen([sys.executable, "-I", "-S", str(RUNNER)], cwd=root, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    env={"PATH": os.defpath, "HOME": str(root), "LANG": "C.UTF-8"})
            try:
                out, err = proc.communicate(json.dumps(request).encode(), timeout=self.limits.timeout_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
                return {"output": f"error: {tool} timed out after {self.limits.timeout_s:g} s", "timed_out": True,
                        "passed": 0, "failed": 1}
        lines = out.decode("utf-8", "replace").strip().splitlines()
        try:
            result = json.loads(lines[-1])
        except (IndexError, ValueError):
            code = proc.returncode
            if code in (-signal.SIGKILL, -signal.SIGXCPU):
                why = f"exceeded its CPU limit ({self.limits.cpu_s} s) or was killed ({_signal_name(code)})"
            else:
                tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
                why = f"crashed ({_signal_name(code)}) {tail[0]}".rstrip()
            return {"output": f"error: {tool} {why}", "passed": 0, "failed": 1}
        if self.isolation != result.get("isolation"):
            self.isolation = result.get("isolation")
            log.info("swe sandbox: network isolation by %s", self.isolation)
        return result


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            pass
    return f"exit {code}"
