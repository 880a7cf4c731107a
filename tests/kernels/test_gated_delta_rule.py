"""Tests of kernels.gated_delta_rule: chunk_gated_delta_rule (reference backend) against the
token-by-token oracle, transformers' Qwen3-Next functions, and the bitwise packing invariance that
tree execution relies on (Invariant E; docs/design/numerics.md)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule_ref, prepare_layout
from tests.determinism import deterministic
from tests.gated_delta_rule_v0 import chunk_gated_delta_rule_v0
from tests.triton_interpreter import run_under_interpreter


def make_inputs(lens, H, K, V, *, dtype, seed, init=True, requires_grad=False):
    """Random packed inputs for sequences of the given lengths (g <= 0, beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = dict(
        q=torch.randn(T, H, K, generator=gen, dtype=dtype),
        k=torch.randn(T, H, K, generator=gen, dtype=dtype),
        v=torch.randn(T, H, V, generator=gen, dtype=dtype),
        g=-0.3 * torch.rand(T, H, generator=gen, dtype=dtype),
        beta=torch.rand(T, H, generator=gen, dtype=dtype) * 0.9 + 0.05,
        h0=0.5 * torch.randn(len(lens), H, K, V, generator=gen, dtype=dtype) if init else None,
    )
    if requires_grad:
        for t in x.values():
            if t is not None:
                t.requires_grad_(True)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.long)
    return x, cu


def run(fn, x, cu, es, ep, C, **kw):
    return fn(
        x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, initial_state=x["h0"],
        export_seq=torch.tensor(es, dtype=torch.long), export_pos=torch.tensor(ep, dtype=torch.long),
        chunk_size=C, **kw,
    )


# (lens, H, K, V, C, init, l2norm, exports as (seq, pos))
CASES = {
    "n1_T13_C4_ends": ([13], 2, 4, 5, 4, False, False, [(0, 4), (0, 8), (0, 13)]),
    "n2_C8_init": ([17, 9], 2, 8, 6, 8, True, False, [(1, 9), (0, 16), (0, 8), (0, 17)]),
    "n3_C16_l2norm": ([40, 16, 5], 3, 8, 8, 16, True, True, [(2, 5), (0, 32), (1, 16), (0, 40)]),
    "n4_C64_long": ([70, 64, 3, 130], 1, 8, 4, 64, True, True, [(3, 64), (0, 70), (1, 64), (2, 3), (3, 128), (3, 130)]),
    "n4_C4_tiny_seqs": ([1, 4, 9, 2], 2, 4, 4, 4, True, False, [(0, 1), (2, 8), (2, 4), (3, 2), (2, 9)]),
    "no_exports": ([11, 6], 2, 4, 4, 4, True, True, []),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_chunk_ref_matches_naive_float64(case):
    lens, H, K, V, C, init, l2, exports = case
    x, cu = make_inputs(lens, H, K, V, dtype=torch.float64, seed=1, init=init, requires_grad=True)
    es = [e[0] for e in exports]
    ep = [e[1] for e in exports]
    o1, s1 = run(chunk_gated_delta_rule, x, cu, es, ep, C, use_qk_l2norm=l2, backend="ref")
    o2, s2 = run(recurrent_gated_delta_rule_ref, x, cu, es, ep, C, use_qk_l2norm=l2)
    assert o1.dtype == torch.float64 and s1.shape == (len(exports), H, K, V)
    torch.testing.assert_close(o1, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s1, s2, rtol=1e-10, atol=1e-10)
    leaves = [t for t in x.values() if t is not None]
    gen = torch.Generator().manual_seed(2)
    dO = torch.randn(o1.shape, generator=gen, dtype=o1.dtype)
    dS = torch.randn(s1.shape, generator=gen, dtype=s1.dtype)
    outs1 = [o1, s1] if exports else [o1]
    outs2 = [o2, s2] if exports else [o2]
    cot = [dO, dS] if exports else [dO]
    g1 = torch.autograd.grad(outs1, leaves, cot)
    g2 = torch.autograd.grad(outs2, leaves, cot)
    for name, a, b in zip([n for n, t in x.items() if t is not None], g1, g2):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"grad {n}: {m}")


def test_state_cotangent_reaches_inputs():
    """A gradient arriving only on an exported state (a later call uses it) reaches k, v, g, beta, h0."""
    x, cu = make_inputs([12], 2, 4, 4, dtype=torch.float64, seed=3, requires_grad=True)
    _, s = run(chunk_gated_delta_rule, x, cu, [0], [8], 4)
    grads = torch.autograd.grad(s.sum(), [x["k"], x["v"], x["g"], x["beta"], x["h0"]])
    assert all(gr.abs().max() > 0 for gr in grads)
    assert torch.equal(grads[0][8:], torch.zeros_like(grads[0][8:]))


def test_duplicate_exports_add_their_gradients_in_order_under_deterministic_mode():
    """A state requested twice in one step gets both cotangents, added in request order without
    index_add_ (`layout.export_adds_J`), under `torch.use_deterministic_algorithms(True)`; the
    gradients equal those of one request carrying the sum, and a rerun gives the same bits."""
    x, cu = make_inputs([12, 9], 2, 4, 3, dtype=torch.float64, seed=6, requires_grad=True)
    leaves = [x[n] for n in ("k", "v", "g", "beta", "h0")]  # states do not depend on q
    cot = torch.randn(3, 2, 4, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with deterministic():
        twice = [torch.autograd.grad(run(chunk_gated_delta_rule, x, cu, [0, 1, 0], [8, 8, 8], 4)[1], leaves, cot)
                 for _ in range(2)]
        once = torch.autograd.grad(run(chunk_gated_delta_rule, x, cu, [0, 1], [8, 8], 4)[1], leaves,
                                   torch.stack([cot[0] + cot[2], cot[1]]))
    for a, b, c in zip(*twice, once):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_replayed_rows_accumulate_gradients():
    """Rows gathered into two sequences (bounded replay) get the sum of both gradients."""
    base, _ = make_inputs([10], 2, 4, 3, dtype=torch.float64, seed=4, init=False, requires_grad=True)
    # sequence 0 = rows 0..9; sequence 1 replays rows 4..7 then continues with rows 8..9 again.
    idx = torch.tensor([*range(10), 4, 5, 6, 7, 8, 9])
    cu = torch.tensor([0, 10, 16])
    h0 = torch.randn(2, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    leaves = [base[n] for n in ("q", "k", "v", "g", "beta")] + [h0]

    def packed(fn):
        x = {n: base[n].index_select(0, idx) for n in ("q", "k", "v", "g", "beta")}
        x["h0"] = h0
        return run(fn, x, cu, [1], [6], 4)

    gen = torch.Generator().manual_seed(5)
    o1, s1 = packed(chunk_gated_delta_rule)
    o2, s2 = packed(recurrent_gated_delta_rule_ref)
    cot = [torch.randn(o1.shape, generator=gen, dtype=o1.dtype), torch.randn(s1.shape, generator=gen, dtype=s1.dtype)]
    g1 = torch.autograd.grad([o1, s1], leaves, cot)
    g2 = torch.autograd.grad([o2, s2], leaves, cot)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_gradcheck_tiny_float64():
    x, cu = make_inputs([5, 3], 1, 2, 3, dtype=torch.float64, seed=6, requires_grad=True)
    es = torch.tensor([0, 1, 0])
    ep = torch.tensor([2, 3, 5])

    def f(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, export_seq=es, export_pos=ep,
            chunk_size=2, use_qk_l2norm=True,
        )

    assert torch.autograd.gradcheck(f, tuple(x.values()), eps=1e-6, atol=1e-6)


INVARIANCE = {
    "C16_H2_K16": (16, 2, 16, 16),
    "C64_H4_K32_V16": (64, 4, 32, 16),
    "C4_H1_K8": (4, 1, 8, 8),
    "C8_H3_K5_V7": (8, 3, 5, 7),
}


@pytest.mark.parametrize("cfg", list(INVARIANCE.values()), ids=list(INVARIANCE))
def test_packing_is_bitwise_invariant_fp32(cfg):
    """One sequence alone and packed among random others (different N, positions, lengths):
    identical bits for its outputs and exported states."""
    C, H, K, V = cfg
    L = 3 * C + C // 2 + 1
    x, cu = make_inputs([L], H, K, V, dtype=torch.float32, seed=7)
    exports = [C, 2 * C, L]
    o_alone, s_alone = run(chunk_gated_delta_rule, x, cu, [0] * 3, exports, C, use_qk_l2norm=True)
    gen = torch.Generator().manual_seed(8)
    for trial in range(4):
        n_other = 1 + trial
        other_lens = torch.randint(1, 5 * C, (n_other,), generator=gen).tolist()
        pos = int(torch.randint(0, n_other + 1, (1,), generator=gen))
        lens = other_lens[:pos] + [L] + other_lens[pos:]
        y, cu2 = make_inputs(lens, H, K, V, dtype=torch.float32, seed=100 + trial)
        start = int(cu2[pos])
        for n in ("q", "k", "v", "g", "beta"):
            y[n][start : start + L] = x[n]
        y["h0"][pos] = x["h0"][0]
        es = [pos] * 3 + list(range(len(lens)))
        ep = exports + lens
        o, s = run(chunk_gated_delta_rule, y, cu2, es, ep, C, use_qk_l2norm=True)
        assert torch.equal(o[start : start + L], o_alone), f"outputs differ (trial {trial})"
        assert torch.equal(s[:3], s_alone), f"states differ (trial {trial})"
        assert torch.equal(s[3 + pos], s_alone[2])


@pytest.mark.parametrize("C", [4, 16, 64], ids=lambda c: f"C{c}")
def test_split_at_chunk_boundary_is_bitwise_fp32(C):
    """Export the state at jC, continue from it in a second call (packed with another sequence):
    outputs and later states equal the single call bit for bit."""
    L = 5 * C + 3
    x, cu = make_inputs([L], 2, 8, 8, dtype=torch.float32, seed=9)
    o_full, s_full = run(chunk_gated_delta_rule, x, cu, [0, 0, 0], [2 * C, 4 * C, L], C)
    head = {n: x[n][: 2 * C] for n in ("q", "k", "v", "g", "beta")}
    head["h0"] = x["h0"]
    o_head, s_head = run(chunk_gated_delta_rule, head, torch.tensor([0, 2 * C]), [0], [2 * C], C)
    other, _ = make_inputs([C + 5], 2, 8, 8, dtype=torch.float32, seed=10)
    tail = {n: torch.cat([other[n], x[n][2 * C :]]) for n in ("q", "k", "v", "g", "beta")}
    tail["h0"] = torch.cat([other["h0"], s_head])
    cu_tail = torch.tensor([0, C + 5, C + 5 + L - 2 * C])
    o_tail, s_tail = run(chunk_gated_delta_rule, tail, cu_tail, [1, 1], [2 * C, L - 2 * C], C)
    assert torch.equal(o_head, o_full[: 2 * C])
    assert torch.equal(s_head[0], s_full[0])
    assert torch.equal(o_tail[C + 5 :], o_full[2 * C :])
    assert torch.equal(s_tail, s_full[1:])


def random_call(seed: int):
    """A random varlen fp32 call: 1-6 sequences (shrinking active sets, single-sequence steps), random
    export requests in random order, optional initial states, l2norm or unit-norm keys."""
    gen = torch.Generator().manual_seed(seed)
    C = [4, 8, 16, 64][seed % 4]
    n = int(torch.randint(1, 7, (1,), generator=gen))
    lens = torch.randint(1, 5 * C, (n,), generator=gen).tolist()
    H, K, V = (int(x) for x in torch.randint(1, 17, (3,), generator=gen))
    x, cu = make_inputs(lens, H, max(K, 2), max(V, 2), dtype=torch.float32, seed=seed, init=seed % 3 != 0)
    x["k"] = x["k"] / x["k"].norm(dim=-1, keepdim=True)  # a stable recurrence without l2norm too
    exports = [(s, p) for s, L in enumerate(lens) for p in [*range(C, L, C), L] if torch.rand(1, generator=gen) < 0.5]
    exports = [exports[i] for i in torch.randperm(len(exports), generator=gen).tolist()]
    return x, cu, [e[0] for e in exports], [e[1] for e in exports], C, seed % 2 == 0


def forward_backward(fn, x, cu, es, ep, C, l2, **kw):
    """Outputs, states and the gradients of every input for a seeded random cotangent."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items() if t is not None}
    y = {n: leaves.get(n) for n in x}
    o, s = run(fn, y, cu, es, ep, C, use_qk_l2norm=l2, **kw)
    gen = torch.Generator().manual_seed(99)
    outs, cot = [o], [torch.randn(o.shape, generator=gen)]
    if s.numel():
        outs.append(s)
        cot.append(torch.randn(s.shape, generator=gen))
    grads = torch.autograd.grad(outs, list(leaves.values()), cot)
    return {"o": o, "states": s, **{f"grad {n}": g for n, g in zip(leaves, grads)}}


@pytest.mark.parametrize("seeds", [range(0, 12), range(12, 24)], ids=["seeds0-11", "seeds12-23"])
def test_matches_frozen_v0(seeds):
    """The optimised reference (float64 gate cumsums, one batch for the outputs, the state recurrence
    with a written-out backward, a prepared layout) agrees with the straightforward v0 loop on
    random varlen calls with exports and initial states: to fp32 rounding in fp32 (v0 forms the gate
    cumsums in fp32), to 1e-12 in float64 (outputs, states and every gradient)."""
    for seed in seeds:
        x, cu, es, ep, C, l2 = random_call(seed)
        layout = prepare_layout(cu.numpy(), np.array(es, dtype=np.int64), np.array(ep, dtype=np.int32), C)
        for dtype, rtol in ((torch.float32, 2e-6), (torch.float64, 1e-12)):
            xd = {n: (t.to(dtype) if t is not None else None) for n, t in x.items()}
            want = forward_backward(chunk_gated_delta_rule_v0, xd, cu, es, ep, C, l2)
            for kw in ({}, {"layout": layout}):
                got = forward_backward(chunk_gated_delta_rule, xd, cu, es, ep, C, l2, **kw)
                assert got.keys() == want.keys()
                for name in want:
                    scale = want[name].abs().max() if want[name].numel() else 0.0
                    err = (got[name] - want[name]).abs().max() if want[name].numel() else 0.0
                    assert err <= rtol * scale, f"seed {seed} {dtype} {list(kw)}: {name} off by {err} (scale {scale})"


def test_strong_decays_stay_accurate_in_fp32():
    """Heads that decay fast (log decay down to -10 per token, C = 64) make the in-chunk cumulative
    decays large: formed in fp32, exp(G_i - G_j) loses ~1e-5 of its value to the cancellation and
    outputs and gate gradients drift by several 1e-6 from the float64 oracle (3.5e-6 and 6e-6
    measured); formed in float64 and rounded once, every fp32 result stays within 5e-7."""
    x, cu = make_inputs([200, 77], 2, 16, 16, dtype=torch.float64, seed=3)
    x["g"] = -10.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    es, ep = [0, 1], [200, 77]
    want = forward_backward(recurrent_gated_delta_rule_ref, x, cu, es, ep, 64, True)
    x32 = {n: t.float() if t is not None else None for n, t in x.items()}
    got = forward_backward(chunk_gated_delta_rule, x32, cu, es, ep, 64, True)
    for name in want:
        err = float((got[name].detach().double() - want[name].detach()).abs().max() / want[name].detach().abs().max())
        assert err <= 5e-7, f"{name}: relative error {err:.2e} against the float64 oracle"


def count_nodes(root, name: str) -> int:
    """Autograd nodes of type `name` reachable from `root`."""
    seen, stack, count = set(), [root], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__ == name
        stack.extend(nxt for nxt, _ in node.next_functions)
    return count


def test_chunk_loop_is_one_autograd_node():
    """The sequential loop over chunk steps is one autograd node whatever the number of steps: the
    graph (and the backward's per-node overhead) does not grow with the chunks of a sequence."""
    C = 4
    nodes = {}
    for J in (3, 12):
        x, cu = make_inputs([J * C], 2, 4, 4, dtype=torch.float32, seed=20, requires_grad=True)
        o, s = run(chunk_gated_delta_rule, x, cu, [0], [J * C], C)
        nodes[J] = {n: count_nodes(o.grad_fn, n) for n in ("BmmBackward0", "SliceBackward0", "_StateRecurrenceBackward")}
    assert nodes[3] == nodes[12]
    assert nodes[12]["_StateRecurrenceBackward"] == 1
    o0, _ = run(chunk_gated_delta_rule_v0, x, cu, [0], [12 * C], C)
    assert count_nodes(o0.grad_fn, "BmmBackward0") >= 3 * 12  # what the check above rules out


def test_prepared_layout_is_reused_across_layers():
    """One layout, several "layers" (different data, same indices): each equals a call without it;
    the indices may be omitted, and a layout for other indices is rejected naming `layout`."""
    lens, C = [13, 30, 5], 8
    es, ep = [1, 0, 2, 1], [16, 13, 5, 30]
    src = (torch.tensor([0, 13, 43, 48]), torch.tensor(es), torch.tensor(ep))
    layout = prepare_layout(*src, C)
    assert layout.active_J == [3, 2, 1, 1] and layout.num_chunks == 7 and layout.num_rows == 48
    assert layout.matches(*src, C) and not layout.matches(*src, 16)
    for seed in (21, 22):
        x, cu = make_inputs(lens, 2, 4, 4, dtype=torch.float32, seed=seed)
        want = run(chunk_gated_delta_rule, x, cu, es, ep, C)
        got = chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], chunk_size=C, layout=layout
        )
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="layout"):
        run(chunk_gated_delta_rule, x, cu, es, [16, 13, 5, 24], C, layout=layout)
    with pytest.raises(ValueError, match="layout"):
        run(chunk_gated_delta_rule, x, cu, es, ep, 4, layout=layout)
    with pytest.raises(ValueError, match="export_pos"):
        prepare_layout(torch.tensor([0, 13, 43, 48]), torch.tensor(es), torch.tensor([16, 13, 5, 20]), C)


@pytest.fixture(scope="module")
def qwen3_next_fns():
    saved = sys.modules.get("fla", "absent")
    sys.modules["fla"] = None  # an importable fla makes transformers bind Triton kernels on CPU
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    finally:
        if saved == "absent":
            del sys.modules["fla"]
        else:
            sys.modules["fla"] = saved
    return m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("l2", [True, False], ids=["l2norm", "raw"])
def test_matches_transformers_qwen3_next_fp32(qwen3_next_fns, l2):
    hf_chunk, hf_recurrent = qwen3_next_fns
    L, H, K, V = 150, 4, 16, 16
    x, cu = make_inputs([L], H, K, V, dtype=torch.float32, seed=11)
    if not l2:
        x["q"] = x["q"] * 0.25
        x["k"] = x["k"] * 0.25
    o, s = run(chunk_gated_delta_rule, x, cu, [0], [L], 64, use_qk_l2norm=l2)
    args = [x[n][None] for n in ("q", "k", "v", "g", "beta")]
    for fn, kw in ((hf_chunk, {"chunk_size": 64}), (hf_recurrent, {})):
        o_hf, s_hf = fn(*args, initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=l2, **kw)
        torch.testing.assert_close(o, o_hf[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[0], s_hf[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(cu=[0, 5, 9]), "cu_seqlens"),
        (dict(cu=[0, 0, 10]), "cu_seqlens"),
        (dict(ep=[3]), "export_pos"),
        (dict(ep=[0]), "export_pos"),
        (dict(es=[2]), "export_seq"),
        (dict(h0_shape=(2, 2, 4, 5)), "initial_state"),
        (dict(C=0), "chunk_size"),
    ],
    ids=["cu_end", "empty_seq", "unaligned_export", "zero_export", "export_seq_range", "h0_shape", "chunk_size"],
)
def test_bad_inputs_name_the_field(change, field):
    x, _ = make_inputs([6, 4], 2, 4, 4, dtype=torch.float32, seed=12)
    if "h0_shape" in change:
        x["h0"] = torch.zeros(change["h0_shape"])
    cu = torch.tensor(change.get("cu", [0, 6, 10]))
    with pytest.raises(ValueError, match=field):
        run(chunk_gated_delta_rule, x, cu, change.get("es", [0]), change.get("ep", [4]), change.get("C", 4))


def test_unknown_backend_is_rejected():
    x, cu = make_inputs([4], 1, 2, 2, dtype=torch.float32, seed=13)
    with pytest.raises(ValueError, match="backend"):
        run(chunk_gated_delta_rule, x, cu, [], [], 4, backend="cuda")


@pytest.mark.slow
def test_triton_backend_under_interpreter():
    """The Triton kernel's tests, in a subprocess with TRITON_INTERPRET=1 set before triton loads."""
    run_under_interpreter("kernels/test_gated_delta_rule_triton.py")
