"""Tree-attention micro-benchmark: a group-sampling tree (one prompt, B continuations) through our
backends, against causal attention on the B expanded sequences (the same work unshared).

Run: `python -m benchmarks.bench_tree_attention [--prompt 2048 --branches 8 --cont 1024 --heads 16
--kv-heads 2 --dim 128]` (one markdown table row per measurement). CUDA: bf16, our Triton backend
against FA3 / FA2 / SDPA flash; CPU: fp32, "ref" and SDPA (benchmarks/README.md, "Smaller
benchmarks"). Legend: P prompt rows, B branches, L continuation rows, R = P + B L tree rows,
E = B (P + L) expanded rows, S = P + L rows per expanded sequence, H heads, Hkv kv heads, D head dim.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from harts_client.timing import repeat
from kernels.tree_attention import TreeLayout, prepare_tree_layout, tree_attention


def group_tree(P: int, B: int, L: int, device: str, batch_invariant: bool = False) -> TreeLayout:
    """Layout of one prompt segment (rows 0..P-1) and B continuation segments that see all of it."""
    seg_start = torch.tensor([0] + [P + b * L for b in range(B)], dtype=torch.int32)
    seg_len = torch.tensor([P] + [L] * B, dtype=torch.int32)
    attn_offsets = torch.tensor([0] + list(range(B + 1)), dtype=torch.int32)
    attn_ranges = torch.tensor([[0, P]] * B, dtype=torch.int32).reshape(-1, 2)
    return prepare_tree_layout(seg_start, seg_len, attn_offsets, attn_ranges, num_rows=P + B * L, device=device,
                               batch_invariant=batch_invariant)


def expanded_layout(B: int, S: int, device: str) -> TreeLayout:
    """B independent causal sequences of S rows each (one segment each, no ancestors)."""
    return prepare_tree_layout(
        torch.arange(B, dtype=torch.int32) * S, torch.full((B,), S, dtype=torch.int32),
        torch.zeros(B + 1, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32), num_rows=B * S, device=device,
    )


#: The FlashAttention baselines in order of preference (the report's ratios use the first present;
#: "sdpa expanded" is the CPU's stand-in).
REFERENCE_BACKENDS = ("fa3 varlen expanded", "flash_attn varlen expanded", "sdpa flash expanded", "sdpa expanded")


def flash_varlen() -> dict:
    """{row name: varlen attention fn(q, k, v, cu, max_len, scale) -> o} of the importable
    FlashAttention builds: FA3 (`flash_attn_interface`), FA2 (`flash_attn`)."""
    out = {}
    try:  # optional: FlashAttention builds exist on some CUDA machines only
        from flash_attn_interface import flash_attn_varlen_func as fa3
    except Exception:  # not installed, or built for another torch/CUDA
        fa3 = None
    if fa3 is not None:
        def fa3_call(q, k, v, cu, S, scale):
            o = fa3(q, k, v, cu, cu, S, S, softmax_scale=scale, causal=True)
            return o[0] if isinstance(o, tuple) else o

        out["fa3 varlen expanded"] = fa3_call
    try:  # optional, as above
        from flash_attn import flash_attn_varlen_func as fa2
    except Exception:
        fa2 = None
    if fa2 is not None:
        out["flash_attn varlen expanded"] = lambda q, k, v, cu, S, scale: fa2(
            q, k, v, cu, cu, S, S, softmax_scale=scale, causal=True)
    return out


def _default_timer(device: str, reps: int):
    sync = torch.cuda.synchronize if device == "cuda" else None
    return lambda fn: repeat(fn, reps, warmup=2, sync=sync).median() * 1e3


def measure(*, P: int, B: int, L: int, H: int, Hkv: int, D: int, reps: int, device: str | None = None,
            timer=None) -> list[dict]:
    """Forward and forward+backward milliseconds per backend at one group-tree shape.

    Args:
        timer: fn(work) -> median milliseconds of work() (default: 2 warm-ups, `reps` timed runs);
            an exception it raises becomes that backend's "error".

    Returns rows {"backend", "rows" (query rows computed), "forward_ms", "fwd_bwd_ms"} (or "error"),
    then {"backend": "ideal expanded/tree pairs", "value"}; on CUDA also "max|triton-ref|" (the
    tree output against the first reference backend's on each branch's rows, relative)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    timer = timer or _default_timer(device, reps)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    R, S = P + B * L, P + L
    gen = torch.Generator().manual_seed(0)
    q_RHD = torch.randn(R, H, D, generator=gen).to(device, dtype)
    k_RHD = torch.randn(R, Hkv, D, generator=gen).to(device, dtype)
    v_RHD = torch.randn(R, Hkv, D, generator=gen).to(device, dtype)
    tree = group_tree(P, B, L, device)
    scale = D**-0.5
    tree_pairs = P * (P + 1) // 2 + B * (L * P + L * (L + 1) // 2)
    expanded_pairs = B * (S * (S + 1) // 2)
    # Expanded rows: per branch, the prompt then its continuation (gathered once, not timed).
    idx_E = torch.cat([torch.cat([torch.arange(P), P + b * L + torch.arange(L)]) for b in range(B)]).to(device)
    qe, ke, ve = (x.index_select(0, idx_E).contiguous() for x in (q_RHD, k_RHD, v_RHD))
    calls = _backends(P, B, L, H, D, tree, scale, device)
    inputs_of = {"tree": (q_RHD, k_RHD, v_RHD), "expanded": (qe, ke, ve),
                 "expanded, kv heads repeated": (qe, *(x.repeat_interleave(H // Hkv, 1) for x in (ke, ve)))}
    rows = [_time_backend(name, n_rows, fn, inputs_of[kind], timer) for name, (n_rows, fn, kind) in calls.items()]
    reference = next((name for name in REFERENCE_BACKENDS if name in calls), None)
    if "triton tree" in calls and reference is not None:
        rows.append(_triton_vs_reference(calls, reference, inputs_of, tree, P, B, L, scale, device))
    rows.append({"backend": "ideal expanded/tree pairs", "value": expanded_pairs / tree_pairs})
    for r in rows:
        r.update(device=device, dtype=str(dtype).removeprefix("torch."))
    return rows


def _backends(P: int, B: int, L: int, H: int, D: int, tree: TreeLayout, scale: float, device: str) -> dict:
    """{row name: (query rows computed, fn(q, k, v) -> o, inputs kind)} of the backends this device runs."""
    R, S = P + B * L, P + L

    def sdpa(q, k, v):
        shape = lambda x: x.view(B, S, x.shape[1], D).transpose(1, 2)  # noqa: E731
        if device == "cuda":
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(shape(q), shape(k), shape(v), is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(shape(q), shape(k), shape(v), is_causal=True, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(B * S, H, D)

    calls = {}
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        expanded = expanded_layout(B, S, device)
        calls["triton tree"] = (R, lambda q, k, v: tree_attention(q, k, v, tree, scale=scale, backend="triton"), "tree")
        calls["triton expanded"] = (B * S, lambda q, k, v: tree_attention(q, k, v, expanded, scale=scale, backend="triton"), "expanded")
        tree_bi = group_tree(P, B, L, device, batch_invariant=True)
        calls["triton batch-invariant tree"] = (
            R, lambda q, k, v: tree_attention(q, k, v, tree_bi, scale=scale, backend="triton"), "tree")
    if device == "cuda":
        cu = (torch.arange(B + 1, dtype=torch.int32) * S).to(device)
        for name, fa in flash_varlen().items():
            calls[name] = (B * S, lambda q, k, v, fa=fa: fa(q, k, v, cu, S, scale), "expanded")
        # SDPA's flash backend without GQA: kv heads repeated once, outside the timing.
        calls["sdpa flash expanded"] = (B * S, sdpa, "expanded, kv heads repeated")
    else:
        calls["ref tree"] = (R, lambda q, k, v: tree_attention(q, k, v, tree, scale=scale, backend="ref"), "tree")
        calls["sdpa expanded"] = (B * S, sdpa, "expanded")
    return calls


def _time_backend(name: str, n_rows: int, fn, inputs: tuple, timer) -> dict:
    """Forward and forward+backward milliseconds of one backend, or its error."""
    try:
        with torch.no_grad():
            fwd = timer(lambda: fn(*inputs))
        leaves = [x.detach().requires_grad_(True) for x in inputs]

        def fwd_bwd():
            o = fn(*leaves)
            torch.autograd.grad(o, leaves, torch.ones_like(o))

        return {"backend": name, "rows": n_rows, "forward_ms": fwd, "fwd_bwd_ms": timer(fwd_bwd)}
    except Exception as exc:  # one failing backend must not hide the others' numbers
        return {"backend": name, "rows": n_rows, "error": f"{type(exc).__name__}: {exc}"[:300]}


def _triton_vs_reference(calls: dict, reference: str, inputs_of: dict, tree: TreeLayout, P: int, B: int, L: int,
                         scale: float, device: str) -> dict:
    """The Triton tree output against the reference backend's on each branch's rows (relative)."""
    S = P + L
    q_RHD, k_RHD, v_RHD = inputs_of["tree"]
    name = f"max|triton-ref| / max|ref| ({reference})"
    try:
        with torch.no_grad():
            o_tree = tree_attention(q_RHD, k_RHD, v_RHD, tree, scale=scale, backend="triton").float()
            o_exp = calls[reference][1](*inputs_of[calls[reference][2]]).float()
        # Each branch's continuation rows, in the tree and in its expanded sequence.
        tree_rows = torch.cat([P + b * L + torch.arange(L) for b in range(B)]).to(device)
        exp_rows = torch.cat([b * S + P + torch.arange(L) for b in range(B)]).to(device)
        diff = (o_tree[tree_rows] - o_exp[exp_rows]).abs().max() / o_exp.abs().max()
        return {"backend": name, "value": diff.item()}
    except Exception as exc:
        return {"backend": name, "error": f"{type(exc).__name__}: {exc}"[:300]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--cont", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    rows = measure(P=a.prompt, B=a.branches, L=a.cont, H=a.heads, Hkv=a.kv_heads, D=a.dim, reps=a.reps)
    print(f"device={rows[0]['device']} dtype={rows[0]['dtype']} P={a.prompt} B={a.branches} L={a.cont} "
          f"H={a.heads} Hkv={a.kv_heads} D={a.dim}")
    print("| backend | rows | forward ms | forward+backward ms |")
    print("|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['backend']} | {r.get('rows', '')} | failed: {r['error']} | |")
        elif "value" in r:
            print(f"| {r['backend']} | | {r['value']:.3g} | |")
        else:
            print(f"| {r['backend']} | {r['rows']} | {r['forward_ms']:.2f} | {r['fwd_bwd_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
