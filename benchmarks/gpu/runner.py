"""Sections that survive their own timeout: a budget each, a result file the moment each ends.

    runner = Runner(out_dir, total_s=420, nominal=settings.budgets)
    runner.run("env", lambda sec: env_section(ctx, sec))    # writes out_dir/env.json, whatever happens

Each section gets its share of the time left and runs under a SIGALRM `Deadline`; `Section.save()`
after each unit of work, atomic writes, statuses ok / timeout / error / terminated / skipped /
running: benchmarks/README.md ("How the sections run").
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("bench_gpu")

#: by default a section whose share of the time left is below this is skipped (status "skipped")
MIN_SECTION_S = 3.0


class SectionTimeout(BaseException):
    """A section's budget is spent. A BaseException, so that no `except Exception` in the code
    under test swallows it."""


class Terminated(BaseException):
    """The process got SIGTERM (the GPU script's `timeout`)."""


class Deadline:
    """SIGALRM after `seconds` raises SectionTimeout in the main thread; inside `hold()` it waits
    until the block ends (a result file is never cut in half). Without a main thread to signal
    (a test running it elsewhere) the deadline is only checked by `left()`."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self._held = 0
        self._pending = False
        self._armed = threading.current_thread() is threading.main_thread()
        self._old = None

    def __enter__(self) -> "Deadline":
        if self._armed:
            self._old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 1e-3))
        return self

    def __exit__(self, *exc) -> None:
        if self._armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._old)

    def left(self) -> float:
        return self.end - time.monotonic()

    def _fire(self, signum, frame) -> None:
        if self._held:
            self._pending = True
            return
        raise SectionTimeout(f"budget of {self.seconds:.0f} s spent")

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held and self._pending:
                self._pending = False
                raise SectionTimeout(f"budget of {self.seconds:.0f} s spent")


def write_json(path: Path, doc: dict) -> None:
    """Write `doc` to `path` atomically (NaN and infinity as null: strict JSON)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_finite(doc), indent=1, default=str))
    os.replace(tmp, path)


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class Section:
    """What one section has measured so far, and its result file."""

    def __init__(self, name: str, path: Path, budget_s: float, deadline: Deadline | None = None):
        self.name, self.path, self.budget_s = name, path, budget_s
        self.deadline = deadline
        self.t0 = time.monotonic()
        self.status = "running"
        self.data: dict = {}
        self.notes: list[str] = []
        self.error: str | None = None

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.deadline.left() if self.deadline is not None else self.budget_s - (time.monotonic() - self.t0)

    def note(self, text: str) -> None:
        """A line for the report: what was skipped or could not run, and why."""
        log.info("%s: %s", self.name, text)
        self.notes.append(text)

    def document(self) -> dict:
        return {"section": self.name, "status": self.status, "budget_s": round(self.budget_s, 1),
                "seconds": round(time.monotonic() - self.t0, 2), "notes": self.notes, "error": self.error,
                "data": self.data}

    def save(self) -> None:
        """Write the result file now (partial while running)."""
        with self.deadline.hold() if self.deadline is not None else contextlib.nullcontext():
            write_json(self.path, self.document())


class Runner:
    """Runs sections in order under one total budget (benchmarks/README.md, "How the sections run")."""

    def __init__(self, out: Path, *, total_s: float, nominal: dict[str, float], order: tuple[str, ...],
                 on_section_end: Callable[[], None] | None = None, min_section_s: float = MIN_SECTION_S):
        self.out = out
        self.min_section_s = min_section_s
        self.end = time.monotonic() + total_s
        self.nominal = nominal
        self.order = order
        self.on_section_end = on_section_end
        self.results: dict[str, dict] = {}

    def budget_for(self, name: str) -> float:
        later = self.order[self.order.index(name):]
        return max(self.end - time.monotonic(), 0.0) * self.nominal[name] / sum(self.nominal[n] for n in later)

    def run(self, name: str, fn: Callable[[Section], None]) -> dict:
        """Run one section; returns its result document (also in self.results and out/NAME.json).

        Raises:
            Terminated: SIGTERM arrived; the section's partial results are written first.
        """
        budget = self.budget_for(name)
        sec = Section(name, self.out / f"{name}.json", budget)
        log.info("section %s: budget %.0f s", name, budget)
        if budget < self.min_section_s:
            sec.status = "skipped"
            sec.note(f"skipped: a share of {budget:.1f} s of the total budget left (< {self.min_section_s:.0f} s)")
            return self._finish(sec)
        old_term = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        if old_term is not None:
            signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            with Deadline(budget) as dl:
                sec.deadline = dl
                sec.save()
                fn(sec)
                sec.status = "ok"
        except SectionTimeout as exc:
            sec.status = "timeout"
            sec.note(f"stopped: {exc} (partial results above)")
        except Terminated:
            sec.status = "terminated"
            sec.deadline = None
            self._finish(sec)
            raise
        except Exception:  # the section failed; the next one still runs
            sec.status = "error"
            sec.error = traceback.format_exc(limit=12)
            log.error("section %s failed:\n%s", name, sec.error)
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)
        sec.deadline = None
        return self._finish(sec)

    def _finish(self, sec: Section) -> dict:
        doc = sec.document()
        write_json(sec.path, doc)
        self.results[sec.name] = doc
        log.info("section %s: %s in %.1f s", sec.name, sec.status, doc["seconds"])
        _free_memory()
        if self.on_section_end is not None:
            self.on_section_end()
        return doc


def _raise_terminated(signum, frame) -> None:
    raise Terminated("SIGTERM")


def _free_memory() -> None:
    gc.collect()
    try:  # optional: the runner itself needs no torch (its tests run without a model)
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass
