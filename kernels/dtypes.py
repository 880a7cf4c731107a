"""The accuracy dtype shared by the kernels and the model: where a value is upcast, it goes here."""
from __future__ import annotations

import torch

__all__ = ["compute_dtype"]


def compute_dtype(*xs: torch.Tensor | torch.dtype) -> torch.dtype:
    """At least fp32: fp32 for bf16/fp16/fp32 inputs, float64 when any input is float64 (kept, so a
    float64 model or gradient test computes in float64 end to end and fp32/bf16 runs are unchanged)."""
    dt = torch.float32
    for x in xs:
        dt = torch.promote_types(dt, x if isinstance(x, torch.dtype) else x.dtype)
    return dt
