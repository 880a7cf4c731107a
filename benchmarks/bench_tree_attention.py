"""Tree-attention micro-benchmark: a group-sampling tree (one prompt, B continuations) through the
reference and the Triton kernels, against plain causal attention on the B expanded sequences.

Run: `python -m benchmarks.bench_tree_attention [--prompt 2048 --branches 8 --cont 1024 --heads 16
--kv-heads 2 --dim 128]` (one markdown table row per measurement). On CUDA: bf16, backends "ref",
"triton" and the expanded baseline (`scaled_dot_product_attention`, causal, flash); on CPU: fp32,
"ref" and the expanded baseline only, at the sizes given (keep them small). The "ideal" column is
the expanded/tree ratio of visible (query, key) pairs: the most a tree layout can save.

Legend: P prompt rows, B branches, L continuation rows, R = P + B L tree rows, H heads, Hkv kv heads, D head dim.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_kernels import median_seconds
from kernels.tree_attention import tree_attention


def group_tree(P: int, B: int, L: int) -> dict[str, torch.Tensor]:
    """Layout of one prompt segment (rows 0..P-1) and B continuation segments that see all of it."""
    seg_start = torch.tensor([0] + [P + b * L for b in range(B)], dtype=torch.int32)
    seg_len = torch.tensor([P] + [L] * B, dtype=torch.int32)
    attn_offsets = torch.tensor([0] + list(range(B + 1)), dtype=torch.int32)
    attn_ranges = torch.tensor([[0, P]] * B, dtype=torch.int32).reshape(-1, 2)
    return dict(seg_start=seg_start, seg_len=seg_len, attn_offsets=attn_offsets, attn_ranges=attn_ranges)


def measure(*, P: int, B: int, L: int, H: int, Hkv: int, D: int, reps: int) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    R = P + B * L
    gen = torch.Generator().manual_seed(0)
    q_RHD = torch.randn(R, H, D, generator=gen).to(device, dtype)
    k_RHD = torch.randn(R, Hkv, D, generator=gen).to(device, dtype)
    v_RHD = torch.randn(R, Hkv, D, generator=gen).to(device, dtype)
    layout = group_tree(P, B, L)
    scale = D**-0.5
    tree_pairs = P * (P + 1) // 2 + B * (L * P + L * (L + 1) // 2)
    expanded_pairs = B * ((P + L) * (P + L + 1) // 2)
    # Expanded rows: per branch, the prompt then its continuation.
    idx_BT = torch.stack([torch.cat([torch.arange(P), P + b * L + torch.arange(L)]) for b in range(B)]).to(device)

    def tree_call(backend, q, k, v):
        return tree_attention(q, k, v, **layout, scale=scale, backend=backend)

    def expanded_call(q, k, v):
        G = H // Hkv
        qe = q[idx_BT].transpose(1, 2)  # [B, H, P+L, D]
        ke = k[idx_BT].repeat_interleave(G, dim=2).transpose(1, 2)
        ve = v[idx_BT].repeat_interleave(G, dim=2).transpose(1, 2)
        return F.scaled_dot_product_attention(qe, ke, ve, is_causal=True, scale=scale)

    calls = {"ref": lambda *x: tree_call("ref", *x), "expanded_sdpa": expanded_call}
    if device == "cuda":
        calls["triton"] = lambda *x: tree_call("triton", *x)
    rows = []
    for name, fn in calls.items():
        with torch.no_grad():
            fwd = median_seconds(lambda: fn(q_RHD, k_RHD, v_RHD), device, reps)
        leaves = [x.detach().requires_grad_(True) for x in (q_RHD, k_RHD, v_RHD)]

        def fwd_bwd():
            o = fn(*leaves)
            torch.autograd.grad(o, leaves, torch.ones_like(o))

        both = median_seconds(fwd_bwd, device, reps)
        rows.append({"backend": name, "forward_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3})
    if device == "cuda":
        with torch.no_grad():
            diff = (tree_call("triton", q_RHD, k_RHD, v_RHD).float() - tree_call("ref", q_RHD, k_RHD, v_RHD).float())
        rows.append({"backend": "max|triton-ref|", "value": diff.abs().max().item()})
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
    print("| backend | forward ms | forward+backward ms |")
    print("|---|---|---|")
    for r in rows:
        if "value" in r:
            print(f"| {r['backend']} | {r['value']:.3g} | |")
        else:
            print(f"| {r['backend']} | {r['forward_ms']:.2f} | {r['fwd_bwd_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
