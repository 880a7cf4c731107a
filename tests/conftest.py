"""Suite-wide settings.

One intra-op thread per process: the suite runs on small shared CPUs where torch's OpenMP pool
contends with the service and torchrun subprocesses the integration tests start (measured by the
trainer tests: 14 s with one thread vs 139 s with the default pool under load). Subprocesses
inherit the variables.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

