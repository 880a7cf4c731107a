"""Tree-attention micro-benchmark: a group-sampling tree (one prompt, B continuations) through our
backends, against plain causal attention on the B expanded sequences (the same work unshared).

Run: `python -m benchmarks.bench_tree_attention [--prompt 2048 --branches 8 --cont 1024 --heads 16
--kv-heads 2 --dim 128]` (one markdown table row per measurement). On CUDA: bf16; our "triton"
backend on the tree and on the expanded sequences (each its own segment: equal work), PyTorch SDPA
(flash) and FlashAttention varlen (`flash_attn`, when importable) on the expanded sequences. On
CPU: fp32, the "ref" backend and SDPA only, at the sizes given (keep them small). The "ideal" row
is the expanded/tree ratio of visible (query, key) pairs: the most a tree layout can save.
`benchmarks.bench_kernels --gpu` runs this at its report's shapes.

Legend: P prompt rows, B branches, L continuation rows, R = P + B L tree rows, E = B (P + L)
expanded rows, H heads, Hkv kv heads, D head dim.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from harts_client.timing import repeat
from kernels.tree_attention import TreeLayout, prepare_tree_layout, tree_attention


def group_tree(P: int, B: int, L: int, device: str) -> TreeLayout:
    """Layout of one prompt segment (rows 0..P-1) and B continuation segments that see all of it."""
    seg_start = torch.tensor([0] + [P + b * L for b in range(B)], dtype=torch.int32)
    seg_len = torch.tensor([P] + [L] * B, dtype=torch.int32)
    attn_offsets = torch.tensor([0] + list(range(B + 1)), dtype=torch.int32)
    attn_ranges = torch.tensor([[0, P]] * B, dtype=torch.int32).reshape(-1, 2)
    return prepare_tree_layout(seg_start, seg_len, attn_offsets, attn_ranges, num_rows=P + B * L, device=device)


def expanded_layout(B: int, S: int, device: str) -> TreeLayout:
    """B independent causal sequences of S rows each (one segment each, no ancestors)."""
    return prepare_tree_layout(
        torch.arange(B, dtype=torch.int32) * S, torch.full((B,), S, dtype=torch.int32),
        torch.zeros(B + 1, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32), num_rows=B * S, device=device,
    )


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return flash_attn_varlen_func


def measure(*, P: int, B: int, L: int, H: int, Hkv: int, D: int, reps: int, device: str | None = None) -> list[dict]:
    """Forward and forward+backward milliseconds per backend at one group-tree shape.

    Returns rows {"backend", "rows" (query rows computed), "forward_ms", "fwd_bwd_ms"} (or "error"),
    then {"backend": "ideal expanded/tree pairs", "value"}; on CUDA also "max|triton-sdpa|" (the
    tree output against SDPA's on each branch's rows)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
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

    def sdpa(q, k, v):
        shape = lambda x: x.view(B, S, x.shape[1], D).transpose(1, 2)  # noqa: E731
        try:
            o = F.scaled_dot_product_attention(shape(q), shape(k), shape(v), is_causal=True, scale=scale, enable_gqa=True)
        except TypeError:  # torch without enable_gqa
            G = H // Hkv
            o = F.scaled_dot_product_attention(shape(q), shape(k).repeat_interleave(G, 1), shape(v).repeat_interleave(G, 1),
                                               is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(B * S, H, D)

    sync = torch.cuda.synchronize if device == "cuda" else None
    calls = {}
    if device == "cuda":
        expanded = expanded_layout(B, S, device)
        calls["triton tree"] = (R, lambda q, k, v: tree_attention(q, k, v, tree, scale=scale, backend="triton"), "tree")
        calls["triton expanded"] = (B * S, lambda q, k, v: tree_attention(q, k, v, expanded, scale=scale, backend="triton"), "expanded")
        fa = _flash_varlen()
        if fa is not None:
            cu = (torch.arange(B + 1, dtype=torch.int32) * S).to(device)
            calls["flash_attn varlen expanded"] = (
                B * S, lambda q, k, v: fa(q, k, v, cu, cu, S, S, softmax_scale=scale, causal=True), "expanded")
    else:
        calls["ref tree"] = (R, lambda q, k, v: tree_attention(q, k, v, tree, scale=scale, backend="ref"), "tree")
    calls["sdpa expanded"] = (B * S, sdpa, "expanded")

    rows = []
    for name, (n_rows, fn, kind) in calls.items():
        inputs = (q_RHD, k_RHD, v_RHD) if kind == "tree" else (qe, ke, ve)
        try:
            with torch.no_grad():
                fwd = repeat(lambda: fn(*inputs), reps, warmup=2, sync=sync).median()
            leaves = [x.detach().requires_grad_(True) for x in inputs]

            def fwd_bwd():
                o = fn(*leaves)
                torch.autograd.grad(o, leaves, torch.ones_like(o))

            both = repeat(fwd_bwd, reps, warmup=2, sync=sync).median()
            rows.append({"backend": name, "rows": n_rows, "forward_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3})
        except Exception as exc:  # one failing backend must not hide the others' numbers
            rows.append({"backend": name, "rows": n_rows, "error": f"{type(exc).__name__}: {exc}"[:300]})
    if device == "cuda":
        try:
            with torch.no_grad():
                o_tree = tree_attention(q_RHD, k_RHD, v_RHD, tree, scale=scale, backend="triton").float()
                o_exp = sdpa(qe, ke, ve).float()
            # Each branch's continuation rows, in the tree and in its expanded sequence.
            tree_rows = torch.cat([P + b * L + torch.arange(L) for b in range(B)]).to(device)
            exp_rows = torch.cat([b * S + P + torch.arange(L) for b in range(B)]).to(device)
            diff = (o_tree[tree_rows] - o_exp[exp_rows]).abs().max() / o_exp.abs().max()
            rows.append({"backend": "max|triton-sdpa| / max|sdpa|", "value": diff.item()})
        except Exception as exc:
            rows.append({"backend": "max|triton-sdpa| / max|sdpa|", "error": f"{type(exc).__name__}: {exc}"[:300]})
    rows.append({"backend": "ideal expanded/tree pairs", "value": expanded_pairs / tree_pairs})
    for r in rows:
        r.update(device=device, dtype=str(dtype).removeprefix("torch."))
    return rows


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
