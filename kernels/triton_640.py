"""Guard against the Hopper miscompile of `tl.dot(tl.trans(x), y)` in Triton 3.4.0 - 3.7.0 (fla #640).

    trans_free = check(device)   # True: run the transpose-free forms; RuntimeError under "refuse"

Two backward sites have transpose-free forms (`TRANS_FREE`); on an affected device (sm_90, Triton
in [3.4.0, 3.7.1)) the policy is `ON_AFFECTED`, overridable with
HARTS_TRITON_640=plain|transpose_free|refuse (HARTS_ALLOW_TRITON_640=1 lifts a refusal). The bug,
the sites and the policy: docs/design/numerics.md ("Hopper and Triton 3.4-3.7.0").
"""
from __future__ import annotations

import functools
import os
import re
import warnings

import torch

__all__ = ["AFFECTED_TRITON", "ON_AFFECTED", "affected", "check", "triton_version"]

#: Triton versions [first, fixed) that miscompile the pattern on Hopper.
AFFECTED_TRITON = ((3, 4, 0), (3, 7, 1))
POLICIES = ("plain", "transpose_free", "refuse")

#: THE DECISION POINT, to be set from the H200 run of
#: tests/kernels/test_gated_delta_rule_triton_640.py (Triton 3.6 there):
#:   every test passes                                  -> "plain"  (nothing to do)
#:   plain cases fail, transpose_free cases pass        -> "transpose_free"
#:   both fail                                          -> "refuse"
#: Until that run: "plain" (allowing), as the lead asked.
ON_AFFECTED = "plain"


def triton_version() -> tuple[int, int, int]:
    """The installed Triton's (major, minor, patch); local suffixes ("+git...") ignored."""
    import triton

    parts = [int(p) for p in re.findall(r"\d+", triton.__version__.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def affected(device: torch.device) -> bool:
    """Whether kernels compiled for `device` can hit the miscompile: a CUDA device of compute
    capability 9.x and the installed Triton in [3.4.0, 3.7.1). False under TRITON_INTERPRET=1."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    first, fixed = AFFECTED_TRITON
    return _capability(device.index or 0)[0] == 9 and first <= triton_version() < fixed


def policy() -> str:
    """`ON_AFFECTED`, or HARTS_TRITON_640 when set (ValueError for an unknown value)."""
    value = os.environ.get("HARTS_TRITON_640", ON_AFFECTED)
    if value not in POLICIES:
        raise ValueError(f"HARTS_TRITON_640: expected one of {POLICIES}, got {value!r}")
    return value


@functools.lru_cache(maxsize=None)
def _check(device: torch.device, mode: str, allow: bool) -> bool:
    if not affected(device):
        return False
    if mode == "refuse":
        versions = ".".join(map(str, triton_version()))
        msg = (
            f"Triton {versions} on a Hopper GPU ({device}) miscompiles tl.dot(tl.trans(x), y) on dot results at "
            "BK = 64 (fla issue #640; Triton >= 3.4.0 and < 3.7.1): the gated delta rule's Triton backward would "
            "return wrong gradients. Install Triton >= 3.7.1, or set HARTS_TRITON_640=transpose_free, or "
            "HARTS_ALLOW_TRITON_640=1 to run the kernels as written"
        )
        if not allow:
            raise RuntimeError(msg)
        warnings.warn(msg + " (HARTS_ALLOW_TRITON_640=1: running them)", RuntimeWarning, stacklevel=3)
        return False
    return mode == "transpose_free"


def check(device: torch.device) -> bool:
    """The guard, called by every Triton gated-delta-rule call on `device` (resolved, e.g. cuda:0).

    Returns whether the kernels must use their transpose-free forms (True only on an affected
    device under the "transpose_free" policy). Raises RuntimeError on an affected device under
    "refuse" unless HARTS_ALLOW_TRITON_640=1 (then warns once and runs the plain forms).
    """
    return _check(device, policy(), os.environ.get("HARTS_ALLOW_TRITON_640") == "1")
