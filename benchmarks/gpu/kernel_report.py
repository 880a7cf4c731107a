"""Section kernels: the kernel report (`python -m benchmarks.bench_kernels --gpu`) under this section's budget.

    kernels_section(ctx, sec)   # a child process with the device to itself; its files in DIR/kernels/

Half this section's budget as its `--budget-s`, a hard timeout just before the section ends, fla
hidden unless `kernels_fla`; records the command, exit code, log tail and the report's JSON
(benchmarks/README.md, "How the sections run").
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from benchmarks.gpu.context import BenchContext
from benchmarks.gpu.runner import Section

#: seconds between the child's hard timeout and the end of this section's budget
MARGIN_S = 5.0
#: `python -c` program: `python -m benchmarks.bench_kernels` with fla not importable
HIDE_FLA = ("import runpy, sys; sys.modules['fla'] = None; "
            "runpy.run_module('benchmarks.bench_kernels', run_name='__main__', alter_sys=True)")


def kernels_section(ctx: BenchContext, sec: Section) -> None:
    ctx.release_models()
    out = sec.path.parent / "kernels"
    left = sec.left()
    entry = ["-m", "benchmarks.bench_kernels"] if ctx.s.kernels_fla else ["-c", HIDE_FLA]
    cmd = [sys.executable, *entry, "--gpu", "--out", str(out), "--budget-s", f"{max(left / 2, 1):.0f}",
           "--reps", str(ctx.s.kernels_reps)]
    if ctx.s.kernels_quick:
        cmd.append("--quick")
    sec.data["command"] = "python -m benchmarks.bench_kernels " + " ".join(cmd[3:])
    sec.data["fla_hidden"] = not ctx.s.kernels_fla
    sec.save()
    t0 = time.perf_counter()
    try:
        env = os.environ if ctx.cuda else {**os.environ, "OMP_NUM_THREADS": "1"}  # the CPU fallback: as this process
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left - MARGIN_S, 1), env=env)
        sec.data["returncode"] = proc.returncode
        log = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        sec.data["returncode"] = None
        sec.note(f"killed after {exc.timeout:.0f} s (its first shapes compile longer than the budget)")
        log = _text(exc.stdout) + _text(exc.stderr)
    sec.data["seconds"] = time.perf_counter() - t0
    sec.data["log_tail"] = log[-3000:]
    sec.data["files"] = sorted(p.name for p in out.glob("*")) if out.is_dir() else []
    for stem in ("kernels-gpu", "kernels-dry-run"):
        path = out / f"{stem}.json"
        if path.is_file():
            sec.data["report"] = json.loads(path.read_text())
            break
    if sec.data["returncode"] != 0:  # the section's status says so; what it recorded stays
        raise RuntimeError(f"bench_kernels: exit code {sec.data['returncode']} (None: killed at its timeout)")


def _text(x: str | bytes | None) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else x or ""
