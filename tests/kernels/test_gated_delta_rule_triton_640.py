"""GPU: the gated delta rule's Triton backward at the shapes of fla issue #640's Hopper miscompile.

Triton 3.4.0 - 3.7.0 miscompiles `tl.dot(tl.trans(x), y)` on sm_90 when x is a dot result, at
BK = 64 tiles (kernels/triton_640.py); our `_dqkwg_kernel` and `_wy_bwd_kernel` have that pattern
(tests/kernels/test_triton_640.py finds it in the compiled IR). Here, on the GPU: K = 64 (one
BK = 64 key block), K = 100 (two, the second masked) and K = 128 (two), C = 64 ([64, 64] transposed
tiles); bf16 in both forms (plain, transpose-free) and, at K = 64 and 128, under both num_stages
candidates of the two kernels; fp32 at K = 64 and 100. Each against the fp32 PyTorch reference on
the same inputs: outputs, exported states and every gradient. fla's reports of the miscompile: dk
max error 14.65 at BK = 64 (BK = 32 and 128 under 0.02), dg off by 4% relative RMS. Bounds: bf16 1.5e-2 relative RMS (what the K = 128 bf16 test
passed under on the H200) and 1e-1 relative max error (a sanity net, not yet seen on a
GPU); fp32 1e-5 relative max error.

Outcome -> `kernels.triton_640.ON_AFFECTED`: all pass -> "plain"; only transpose_free cases pass ->
"transpose_free"; neither -> "refuse".

Run on a GPU: `HARTS_AUTOTUNE=0 pytest -v tests/kernels/test_gated_delta_rule_triton_640.py`.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA without the interpreter (interpreter cases: test_gated_delta_rule_triton.py)",
                allow_module_level=True)

from kernels import triton_640  # noqa: E402
from kernels.gated_delta_rule.output_triton import _dqkwg_kernel  # noqa: E402
from kernels.gated_delta_rule.wy_triton import _wy_bwd_kernel  # noqa: E402
from kernels.triton_tuning import candidates, pinned  # noqa: E402
from tests.kernels.test_gated_delta_rule_triton import NAMES, make_inputs, outputs_and_grads  # noqa: E402

pytestmark = pytest.mark.gpu

LENS = [300, 64, 129, 200]
EXPORTS = [(0, 256), (0, 300), (2, 128), (3, 64), (1, 64)]


def _cases():
    out = []
    for dtype in ("bf16", "fp32"):
        # fp32 products are exact-fp32 FMA loops (no wgmma: outside the miscompile), checked at K = 64, 100.
        for K in (64, 100, 128) if dtype == "bf16" else (64, 100):
            out.append(pytest.param(dtype, K, "plain", 0, id=f"{dtype}-K{K}-plain-stages0"))
            if dtype == "bf16" and K != 100:
                out.append(pytest.param(dtype, K, "plain", 1, id=f"{dtype}-K{K}-plain-stages1"))
            if dtype == "bf16" or K == 64:
                out.append(pytest.param(dtype, K, "transpose_free", 0, id=f"{dtype}-K{K}-transpose_free-stages0"))
    return out


@pytest.mark.parametrize("dtype, K, form, config", _cases())
def test_triton_backward_at_bk64_matches_fp32_ref(dtype, K, form, config, monkeypatch):
    monkeypatch.setattr(triton_640, "check", lambda device: form == "transpose_free")
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    x, cu = make_inputs(LENS, 4, K, K, seed=K, dtype=dt)
    pins = {kernel: candidates(kernel)[min(config, len(candidates(kernel)) - 1)] for kernel in (_dqkwg_kernel, _wy_bwd_kernel)}
    with pinned(pins):
        got = outputs_and_grads("triton", x, cu, EXPORTS, 64, seed=K + 1, use_qk_l2norm=True)
    want = outputs_and_grads("ref", {n: None if t is None else t.float() for n, t in x.items()}, cu, EXPORTS, 64,
                             seed=K + 1, use_qk_l2norm=True)
    errors = {}
    for name, a, b in zip(NAMES, got, want):
        assert not a.isnan().any(), name
        a, b = a.float(), b.float()
        errors[name] = (((a - b).norm() / b.norm()).item(), ((a - b).abs().max() / b.abs().max()).item())
    if dt == torch.bfloat16:
        bad = {n: e for n, e in errors.items() if e[0] > 1.5e-2 or e[1] > 1e-1}
    else:
        bad = {n: e for n, e in errors.items() if e[1] > 1e-5}
    assert not bad, f"(relative RMS, relative max) errors over the bound: {bad}; all: {errors}"
