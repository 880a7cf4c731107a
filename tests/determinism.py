"""`deterministic()`: torch's deterministic mode with warnings as errors, restored afterwards (tests)."""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch


@contextmanager
def deterministic():
    """`torch.use_deterministic_algorithms(True)` (an op without a deterministic implementation
    raises; uninitialised memory is filled with NaN) and every warning an error."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield
    finally:
        torch.use_deterministic_algorithms(before)
