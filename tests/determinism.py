"""`deterministic()`: torch's deterministic mode with warnings as errors, restored afterwards (tests).

On CUDA, torch refuses cuBLAS calls in deterministic mode unless CUBLAS_WORKSPACE_CONFIG is set
(cuBLAS's own reduction order then no longer depends on the workspace); importing this module sets
":4096:8" when unset, before a test creates a cuBLAS handle (the PyTorch reference backends use
cuBLAS; our Triton kernels do not). A program that runs deterministic mode on CUDA must do the same.
"""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


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
