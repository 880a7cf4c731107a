"""Launch configurations of the Triton kernels: autotuned on a GPU, one fixed config otherwise.

`triton.autotune` times its candidates through the GPU driver, which the interpreter
(`TRITON_INTERPRET=1`, the CPU tests) does not have: there every tuned kernel runs its first config
(with one config the autotuner never benchmarks). `HARTS_AUTOTUNE=0` does the same on a GPU: each
candidate is a separate compilation, so correctness runs over many shapes (the GPU tests) skip
tuning. Tuned kernels must be pure functions of their inputs (no in-place accumulation into an
output), since tuning launches them repeatedly.
"""
from __future__ import annotations

import os

import triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TUNE = not INTERPRET and os.environ.get("HARTS_AUTOTUNE", "1") != "0"


def autotune(configs: list[triton.Config], key: list[str]):
    """`triton.autotune` over `configs` on a GPU; under the interpreter or HARTS_AUTOTUNE=0, the
    first config only."""
    return triton.autotune(configs=configs if TUNE else configs[:1], key=key)


def warps_stages(warps: tuple[int, ...], stages: tuple[int, ...], **meta) -> list[triton.Config]:
    """Configs over num_warps x num_stages with the same meta-parameters (first: warps[0], stages[0])."""
    return [triton.Config(dict(meta), num_warps=w, num_stages=s) for w in warps for s in stages]
