"""Kernel micro-benchmark: chunked gated delta rule, reference vs Triton forward (and ref backward).

Run on a CUDA machine: `python -m benchmarks.bench_kernels [--seqs 32 --seq-len 512 --heads 16]`.
On CPU it times the reference only (the Triton interpreter is a correctness tool, not a backend).
Prints one markdown table row per measurement.

Legend: T packed rows, N sequences, H heads, K key dim, V value dim.
"""
from __future__ import annotations

import argparse
import time

import torch

from kernels.gated_delta_rule import chunk_gated_delta_rule


def _time(fn, device: str, reps: int) -> float:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    N, L, H, D, C = args.seqs, args.seq_len, args.heads, args.dim, args.chunk
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
    backends = ["ref", "triton"] if device == "cuda" else ["ref"]
    print(f"device={device} dtype={dtype} N={N} L={L} T={T} H={H} K=V={D} C={C}")
    print("| backend | pass | ms | tokens/s |")
    print("|---|---|---|---|")
    for backend in backends:
        with torch.no_grad():
            s = _time(lambda: call(backend, *inputs), device, args.reps)
        print(f"| {backend} | forward | {s * 1e3:.2f} | {T / s:.3g} |")
        leaves = [x.detach().requires_grad_(True) for x in inputs]

        def fwd_bwd():
            o, st = call(backend, *leaves)
            torch.autograd.grad([o, st], leaves, [torch.ones_like(o), torch.ones_like(st)])

        s = _time(fwd_bwd, device, args.reps)
        print(f"| {backend} | forward+backward | {s * 1e3:.2f} | {T / s:.3g} |")
    if device == "cuda":
        o_t, s_t = call("triton", *inputs)
        o_r, s_r = call("ref", *inputs)
        print(f"max |o_triton - o_ref| = {(o_t.float() - o_r.float()).abs().max().item():.3g}, "
              f"max |state diff| = {(s_t - s_r).abs().max().item():.3g}")


if __name__ == "__main__":
    main()
