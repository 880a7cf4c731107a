"""The benchmark suite: `make bench` / `harts bench [--quick] [--full] [--only NAME ...]`.

    python -m benchmarks.suite [--quick | --full] [--only workloads --only planner] [--out DIR]

Runs the headline benchmark (`headline.py`) and every component module `benchmarks/bench_<name>.py`
(contract: `run(quick: bool = False) -> dict` and `main()`; a missing module is skipped), and writes
`summary.md`, `README-table.md`, `<name>.md`, `results.json` and the plots into
`benchmarks/results/`. `--full` plans at full scale and adds the placement table
(`placement_table.run_placement`). Columns, modes and targets: benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

from benchmarks import suite_config
from benchmarks.headline import WorkloadFailures, run_workloads
from benchmarks.report import write_results
from benchmarks.suite_config import RESULTS_DIR, SuiteConfig, run_mode
from harts_client.timing import timed

log = logging.getLogger("benchmarks.suite")  # also when run as __main__ (harts bench)


def run_module(name: str, cfg: SuiteConfig) -> dict:
    """Run one component benchmark module; {"status": "skipped"|"failed"|"ok", ...}."""
    module, _ = suite_config.MODULES[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return {"status": "skipped", "reason": f"{module.replace('.', '/')}.py is not present yet"}
        return {"status": "skipped", "reason": f"{module} needs {exc.name}, which is not present yet"}
    if not callable(getattr(mod, "run", None)):
        return {"status": "skipped", "reason": f"{module} has no run(quick) function"}
    result, seconds = timed(mod.run, quick=cfg.quick)
    return {"status": "ok", "seconds": seconds, "result": result}


def run_suite(cfg: SuiteConfig) -> dict:
    """Run the selected benchmarks and write every result file. Returns the results document."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict = {"mode": run_mode(cfg), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "machine": _machine(), "command": _command(cfg), "benchmarks": {}}
    for name in cfg.names():
        log.info("bench: %s ...", name)
        t0 = time.perf_counter()
        try:
            if name == "workloads":
                entry = {"status": "ok", "result": run_workloads(cfg)}
            else:
                entry = run_module(name, cfg)
        except Exception as exc:  # a failing benchmark must not hide the others' results
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            if isinstance(exc, WorkloadFailures):
                entry["result"] = {"mode": run_mode(cfg), "rows": exc.rows}
            log.error("bench: %s failed: %s", name, entry["error"])
        entry["seconds"] = time.perf_counter() - t0
        doc["benchmarks"][name] = entry
        log.info("bench: %s %s in %.1f s%s", name, entry["status"], entry["seconds"],
                 f" ({entry['reason']})" if "reason" in entry else "")
    write_results(doc, cfg)
    return doc


def _machine() -> dict:
    return {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "commit": _git_commit()}


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _command(cfg: SuiteConfig) -> str:
    parts = ["harts bench"]
    if cfg.quick:
        parts.append("--quick")
    if cfg.full:
        parts.append("--full")
    if not cfg.trainer:
        parts.append("--no-trainer")
    if not cfg.reference_planner:
        parts.append("--no-reference")
    parts += [f"--only {n}" for n in cfg.only]
    return " ".join(parts)


def _names(text: str) -> list[str]:
    out = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in out if n not in suite_config.NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected names from {', '.join(suite_config.NAMES)}, got {', '.join(bad)}")
    return out


def parser() -> argparse.ArgumentParser:
    """The suite's command line (`harts bench` forwards its arguments here unchanged)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny inputs everywhere (seconds; used by the tests)")
    mode.add_argument("--full", action="store_true",
                      help="planning only, at full scale (tens of millions of expanded tokens per workload)")
    p.add_argument("--only", type=_names, action="append", default=[], metavar="NAME[,NAME]",
                   help=f"run only these benchmarks (repeatable): {', '.join(suite_config.NAMES)}")
    p.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--trainer-steps", type=int, default=None, help="timed optimizer steps per execution mode (default 5, --quick 1)")
    p.add_argument("--no-trainer", action="store_true", help="skip the tree vs expanded update-throughput timing")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="torch intra-op threads while the trainer is timed (default 1: CPU seconds then count work, "
                        "not OpenMP workers spinning; 0: torch's default)")
    p.add_argument("--model", default="small",
                   help="named model config of the throughput timing (small: 4.7M parameters; tiny: 0.33M, overhead-bound; --quick uses tiny)")
    p.add_argument("--no-reference", action="store_true", help="do not time the plain-Python reference planner")
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.suite [--quick|--full] [--only NAME ...] [--out DIR]`: run the suite, print
    one JSON object (each benchmark's status and seconds, the results directory); exit 1 when a
    benchmark failed, 2 on bad arguments."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = SuiteConfig(
            out_dir=args.out or RESULTS_DIR, quick=args.quick, full=args.full,
            only=tuple(n for group in args.only for n in group), trainer_steps=args.trainer_steps,
            reference_planner=not args.no_reference, trainer=not args.no_trainer, model=args.model,
            trainer_threads=args.trainer_threads,
        )
    except ValueError as exc:
        print(f"python -m benchmarks.suite: error: {exc}", file=sys.stderr)
        return 2
    doc = run_suite(cfg)
    summary = {name: {"status": e["status"], "seconds": round(e["seconds"], 2), **({"reason": e["reason"]} if "reason" in e else {}),
                      **({"error": e["error"]} if "error" in e else {})}
               for name, e in doc["benchmarks"].items()}
    print(json.dumps({"mode": doc["mode"], "out": str(cfg.out_dir), "benchmarks": summary}))
    return 1 if any(e["status"] == "failed" for e in doc["benchmarks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
