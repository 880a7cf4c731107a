"""Kernel benchmarks: the chunked gated delta rule (GDN) and tree attention.

Run:

    python -m benchmarks.bench_kernels --gpu [--out DIR] [--quick] [--budget-s 300]
        The kernel report, one run: GDN forward and forward+backward of our Triton backend, fla's
        `chunk_gated_delta_rule` (when importable) and our PyTorch reference, bf16, varlen,
        T = 16k-64k, H = 16-32, K = V = 128; tree attention of our Triton backend on the tree and on
        the expanded sequences against PyTorch SDPA and FlashAttention varlen (when importable) on
        the expanded sequences (equal work). Writes DIR/kernels-gpu.md and DIR/kernels-gpu.json
        (default benchmarks/results/). Without a GPU it runs a small CPU fallback instead (our
        PyTorch references only, fp32, labelled as such) and writes DIR/kernels-cpu-fallback.md.
    python -m benchmarks.bench_kernels [--seqs 32 --seq-len 512 --heads 16]
        One GDN shape, our backends (the suite's entry, `harts bench --only kernels`, `run(quick)`).

Every measurement is guarded: a backend that fails (or is missing) gets a row saying so and the
others still run; `--budget-s` skips the remaining shapes once it is spent (the GPU check runs
under a fixed timeout). Timings are medians after warm-ups (the first call of a Triton kernel
compiles and autotunes it; warm-ups absorb that).

Legend: T packed rows, N sequences, H heads, K key dim, V value dim, C chunk size.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from harts_client.timing import repeat
from kernels.gated_delta_rule import chunk_gated_delta_rule

#: (sequences, length, heads, K = V, chunk) of run(): CUDA full / CUDA quick / CPU full / CPU quick
SHAPES = {
    ("cuda", False): (32, 512, 16, 128, 64),
    ("cuda", True): (4, 256, 4, 64, 64),
    ("cpu", False): (8, 256, 4, 32, 64),
    ("cpu", True): (2, 96, 2, 16, 16),
}

#: GPU report shapes: GDN (name, T, N, H, K = V) and tree attention (name, P, B, L, H, Hkv, D).
GDN_SHAPES = [("T=16k H=16", 16384, 4, 16, 128), ("T=32k H=32", 32768, 8, 32, 128), ("T=64k H=16", 65536, 16, 16, 128)]
TREE_SHAPES = [("P=8k B=4 L=2k", 8192, 4, 2048, 16, 2, 128), ("P=4k B=8 L=1k H=32", 4096, 8, 1024, 32, 4, 128),
               ("P=16k B=4 L=4k", 16384, 4, 4096, 16, 2, 128)]
#: CPU fallback shapes (reference timings only).
CPU_GDN_SHAPES = [("T=2k H=4", 2048, 4, 4, 32)]
CPU_TREE_SHAPES = [("P=256 B=4 L=128", 256, 4, 128, 4, 2, 32)]


def _median_seconds(fn, device: str, reps: int) -> float:
    """Median wall seconds of fn() over reps runs after two warm-ups (synchronised on CUDA)."""
    return repeat(fn, reps, warmup=2, sync=torch.cuda.synchronize if device == "cuda" else None).median("wall")


def measure(*, seqs: int, seq_len: int, heads: int, dim: int, chunk: int, reps: int, device: str | None = None) -> dict:
    """Time our backends available on `device` (default: CUDA if present) at one equal-length shape.

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
            s = _median_seconds(lambda: call(backend, *inputs), device, reps)
        out["rows"].append({"backend": backend, "pass": "forward", "ms": s * 1e3, "tokens_per_s": T / s})
        leaves = [x.detach().requires_grad_(True) for x in inputs]

        def fwd_bwd():
            o, st = call(backend, *leaves)
            torch.autograd.grad([o, st], leaves, [torch.ones_like(o), torch.ones_like(st)])

        s = _median_seconds(fwd_bwd, device, reps)
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


def _fla_chunk_gdr():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:  # not installed, or built for another torch/triton
        return None
    return fla_chunk


def _varlen_lengths(T: int, N: int, seed: int) -> list[int]:
    """N sequence lengths summing to T, within +-25% of T/N and mostly not chunk multiples."""
    gen = torch.Generator().manual_seed(seed)
    w = 0.75 + 0.5 * torch.rand(N, generator=gen, dtype=torch.float64)
    lens = (w / w.sum() * T).floor().long()
    lens[-1] += T - int(lens.sum())
    return lens.tolist()


def gdn_rows(name: str, T: int, N: int, H: int, D: int, *, device: str, reps: int, C: int = 64) -> list[dict]:
    """GDN forward and forward+backward per backend at one varlen shape (fp32 states, l2norm, an
    initial state per sequence, exports at a chunk boundary inside every sequence and at its end;
    fla returns the final states, the same work but the mid-sequence exports)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lens = _varlen_lengths(T, N, seed=T + N)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    gen = torch.Generator().manual_seed(1)
    x = dict(
        q=torch.randn(T, H, D, generator=gen), k=torch.randn(T, H, D, generator=gen), v=torch.randn(T, H, D, generator=gen),
        g=torch.nn.functional.logsigmoid(torch.randn(T, H, generator=gen)) * 0.1, beta=torch.rand(T, H, generator=gen),
        h0=0.1 * torch.randn(N, H, D, D, generator=gen),
    )
    x = {n: t.to(device, dtype if n in ("q", "k", "v") else torch.float32) for n, t in x.items()}
    es = torch.arange(N).repeat_interleave(2)
    ep = torch.tensor([p for L in lens for p in (max(C, (L // 2) // C * C) if L > C else L, L)])
    do = torch.randn(T, H, D, generator=gen).to(device, dtype)
    calls = {}
    for backend in (["triton", "ref"] if device == "cuda" else ["ref"]):
        calls[f"harts {backend}"] = lambda q, k, v, g, beta, h0, b=backend: chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, export_seq=es, export_pos=ep, chunk_size=C,
            use_qk_l2norm=True, backend=b)
    fla = _fla_chunk_gdr() if device == "cuda" else None
    if fla is not None:
        cu_dev = cu.to(device)

        def fla_call(q, k, v, g, beta, h0):
            o, ht = fla(q[None], k[None], v[None], g[None], beta[None], scale=D**-0.5, initial_state=h0,
                        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_dev)
            return o[0], ht

        calls["fla chunk_gated_delta_rule"] = fla_call
    rows, outs = [], {}
    for backend, fn in calls.items():
        row = {"kernel": "gdn", "shape": name, "T": T, "N": N, "H": H, "K": D, "backend": backend}
        try:
            inputs = [x[n] for n in ("q", "k", "v", "g", "beta", "h0")]
            with torch.no_grad():
                outs[backend] = fn(*inputs)[0].float()
                row["forward_ms"] = _median_seconds(lambda: fn(*inputs), device, reps) * 1e3
            leaves = [t.detach().requires_grad_(True) for t in inputs]

            def fwd_bwd():
                o, st = fn(*leaves)
                torch.autograd.grad([o, st], leaves, [do, torch.ones_like(st)])

            row["fwd_bwd_ms"] = _median_seconds(fwd_bwd, device, reps) * 1e3
        except Exception as exc:  # one failing backend must not hide the others' numbers
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    ref = outs.get("harts ref")
    for row in rows:
        if ref is not None and row["backend"] in outs:
            row["max_rel_diff_vs_ref"] = ((outs[row["backend"]] - ref).abs().max() / ref.abs().max()).item()
    return rows


def tree_rows(name: str, P: int, B: int, L: int, H: int, Hkv: int, D: int, *, device: str, reps: int) -> list[dict]:
    from benchmarks.bench_tree_attention import measure as tree_measure

    rows = tree_measure(P=P, B=B, L=L, H=H, Hkv=Hkv, D=D, reps=reps, device=device)
    for r in rows:
        r.update(kernel="tree_attention", shape=name, H=H, Hkv=Hkv, D=D)
    return rows


def _ratio(rows: list[dict], shape: str, num: str, den: str, key: str) -> float | None:
    by = {r["backend"]: r for r in rows if r.get("shape") == shape}
    if num in by and den in by and key in by[num] and key in by[den]:
        return by[num][key] / by[den][key]
    return None


def _fmt(x, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    """The report as markdown: environment, one table per kernel, the target ratios."""
    lines = [f"# Kernel benchmark ({report['mode']})", ""]
    lines += [f"- {k}: {v}" for k, v in report["env"].items()]
    lines += ["", "## Gated delta rule (varlen, C = 64, l2norm, fp32 states)", ""]
    lines += ["| shape | backend | forward ms | forward+backward ms | max rel diff vs ref | note |", "|---|---|---|---|---|---|"]
    gdn = [r for r in report["rows"] if r["kernel"] == "gdn"]
    for r in gdn:
        lines.append(f"| {r['shape']} (N={r['N']}) | {r['backend']} | {_fmt(r.get('forward_ms'))} | {_fmt(r.get('fwd_bwd_ms'))} "
                     f"| {_fmt(r.get('max_rel_diff_vs_ref'), '.2e')} | {r.get('error', '')} |")
    lines += ["", "## Tree attention (group tree: prompt P, B branches of L rows)", ""]
    lines += ["| shape | backend | query rows | forward ms | forward+backward ms | value / note |", "|---|---|---|---|---|---|"]
    for r in (r for r in report["rows"] if r["kernel"] == "tree_attention"):
        val = _fmt(r.get("value"), ".3g") if "value" in r else ""
        lines.append(f"| {r['shape']} | {r['backend']} | {r.get('rows', '')} | {_fmt(r.get('forward_ms'))} "
                     f"| {_fmt(r.get('fwd_bwd_ms'))} | {val}{r.get('error', '')} |")
    if report["mode"] == "gpu":
        lines += ["", "## Targets", "", "| check | shape | value | target |", "|---|---|---|---|"]
        for s in dict.fromkeys(r["shape"] for r in gdn):
            for key, label in (("forward_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
                v = _ratio(report["rows"], s, "harts triton", "fla chunk_gated_delta_rule", key)
                lines.append(f"| GDN {label}: harts triton / fla | {s} | {_fmt(v)} | <= 1.2 (fwd+bwd) |")
        for s in dict.fromkeys(r["shape"] for r in report["rows"] if r["kernel"] == "tree_attention"):
            for num, label in (("triton expanded", "equal work"), ("triton tree", "tree vs expanded")):
                v = _ratio(report["rows"], s, num, "flash_attn varlen expanded", "fwd_bwd_ms")
                lines.append(f"| tree attention fwd+bwd, {label}: {num} / flash_attn varlen expanded | {s} | {_fmt(v)} "
                             f"| {'<= 1.3' if num == 'triton expanded' else '< 1 (sharing pays)'} |")
    skipped = report.get("skipped") or []
    if skipped:
        lines += ["", f"Skipped (time budget): {', '.join(skipped)}"]
    return "\n".join(lines) + "\n"


def report(*, out_dir: Path, quick: bool, budget_s: float, reps: int) -> dict:
    """Run the GPU report (or, without CUDA, the CPU fallback) and write it under out_dir."""
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if gpu else "cpu (no CUDA)",
           "dtype": "bf16" if gpu else "fp32"}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = "not importable"
    env["fla"] = "importable" if gpu and _fla_chunk_gdr() is not None else "not used" if not gpu else "not importable"
    if not gpu:
        env["note"] = "CPU fallback: our PyTorch references only (the Triton interpreter is a correctness tool, not a backend); no GPU kernel was timed"
    gdn_shapes = GDN_SHAPES if gpu else CPU_GDN_SHAPES
    tree_shapes = TREE_SHAPES if gpu else CPU_TREE_SHAPES
    if quick:
        gdn_shapes, tree_shapes = gdn_shapes[:1], tree_shapes[:1]
    t0 = time.perf_counter()
    rows, skipped = [], []
    # Interleaved, so that a spent budget still leaves the first shape of each kernel measured.
    jobs = [job for pair in itertools.zip_longest(
        [("gdn", s) for s in gdn_shapes], [("tree", s) for s in tree_shapes]) for job in pair if job is not None]
    for kind, shape in jobs:
        if time.perf_counter() - t0 > budget_s:
            skipped.append(f"{kind} {shape[0]}")
            continue
        print(f"[bench_kernels] {kind} {shape[0]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if kind == "gdn":
            rows += gdn_rows(*shape, device=device, reps=reps)
        else:
            rows += tree_rows(*shape, device=device, reps=reps)
        if gpu:
            torch.cuda.empty_cache()
    res = {"mode": "gpu" if gpu else "cpu-fallback", "env": env, "rows": rows, "skipped": skipped,
           "seconds": time.perf_counter() - t0}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "kernels-gpu" if gpu else "kernels-cpu-fallback"
    (out_dir / f"{stem}.md").write_text(markdown(res))
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the kernel report (GPU; a CPU fallback without CUDA)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="report directory (--gpu)")
    ap.add_argument("--quick", action="store_true", help="first shape of each kernel only (--gpu)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining shapes after this many seconds (--gpu)")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = ap.parse_args(argv)
    if args.gpu:
        res = report(out_dir=args.out, quick=args.quick, budget_s=args.budget_s, reps=args.reps)
        print(json.dumps(res, indent=1) if args.json else markdown(res))
        return 0
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
