"""Kernel micro-benchmark: chunked gated delta rule, reference vs Triton, forward and forward+backward.

Run: `python -m benchmarks.bench_kernels [--seqs 32 --seq-len 512 --heads 16]` (one markdown table
row per measurement), or through the suite (`harts bench --only kernels`, `run(quick)`).
On CPU it times the PyTorch reference (`chunk_ref`) only, fp32 at a small shape (the Triton
interpreter is a correctness tool, not a backend); on CUDA both backends in bf16, and the largest
difference between them.

Legend: T packed rows, N sequences, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from kernels.gated_delta_rule import chunk_gated_delta_rule

#: (sequences, length, heads, K = V, chunk) of run(): CUDA full / CUDA quick / CPU full / CPU quick
SHAPES = {
    ("cuda", False): (32, 512, 16, 128, 64),
    ("cuda", True): (4, 256, 4, 64, 64),
    ("cpu", False): (8, 256, 4, 32, 64),
    ("cpu", True): (2, 96, 2, 16, 16),
}


def median_seconds(fn, device: str, reps: int) -> float:
    """Median seconds of fn() over reps runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure(*, seqs: int, seq_len: int, heads: int, dim: int, chunk: int, reps: int, device: str | None = None) -> dict:
    """Time every backend available on `device` (default: CUDA if present) at one shape.

    Returns {"device", "dtype", "N", "L", "T", "H", "K", "C", "rows": [{"backend", "pass", "ms",
    "tokens_per_s"}], and on CUDA "max_abs_diff_output", "max_abs_diff_state" (triton vs ref)}.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    N, L, H, D, C = seqs, seq_len, heads, dim, chunk
    T = N * L
    gen = torch.Generator().manual_seed(0)
    q_THK = torch.randn(T, H, D, generator=gen).to(device, dtype)
    k_THK = torch.randn(T, H, D, generator=gen).to(device, dtype)
    v_THV = torch.randn(T, H, D, generator=gen).to(device, dtype)
    g_TH = (-0.1 * torch.rand(T, H, generator=gen)).to(device)
    beta_TH = torch.rand(T, H, generator=gen).to(device)
    h0_NHKV = torch.zeros(N, H, D, D, device=device)
    cu = torch.arange(N + 1) * L
    es = torch.arange(N)
    ep = torch.full((N,), L)

    def call(backend: str, *xs: torch.Tensor):
        return chunk_gated_delta_rule(
            *xs, cu_seqlens=cu, initial_state=h0_NHKV, export_seq=es, export_pos=ep, chunk_size=C,
            use_qk_l2norm=True, backend=backend,
        )

    inputs = (q_THK, k_THK, v_THV, g_TH, beta_TH)
    out = {"device": device, "dtype": str(dtype).removeprefix("torch."), "N": N, "L": L, "T": T, "H": H, "K": D, "C": C, "rows": []}
    for backend in ["ref", "triton"] if device == "cuda" else ["ref"]:
        with torch.no_grad():
            s = median_seconds(lambda: call(backend, *inputs), device, reps)
        out["rows"].append({"backend": backend, "pass": "forward", "ms": s * 1e3, "tokens_per_s": T / s})
        leaves = [x.detach().requires_grad_(True) for x in inputs]

        def fwd_bwd():
            o, st = call(backend, *leaves)
            torch.autograd.grad([o, st], leaves, [torch.ones_like(o), torch.ones_like(st)])

        s = median_seconds(fwd_bwd, device, reps)
        out["rows"].append({"backend": backend, "pass": "forward+backward", "ms": s * 1e3, "tokens_per_s": T / s})
    if device == "cuda":
        with torch.no_grad():
            o_t, s_t = call("triton", *inputs)
            o_r, s_r = call("ref", *inputs)
        out["max_abs_diff_output"] = (o_t.float() - o_r.float()).abs().max().item()
        out["max_abs_diff_state"] = (s_t - s_r).abs().max().item()
    return out


def run(quick: bool = False) -> dict:
    """Suite entry point: `measure` at this machine's shape (CPU: the reference only, small)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    N, L, H, D, C = SHAPES[(device, quick)]
    return measure(seqs=N, seq_len=L, heads=H, dim=D, chunk=C, reps=2 if quick else 5, device=device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = ap.parse_args(argv)
    res = measure(seqs=args.seqs, seq_len=args.seq_len, heads=args.heads, dim=args.dim, chunk=args.chunk, reps=args.reps)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(f"device={res['device']} dtype={res['dtype']} N={res['N']} L={res['L']} T={res['T']} H={res['H']} K=V={res['K']} C={res['C']}")
    print("| backend | pass | ms | tokens/s |")
    print("|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['backend']} | {r['pass']} | {r['ms']:.2f} | {r['tokens_per_s']:.3g} |")
    if "max_abs_diff_output" in res:
        print(f"max |o_triton - o_ref| = {res['max_abs_diff_output']:.3g}, max |state diff| = {res['max_abs_diff_state']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
