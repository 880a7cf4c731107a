"""GPU: the Triton kernels' bits do not depend on the tuning, nor on the run.

`kernels.triton_tuning` lets the autotuner choose num_stages only, on the claim that software
pipelining leaves the arithmetic as written; here every kernel of a GDN and a tree-attention
forward + backward runs under each of its num_stages candidates (bf16, production tiles) and the
outputs and gradients must be bitwise equal. And under `torch.use_deterministic_algorithms(True)`
(warnings as errors) two runs give the same bits.

Run on a GPU: `HARTS_AUTOTUNE=0 pytest -v tests/kernels/test_triton_tuning_gpu.py` (each candidate
is compiled: about 40 kernel compilations).
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA without the interpreter", allow_module_level=True)

from kernels.gated_delta_rule import chunk_triton, l2norm_triton  # noqa: E402
from kernels.tree_attention import tree_attention, triton_kernel  # noqa: E402
from kernels.triton_tuning import candidates, pinned  # noqa: E402
from tests.determinism import deterministic  # noqa: E402
from tests.kernels.test_gated_delta_rule_triton import make_inputs, outputs_and_grads  # noqa: E402
from tests.tree_attention_helpers import random_qkv, random_tree  # noqa: E402

pytestmark = pytest.mark.gpu


def _kernels(*modules) -> list:
    return sorted({getattr(m, n) for m in modules for n in dir(m) if n.startswith("_") and n.endswith("_kernel")}, key=id)


def _gdn():
    x, cu = make_inputs([300, 64, 129, 1000], 4, 128, 128, seed=41, dtype=torch.bfloat16)
    return outputs_and_grads("triton", x, cu, [(0, 256), (2, 129), (3, 512), (3, 1000)], 64, seed=42, use_qk_l2norm=True)


def _tree():
    tree = random_tree(43, num_segments=30, min_len=1, max_len=200, num_imported=3)
    q, k, v = random_qkv(tree, 8, 2, 128, seed=44, dtype=torch.bfloat16, device="cuda")
    o = tree_attention(q, k, v, tree.prepare("cuda"), scale=128**-0.5, backend="triton")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(45)).to("cuda", o.dtype)
    return (o, *torch.autograd.grad(o, [q, k, v], do))


@pytest.mark.parametrize("run, modules", [(_gdn, (chunk_triton, l2norm_triton)), (_tree, (triton_kernel,))], ids=["gdn", "tree"])
def test_num_stages_candidates_give_identical_bits(run, modules):
    kernels = _kernels(*modules)
    most = max(len(candidates(k)) for k in kernels)
    assert most >= 2
    results = []
    for i in range(most):
        with pinned({k: candidates(k)[min(i, len(candidates(k)) - 1)] for k in kernels}):
            results.append(run())
    for i, other in enumerate(results[1:], 1):
        for j, (a, b) in enumerate(zip(results[0], other)):
            assert torch.equal(a, b), f"candidate {i}, result {j}: {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("run", [_gdn, _tree], ids=["gdn", "tree"])
def test_bf16_reruns_are_bitwise_equal_under_deterministic_mode(run):
    with deterministic():
        first, second = run(), run()
    for j, (a, b) in enumerate(zip(first, second)):
        assert torch.equal(a, b), j
