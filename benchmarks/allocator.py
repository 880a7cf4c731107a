"""Steady host memory allocation for CPU step timings.

glibc's malloc serves large blocks with mmap and adapts that threshold to what the process freed
before, and returns freed heap to the OS past a trim threshold: a step's time then depends on the
allocation history of the process (page faults on every re-allocation of a large tensor). On this
machine the expanded baseline's step time moved by up to 30% between otherwise identical runs, with
system time doubling, while the tree run's did not. `steady_allocator()` fixes both thresholds
(mmap only above 32 MiB, glibc's maximum; no trimming), the usual setting for long-running numeric
processes; it applies to both execution modes alike and, if anything, speeds the expanded baseline
up more (larger tensors).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1 << 30


def steady_allocator() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for this process; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("steady_allocator: no glibc mallopt here; allocation thresholds left as they are")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not ok:
        log.info("steady_allocator: mallopt refused the thresholds; left as they are")
    return ok
