"""One-shot GPU benchmark of the trainer: throughput and MFU, log-prob fidelity, a profile, the transformers peer, the kernels.

Run (from the repository root; `scripts/gpu_check.sh` runs it after the GPU tests):

    python -m benchmarks.bench_gpu --out DIR              # the H200 run, <= 7 min with compilation
    python -m benchmarks.bench_gpu --out DIR --quick      # smaller batches, one timed step, <= 3 min
    python -m benchmarks.bench_gpu --out DIR --dry-run    # without CUDA: the tiny model on the CPU, same code paths
    python -m benchmarks.bench_gpu --render DIR           # DIR/report.md again from the section files

Sections env, throughput, fidelity, profile, peer, kernels (`benchmarks.gpu`), each under its own
budget and writing DIR/<section>.json as it ends; exit 0 when all are "ok", 1 otherwise, 143 on
SIGTERM. The model, batches, sections and settings: benchmarks/README.md ("The trainer on a GPU").
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from benchmarks.gpu.report import load, markdown
from benchmarks.gpu.runner import Runner, Terminated, write_json
from benchmarks.gpu.settings import NAMED_SETTINGS, SECTIONS

log = logging.getLogger("bench_gpu")


def _sections():
    # deferred: the sections load torch and the kernels, after main has set HARTS_AUTOTUNE and
    # CUBLAS_WORKSPACE_CONFIG (read at import and when CUDA starts)
    from benchmarks.gpu.fidelity import fidelity_section
    from benchmarks.gpu.kernel_report import kernels_section
    from benchmarks.gpu.peer_section import peer_section
    from benchmarks.gpu.step_profile import profile_section
    from benchmarks.gpu.throughput import env_section, throughput_section

    return {"env": env_section, "throughput": throughput_section, "fidelity": fidelity_section,
            "profile": profile_section, "peer": peer_section, "kernels": kernels_section}


def _write_report(out: Path) -> None:
    run_file = out / "run.json"
    command = json.loads(run_file.read_text())["command"] if run_file.is_file() else "python -m benchmarks.bench_gpu"
    (out / "report.md").write_text(markdown(load(out), command))


def run(out: Path, settings_name: str, *, budget_s: float | None = None, sections: tuple[str, ...] = SECTIONS,
        command: str = "") -> int:
    """Run `sections` of the named settings into `out`; returns the exit code (benchmarks/README.md, "The trainer on a GPU")."""
    # deferred: torch and the kernels load after main has set HARTS_AUTOTUNE and CUBLAS_WORKSPACE_CONFIG
    import torch

    from benchmarks.gpu.context import BenchContext

    settings = NAMED_SETTINGS[settings_name]()
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu: no CUDA device (torch.cuda.is_available() is False); --dry-run runs on the CPU")
    if settings.device == "cpu":
        torch.set_num_threads(1)  # a shared CPU: more threads only spin between the tiny model's small operators
    out.mkdir(parents=True, exist_ok=True)
    command = command or f"python -m benchmarks.bench_gpu --out {out}"
    write_json(out / "run.json", {"command": command, "settings": settings_name, "sections": list(sections),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "pid": os.getpid()})
    ctx = BenchContext(settings)
    budgets = {n: settings.budgets[n] for n in sections}
    runner = Runner(out, total_s=budget_s or sum(budgets.values()), nominal=budgets, order=sections,
                    on_section_end=lambda: _write_report(out))
    fns = _sections()
    log.info("bench_gpu %s: sections %s, budget %.0f s, out %s", settings_name, ",".join(sections),
             budget_s or sum(budgets.values()), out)
    try:
        for name in sections:
            doc = runner.run(name, lambda sec, fn=fns[name]: fn(ctx, sec))
            ctx.results[name] = doc["data"]
    except Terminated:
        log.error("SIGTERM: stopped after writing the running section's partial results")
        return 143
    failed = [n for n, d in runner.results.items() if d["status"] != "ok"]
    log.info("bench_gpu done: %s", f"not ok: {', '.join(failed)}" if failed else "every section ok")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="result directory (one JSON file per section, report.md)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller batches, one timed step (<= 3 min)")
    mode.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU (no CUDA needed)")
    mode.add_argument("--render", type=Path, metavar="DIR", help="only rewrite DIR/report.md from its section files")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="total seconds for every section (default: the sum of the settings' section budgets)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    if args.render:
        _write_report(args.render)
        return 0
    if args.out is None:
        ap.error("--out DIR is required (except with --render)")
    chosen = tuple(s for s in args.sections.split(",") if s)
    if unknown := sorted(set(chosen) - set(SECTIONS)):
        ap.error(f"--sections: unknown {', '.join(unknown)}; expected some of {', '.join(SECTIONS)}")
    os.environ.setdefault("HARTS_AUTOTUNE", "0")  # read when the kernels are imported, later
    # cuBLAS under torch.use_deterministic_algorithms (the executor's deterministic mode) needs a
    # fixed workspace, set before CUDA starts: 8 x 4 MiB
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    name = "dry-run" if args.dry_run else "quick" if args.quick else "full"
    return run(args.out, name, budget_s=args.budget_s, sections=tuple(s for s in SECTIONS if s in chosen),
               command="python -m benchmarks.bench_gpu " + " ".join(argv))


if __name__ == "__main__":
    sys.exit(main())
