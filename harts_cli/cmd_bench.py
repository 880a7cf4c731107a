"""Run the benchmark suite and write benchmarks/results (summary.md, README-table.md, plots).

Run: `harts bench` (CPU scale, a few minutes), `harts bench --quick` (tiny inputs),
`harts bench --full` (planning only, full-scale workloads of tens of millions of expanded tokens),
`harts bench --only planner --only workloads`. Benchmarks whose module has not landed are
skipped and listed as such. Prints one JSON object on stdout: each benchmark's status and seconds,
and the files written.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

NAMES = ("workloads", "forest", "planner", "trainer", "service", "kernels", "rl")


def _names(text: str) -> list[str]:
    out = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in out if n not in NAMES]
    if bad:
        raise argparse.ArgumentTypeError(f"expected names from {', '.join(NAMES)}, got {', '.join(bad)}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny inputs everywhere (seconds; used by the tests)")
    mode.add_argument("--full", action="store_true",
                      help="planning only, at full scale (tens of millions of expanded tokens per workload)")
    p.add_argument("--only", type=_names, action="append", default=[], metavar="NAME[,NAME]",
                   help=f"run only these benchmarks (repeatable): {', '.join(NAMES)}")
    p.add_argument("--out", type=Path, default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--trainer-steps", type=int, default=None, help="timed optimizer steps per execution mode (default 5, --quick 1)")
    p.add_argument("--no-trainer", action="store_true", help="skip the tree vs expanded update-throughput timing")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="torch intra-op threads while the trainer is timed (default 1: CPU seconds then count work, "
                        "not OpenMP workers spinning; 0: torch's default)")
    p.add_argument("--model", default="small",
                   help="named model config of the throughput timing (small: 4.7M parameters; tiny: 0.33M, overhead-bound; --quick uses tiny)")
    p.add_argument("--no-reference", action="store_true", help="do not time the plain-Python reference planner")


def run(args: argparse.Namespace) -> int:
    from benchmarks.suite import RESULTS_DIR, SuiteConfig, run_suite

    cfg = SuiteConfig(
        out_dir=args.out or RESULTS_DIR, quick=args.quick, full=args.full,
        only=tuple(n for group in args.only for n in group), trainer_steps=args.trainer_steps,
        reference_planner=not args.no_reference, trainer=not args.no_trainer, model=args.model,
        trainer_threads=args.trainer_threads,
    )
    doc = run_suite(cfg)
    summary = {name: {"status": e["status"], "seconds": round(e["seconds"], 2), **({"reason": e["reason"]} if "reason" in e else {}),
                      **({"error": e["error"]} if "error" in e else {})}
               for name, e in doc["benchmarks"].items()}
    print(json.dumps({"mode": doc["mode"], "out": str(cfg.out_dir), "benchmarks": summary}))
    return 1 if any(e["status"] == "failed" for e in doc["benchmarks"].values()) else 0
