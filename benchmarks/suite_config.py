"""The benchmark suite's settings and what it may run: `SuiteConfig`, the component modules, the names.

    cfg = SuiteConfig(quick=True, only=("workloads", "planner"))
    cfg.names()                                   # what `run_suite` runs, in order

Read MODULES and NAMES through this module (`suite_config.MODULES`): tests replace them.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: component benchmarks: name -> (module, what it measures)
MODULES: dict[str, tuple[str, str]] = {
    "forest": ("benchmarks.bench_forest", "ingest: JSON/protobuf -> prefix forest, Numba vs reference"),
    "planner": ("benchmarks.bench_planner", "planner: ~1M distinct tokens, Numba vs reference, plan quality"),
    "trainer": ("benchmarks.bench_trainer", "trainer: sharing windows vs no windows vs expanded vs transformers (throughput, memory)"),
    "service": ("benchmarks.bench_service", "service: concurrent submissions and plan polling on loopback"),
    "kernels": ("benchmarks.bench_kernels", "kernels: chunked gated delta rule"),
    "rl": ("benchmarks.bench_rl", "rl: one harts rl run trained on trees and, on the same rollouts, expanded (curves, wall clock)"),
}
#: every benchmark name `--only` accepts, in run order
NAMES = ("workloads", *MODULES)


@dataclass(slots=True, kw_only=True)
class SuiteConfig:
    """What `run_suite` runs and where it writes."""

    out_dir: Path = RESULTS_DIR
    """Directory of the result files (created)."""
    quick: bool = False
    """Tiny inputs everywhere (tests); module benchmarks get run(quick=True)."""
    full: bool = False
    """Planning only at full scale (the headline benchmark only, no trainer, no modules)."""
    only: tuple[str, ...] = ()
    """Benchmark names to run (default: all of NAMES; `--full` implies "workloads")."""
    trainer: bool = True
    """Time tree vs expanded update throughput (CPU and quick modes)."""
    model: str = "small"
    """Named model config the throughput is measured on (trainer.models.NAMED_CONFIGS; quick: tiny)."""
    trainer_warmup: bool = True
    """One untimed step per execution mode before the timed ones."""
    trainer_steps: int | None = None
    """Timed optimizer steps per execution mode after one warm-up step each (None: 5, quick: 1)."""
    trainer_threads: int = 1
    """torch intra-op threads while the trainer is timed (restored afterwards; 0: torch's default).
    The timing counts process CPU seconds; with several threads those include OpenMP workers
    spinning between small operators, which weighs on the tree run (more, smaller operators) and
    is not work; see benchmarks/README.md for what 2 threads measure."""
    reference_planner: bool = True
    """Also time the plain-Python reference planner (skipped above `reference_max_tokens`)."""
    reference_max_tokens: int = 50_000_000
    """Largest distinct-token count the reference planner is timed on (about 10 s per 17M here)."""
    peer_max_tokens: int = 20_000
    """Expanded tokens of the (seeded random) trajectory subset transformers is timed on."""

    def __post_init__(self) -> None:
        bad = [n for n in self.only if n not in NAMES]
        if bad:
            raise ValueError(f"only: expected names from {', '.join(NAMES)}, got {', '.join(bad)}")
        if self.quick and self.full:
            raise ValueError("full: expected either quick or full, got both")
        if self.trainer_steps is not None and self.trainer_steps < 1:
            raise ValueError(f"trainer_steps: expected >= 1, got {self.trainer_steps}")
        if self.trainer_threads < 0:
            raise ValueError(f"trainer_threads: expected >= 0 (0: torch's default), got {self.trainer_threads}")
        self.out_dir = Path(self.out_dir)

    def names(self) -> list[str]:
        if self.full:
            return ["workloads"]
        return [n for n in NAMES if not self.only or n in self.only]


def run_mode(cfg: SuiteConfig) -> str:
    """"full", "quick" or "cpu"."""
    return "full" if cfg.full else "quick" if cfg.quick else "cpu"


def optional_attr(module: str, attr: str):
    """`module.attr`, or None when the module (or the attribute) has not landed yet."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            return None
        raise
    return getattr(mod, attr, None)
