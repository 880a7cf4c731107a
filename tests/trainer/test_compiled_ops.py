"""The torch.compile'd elementwise chains (`trainer.models.ops.compiled_ops`) against FAST's eager
forms, on the CPU: inductor's C++ code here, Triton on CUDA, from the same captured graphs. Outputs
and gradients agree, a new row count does not recompile, a whole microbatch forward + backward
through them agrees with the eager one, and the CPU keeps its exact primitives."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.models.ops import CHAINS, EXACT, FAST, compiled_ops, select_ops

pytestmark = pytest.mark.slow  # inductor compiles every chain forward and backward (about 40 s)


@pytest.fixture(scope="module", autouse=True)
def _compile_in_process():
    """Inductor's C++ compiles in this process: on 2 cores its pool of compile workers costs more
    than it saves."""
    from torch._inductor import config

    with config.patch(compile_threads=1):
        yield

H, N, I, RD = 4, 16, 24, 8
ROWS = (7, 40, 129)


def _args(name: str, R: int, gen: torch.Generator) -> tuple[tuple, dict]:
    """(positional tensors, keyword constants) of one chain at R rows (fp32, grads wanted)."""
    def t(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    if name == "rms_norm":
        return (t(R, H, N), t(N)), dict(eps=1e-6, zero_centered=True)
    if name == "swiglu":
        return (t(R, I), t(R, I)), {}
    if name == "sigmoid_mul":
        return (t(R, 1), t(R, I)), {}
    if name == "gated_norm":
        return (t(R, H, N), t(R, H, N), t(N)), dict(eps=1e-6)
    if name == "gdn_gates":
        return (t(R, H), t(R, H), (torch.rand(H, generator=gen) * 3).requires_grad_(), t(H)), {}
    if name == "rope":
        depth = torch.arange(R, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1.0, RD // 2)
        emb = torch.cat([depth, depth], dim=-1)
        return (t(R, H, N), emb.cos(), emb.sin()), {}
    if name == "router":
        return (t(R, 8),), dict(top_k=3, norm=True)
    raise AssertionError(name)


def _outputs_and_grads(fn, args, kwargs, gen_seed: int):
    out = fn(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(gen_seed)
    loss = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    wrt = [a for a in args if a.requires_grad]
    return [o.detach() for o in outs], torch.autograd.grad(loss, wrt)


def test_every_chain_is_compiled():
    fused = compiled_ops()
    assert fused.name == "compiled" and fused.invariant is False
    for name in CHAINS:
        assert getattr(fused, name) is not getattr(FAST, name), name
    # the rest is FAST's
    assert fused.linear is FAST.linear and fused.experts == FAST.experts and fused.group_align == FAST.group_align


@pytest.mark.parametrize("name", CHAINS)
def test_compiled_chain_matches_eager_and_does_not_recompile(name):
    from torch._dynamo.utils import counters

    fused = compiled_ops()
    for i, R in enumerate(ROWS):
        gen = torch.Generator().manual_seed(100 + R)
        args, kwargs = _args(name, R, gen)
        graphs = counters["stats"]["unique_graphs"]
        got, got_g = _outputs_and_grads(getattr(fused, name), args, kwargs, R)
        want, want_g = _outputs_and_grads(getattr(FAST, name), args, kwargs, R)
        if i:  # row counts are symbolic: a new R reuses the graph compiled at the first
            assert counters["stats"]["unique_graphs"] == graphs, f"{name} recompiled at R = {R}"
        else:  # (unless an earlier test compiled it already) it did compile
            assert counters["stats"]["unique_graphs"] >= 1, name
        for a, b in zip(got + list(got_g), want + list(want_g)):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _microbatch(seed: int = 0):
    """The tiny MoE model (8 experts top-2, 4 layers) and one microbatch of a tree-sampling batch."""
    from benchmarks.op_count import tiny_microbatch

    return tiny_microbatch(experts=8, top_k=2, rows=512, layers=4, seed=seed)


def test_a_microbatch_through_compiled_chains_matches_eager():
    model, ex, layout, norm = _microbatch()
    results = {}
    for ops in (FAST, compiled_ops(), compiled_ops()):
        ex.run_options = dataclasses.replace(ex.run_options, ops=ops, head="chunked")
        model.zero_grad(set_to_none=True)
        out, mb = ex.forward(layout, None, norm, grad=True)
        mb.loss.backward()
        results.setdefault(ops.name, []).append(
            (mb.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager_g), = results["fast"]
    (loss, grads), (loss2, grads2) = results["compiled"]
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == eager_g.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], eager_g[n], rtol=1e-4, atol=1e-6, msg=n)
    # the same bits twice
    assert torch.equal(loss, loss2) and all(torch.equal(grads[n], grads2[n]) for n in grads)


def test_compiled_chains_under_activation_checkpointing_give_the_same_bits():
    """"full" and "selective" checkpointing re-run the compiled chains in the backward: the loss and
    every gradient are bitwise those of the run that keeps its activations."""
    model, ex, layout, norm = _microbatch(seed=1)
    runs = {}
    for mode in ("none", "full", "selective"):
        ex.run_options = dataclasses.replace(ex.run_options, ops=compiled_ops(), head="chunked", checkpointing=mode)
        model.zero_grad(set_to_none=True)
        _, mb = ex.forward(layout, None, norm, grad=True)
        mb.loss.backward()
        runs[mode] = (mb.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    loss, grads = runs["none"]
    for mode in ("full", "selective"):
        assert torch.equal(runs[mode][0], loss), mode
        assert runs[mode][1].keys() == grads.keys()
        assert all(torch.equal(runs[mode][1][n], grads[n]) for n in grads), mode


def test_the_cpu_keeps_its_exact_primitives():
    assert select_ops("cpu", compiled=True) is EXACT
    assert select_ops("cuda", compiled=True) is compiled_ops()
    assert select_ops("cuda", compiled=True, batch_invariant=True).name == "invariant"
    assert select_ops("cuda") is FAST
