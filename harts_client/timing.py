"""How HARTS times work: the one clock discipline of `harts calibrate`, the demo and the benchmarks.

    out, seconds = timed(plan_step, forest, cfg)            # one call, wall seconds
    with Stopwatch() as sw:                                 # wall and process-CPU seconds of a block
        train_step(ex, plan, opt)
    runs = repeat(fn, 5, warmup=2, sync=torch.cuda.synchronize)
    runs.median("wall"), runs.fastest("cpu").wall, runs.result

Stdlib only, below both the CLI and the benchmarks. Which clock counts where:
benchmarks/README.md ("How work is timed").
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the clocks a `Sample` carries
CLOCKS = ("wall", "cpu")


@dataclass(slots=True, frozen=True)
class Sample:
    """Seconds of one timed run on both clocks."""

    wall: float
    """Wall-clock seconds (`time.perf_counter`)."""
    cpu: float
    """CPU seconds of this process, all its threads (`time.process_time`)."""

    def on(self, clock: str) -> float:
        """The seconds of `clock` ("wall" or "cpu").

        Raises:
            ValueError: another clock name.
        """
        if clock not in CLOCKS:
            raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")
        return self.wall if clock == "wall" else self.cpu


class Stopwatch:
    """Context manager timing its block on both clocks: `sw.wall`, `sw.cpu` (and `sw.sample`) after it."""

    __slots__ = ("_wall0", "_cpu0", "wall", "cpu")

    def __enter__(self) -> "Stopwatch":
        self.wall = self.cpu = 0.0
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._wall0
        self.cpu = time.process_time() - self._cpu0

    @property
    def sample(self) -> Sample:
        return Sample(wall=self.wall, cpu=self.cpu)


def timed(fn: Callable[..., Any], *args, **kwargs) -> tuple[Any, float]:
    """(fn(*args, **kwargs), its wall seconds): one call, no warm-up."""
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


@dataclass(slots=True)
class Runs:
    """The timed runs of `repeat` and the result of the last one."""

    samples: list[Sample]
    """One per timed run, in order (warm-ups excluded)."""
    result: Any
    """What the last run returned."""

    def fastest(self, clock: str = "wall") -> Sample:
        """The run with the fewest seconds on `clock` (its other clock comes with it)."""
        return min(self.samples, key=lambda s: s.on(clock))

    def median(self, clock: str = "wall") -> float:
        """Median seconds on `clock` (the upper median of an even count: a value that was measured)."""
        values = sorted(s.on(clock) for s in self.samples)
        return values[len(values) // 2]


def repeat(fn: Callable[[], Any], repeats: int, *, warmup: int = 0, sync: Callable[[], None] | None = None) -> Runs:
    """Call `fn()` `warmup` times untimed, then `repeats` times timed on both clocks.

    Args:
        fn: the work, without arguments (a closure).
        repeats: timed runs (>= 1).
        warmup: untimed runs first (compilation, autotuning, allocator and cache warm-up).
        sync: called before and after each timed run (e.g. `torch.cuda.synchronize`), so that
            asynchronous device work is charged to the run that queued it.

    Raises:
        ValueError: repeats < 1 or warmup < 0.
    """
    if repeats < 1:
        raise ValueError(f"repeats: expected >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup: expected >= 0, got {warmup}")
    result = None
    for _ in range(warmup):
        result = fn()
    samples = []
    for _ in range(repeats):
        if sync is not None:
            sync()
        with Stopwatch() as sw:
            result = fn()
            if sync is not None:
                sync()
        samples.append(sw.sample)
    return Runs(samples=samples, result=result)
