"""Kernel benchmarks: the chunked gated delta rule (GDN), tree attention and the batch-invariant matmul.

    python -m benchmarks.bench_kernels --gpu [--out DIR] [--quick] [--budget-s 300] [--shape-budget-s 90]
    python -m benchmarks.bench_kernels --dry-run [--out DIR]     # the same code, tiny CPU shapes, fp32
    python -m benchmarks.bench_kernels [--seqs 32 --seq-len 512 --heads 16]   # one GDN shape (the suite's entry)

`--gpu` writes DIR/kernels-gpu.{md,json,jsonl}, every shape's rows appended the moment they are
measured, so a killed run keeps what it finished. Shapes, rivals, budgets and targets:
benchmarks/README.md ("Kernels on a GPU").
Legend: T packed rows, N sequences, H heads, K key dim, V value dim, C chunk size; matmul
M x K by K x N.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.bench_tree_attention import REFERENCE_BACKENDS, flash_varlen
from benchmarks.bench_tree_attention import measure as tree_measure
from harts_client.timing import repeat
from kernels import triton_640, triton_tuning
from kernels.batch_invariant import mm_t
from kernels.gated_delta_rule import chunk_gated_delta_rule

#: (sequences, length, heads, K = V, chunk) of run(): CUDA full / CUDA quick / CPU full / CPU quick
SHAPES = {
    ("cuda", False): (32, 512, 16, 128, 64),
    ("cuda", True): (4, 256, 4, 64, 64),
    ("cpu", False): (8, 256, 4, 32, 64),
    ("cpu", True): (2, 96, 2, 16, 16),
}

#: Report shapes per mode: GDN (name, T, N, H, K = V, C), tree attention (name, P, B, L, H, Hkv, D),
#: matmul (name, M, K, N).
REPORT_SHAPES = {
    "gpu": {
        "gdn": [("T=16k H=16", 16384, 4, 16, 128, 64), ("T=32k H=32", 32768, 8, 32, 128, 64),
                ("T=64k H=16", 65536, 16, 16, 128, 64)],
        "tree": [("P=8k B=4 L=2k", 8192, 4, 2048, 16, 2, 128), ("P=4k B=8 L=1k H=32", 4096, 8, 1024, 32, 4, 128),
                 ("P=16k B=4 L=4k", 16384, 4, 4096, 16, 2, 128)],
        "matmul": [(f"M=8192 K={K} N={N}", 8192, K, N) for K in (2048, 4096, 8192) for N in (2048, 4096, 8192)],
    },
    "dry-run": {
        "gdn": [("T=40 H=1", 40, 2, 1, 16, 16)],
        "tree": [("P=16 B=2 L=8", 16, 2, 8, 2, 1, 16)],
        "matmul": [("M=64 K=32 N=48", 64, 32, 48), ("M=70 K=40 N=16", 70, 40, 16)],
    },
}


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


class BudgetSpent(RuntimeError):
    """A shape's time budget ran out before a measurement."""


@dataclass(slots=True, kw_only=True)
class Timer:
    """Median milliseconds of a callable within the current shape's budget (`deadline`)."""

    device: str
    reps: int
    deadline: float = math.inf
    """`time.perf_counter()` value after which no new run starts."""

    def __call__(self, fn) -> float:
        """Two warm-ups, then up to `reps` timed runs (at least one); BudgetSpent when the deadline
        passes before the first timed run."""
        sync = torch.cuda.synchronize if self.device == "cuda" else None
        for _ in range(2):
            if time.perf_counter() > self.deadline:
                raise BudgetSpent("shape budget spent before this measurement")
            fn()
        ms = []
        for _ in range(self.reps):
            if ms and time.perf_counter() > self.deadline:
                break
            ms.append(repeat(fn, 1, sync=sync).median("wall") * 1e3)
        return sorted(ms)[len(ms) // 2]


def _triton_runs(device: str) -> bool:
    return device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def _fla_chunk_gdr():
    try:  # optional: fla is a peer, installed on some GPU machines only
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


def gdn_rows(name: str, T: int, N: int, H: int, D: int, C: int, *, device: str, timer: Timer) -> list[dict]:
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
    for backend in (["triton", "ref"] if _triton_runs(device) else ["ref"]):
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
                row["forward_ms"] = timer(lambda: fn(*inputs))
            leaves = [t.detach().requires_grad_(True) for t in inputs]

            def fwd_bwd():
                o, st = fn(*leaves)
                torch.autograd.grad([o, st], leaves, [do, torch.ones_like(st)])

            row["fwd_bwd_ms"] = timer(fwd_bwd)
        except Exception as exc:  # one failing backend must not hide the others' numbers
            row["error"] = _error(exc)
        rows.append(row)
    ref = outs.get("harts ref")
    for row in rows:
        if ref is not None and row["backend"] in outs:
            row["max_rel_diff_vs_ref"] = ((outs[row["backend"]] - ref).abs().max() / ref.abs().max()).item()
    return rows


def tree_rows(name: str, P: int, B: int, L: int, H: int, Hkv: int, D: int, *, device: str, timer: Timer) -> list[dict]:
    rows = tree_measure(P=P, B=B, L=L, H=H, Hkv=Hkv, D=D, reps=timer.reps, device=device, timer=timer)
    for r in rows:
        r.update(kernel="tree_attention", shape=name, H=H, Hkv=Hkv, D=D)
    return rows


def matmul_rows(name: str, M: int, K: int, N: int, *, device: str, timer: Timer) -> list[dict]:
    """y = x @ w.T forward: the batch-invariant Triton matmul and torch.mm (cuBLAS on CUDA)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    w = (torch.randn(N, K, generator=gen) * K**-0.5).to(device, dtype)
    calls = {"torch.mm": lambda: torch.mm(x, w.t())}
    if _triton_runs(device):
        calls["batch-invariant mm_t"] = lambda: mm_t(x, w)
    rows, outs = [], {}
    for backend, fn in calls.items():
        row = {"kernel": "matmul", "shape": name, "M": M, "K": K, "N": N, "backend": backend}
        try:
            with torch.no_grad():
                outs[backend] = fn().float()
                row["forward_ms"] = timer(fn)
            row["tflops"] = 2 * M * K * N / (row["forward_ms"] * 1e-3) / 1e12
        except Exception as exc:
            row["error"] = _error(exc)
        rows.append(row)
    if len(outs) == 2:
        ref = outs["torch.mm"]
        rows[-1]["max_rel_diff_vs_torch"] = ((outs["batch-invariant mm_t"] - ref).abs().max() / ref.abs().max()).item()
    return rows


def _ratio(rows: list[dict], shape: str, num: str, den: str, key: str) -> float | None:
    by = {r["backend"]: r for r in rows if r.get("shape") == shape}
    if num in by and den in by and key in by[num] and key in by[den]:
        return by[num][key] / by[den][key]
    return None


def _fmt(x, spec: str = ".2f") -> str:
    return "" if x is None else format(x, spec)


def _reference_attention(rows: list[dict], shape: str) -> str | None:
    """The first FlashAttention baseline measured at `shape` (`REFERENCE_BACKENDS` order)."""
    have = {r["backend"] for r in rows if r.get("shape") == shape and "fwd_bwd_ms" in r}
    return next((b for b in REFERENCE_BACKENDS if b in have), None)


def markdown(report: dict) -> str:
    """The report as markdown: environment, one table per kernel, the target ratios."""
    rows = report["rows"]
    lines = [f"# Kernel benchmark ({report['mode']})", ""]
    lines += [f"- {k}: {v}" for k, v in report["env"].items()]
    lines += ["", "## Gated delta rule (varlen, C = 64, l2norm, fp32 states)", ""]
    lines += ["| shape | backend | forward ms | forward+backward ms | max rel diff vs ref | note |", "|---|---|---|---|---|---|"]
    gdn = [r for r in rows if r["kernel"] == "gdn"]
    for r in gdn:
        lines.append(f"| {r['shape']} (N={r['N']}) | {r['backend']} | {_fmt(r.get('forward_ms'))} | {_fmt(r.get('fwd_bwd_ms'))} "
                     f"| {_fmt(r.get('max_rel_diff_vs_ref'), '.2e')} | {r.get('error', '')} |")
    lines += ["", "## Tree attention (group tree: prompt P, B branches of L rows)", ""]
    lines += ["| shape | backend | query rows | forward ms | forward+backward ms | value / note |", "|---|---|---|---|---|---|"]
    tree = [r for r in rows if r["kernel"] == "tree_attention"]
    for r in tree:
        val = _fmt(r.get("value"), ".3g") if "value" in r else ""
        lines.append(f"| {r['shape']} | {r['backend']} | {r.get('rows', '')} | {_fmt(r.get('forward_ms'))} "
                     f"| {_fmt(r.get('fwd_bwd_ms'))} | {val}{r.get('error', '')} |")
    lines += ["", "## Batch-invariant matmul y = x @ w.T (forward)", ""]
    lines += ["| shape | backend | ms | TFLOP/s | max rel diff vs torch | note |", "|---|---|---|---|---|---|"]
    mm = [r for r in rows if r["kernel"] == "matmul"]
    for r in mm:
        lines.append(f"| {r['shape']} | {r['backend']} | {_fmt(r.get('forward_ms'), '.3f')} | {_fmt(r.get('tflops'), '.1f')} "
                     f"| {_fmt(r.get('max_rel_diff_vs_torch'), '.2e')} | {r.get('error', '')} |")
    lines += ["", "## Targets", "", "| check | shape | value | target |", "|---|---|---|---|"]
    for s in dict.fromkeys(r["shape"] for r in gdn):
        for key, label in (("forward_ms", "forward"), ("fwd_bwd_ms", "forward+backward")):
            v = _ratio(rows, s, "harts triton", "fla chunk_gated_delta_rule", key)
            lines.append(f"| GDN {label}: harts triton / fla | {s} | {_fmt(v)} | <= 1.2 (fwd+bwd) |")
    for s in dict.fromkeys(r["shape"] for r in tree):
        ref = _reference_attention(rows, s)
        for num, label, target in (("triton expanded", "equal work", "<= 1.3"), ("triton tree", "tree vs expanded", "< 1 (sharing pays)"),
                                   ("triton batch-invariant tree", "batch-invariant tree vs expanded", "its cost")):
            v = None if ref is None else _ratio(rows, s, num, ref, "fwd_bwd_ms")
            lines.append(f"| tree attention fwd+bwd, {label}: {num} / {ref or 'FlashAttention (none measured)'} | {s} "
                         f"| {_fmt(v)} | {target} |")
    for s in dict.fromkeys(r["shape"] for r in mm):
        v = _ratio(rows, s, "batch-invariant mm_t", "torch.mm", "forward_ms")
        lines.append(f"| batch-invariant matmul time / torch.mm | {s} | {_fmt(v)} | the cost of batch invariance |")
    skipped = report.get("skipped") or []
    if skipped:
        lines += ["", f"Skipped (time budget): {', '.join(skipped)}"]
    return "\n".join(lines) + "\n"


class ReportFiles:
    """DIR/<stem>.jsonl gets each row as it is measured; <stem>.md and .json are rewritten after each shape."""

    def __init__(self, out_dir: Path, stem: str, report: dict):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.paths = {ext: out_dir / f"{stem}.{ext}" for ext in ("jsonl", "md", "json")}
        self.paths["jsonl"].write_text("")
        self.report = report

    def add(self, rows: list[dict]) -> None:
        self.report["rows"] += rows
        with self.paths["jsonl"].open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        self.write()

    def write(self) -> None:
        self.paths["md"].write_text(markdown(self.report))
        self.paths["json"].write_text(json.dumps(self.report, indent=1))


def _env(device: str, mode: str) -> dict:
    gpu = device == "cuda"
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if gpu else "cpu (no CUDA)",
           "dtype": "bf16" if gpu else "fp32"}
    try:  # optional: Triton may not import on a CPU-only machine
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = "not importable"
    env["autotune"] = (f"HARTS_AUTOTUNE={os.environ.get('HARTS_AUTOTUNE', '1')}: "
                       + ("num_stages tuned, choices cached on disk" if triton_tuning.TUNE else "first config only"))
    if gpu:
        dev = torch.device("cuda", torch.cuda.current_device())
        env["fla #640"] = f"affected={triton_640.affected(dev)} policy={triton_640.policy()}"
        env["fla"] = "importable" if _fla_chunk_gdr() is not None else "not importable"
        env["FlashAttention"] = ", ".join(flash_varlen()) or "FA3/FA2 not importable (SDPA flash only)"
    if mode == "dry-run":
        env["note"] = ("CPU dry run on tiny shapes, fp32: the report's code paths, not a measurement; Triton rows run "
                       "only under TRITON_INTERPRET=1 (timings meaningless)")
    return env


def report(*, out_dir: Path, quick: bool, budget_s: float, reps: int, shape_budget_s: float = 90.0,
           dry_run: bool = False) -> dict:
    """Run the GPU report (or, with `dry_run` or without CUDA, the dry run) and write it under out_dir."""
    device = "cuda" if torch.cuda.is_available() and not dry_run else "cpu"
    mode = "gpu" if device == "cuda" else "dry-run"
    shapes = REPORT_SHAPES[mode]
    if quick:
        shapes = {kind: s[:1] for kind, s in shapes.items()}
    res = {"mode": mode, "env": _env(device, mode), "rows": [], "skipped": [], "seconds": 0.0}
    files = ReportFiles(out_dir, "kernels-gpu" if mode == "gpu" else "kernels-dry-run", res)
    measure_fn = {"gdn": gdn_rows, "tree": tree_rows, "matmul": matmul_rows}
    # Interleaved (gdn, tree, every matmul shape, gdn, tree, ...): a spent budget still leaves the
    # first shape of each kind measured; the matmul shapes take milliseconds each.
    order = [[("gdn", s)] for s in shapes["gdn"]]
    for i, s in enumerate(shapes["tree"]):
        if i < len(order):
            order[i].append(("tree", s))
        else:
            order.append([("tree", s)])
    order[0] += [("matmul", s) for s in shapes["matmul"]]
    t0 = time.perf_counter()
    for kind, shape in itertools.chain.from_iterable(order):
        if time.perf_counter() - t0 > budget_s:
            res["skipped"].append(f"{kind} {shape[0]}")
            continue
        print(f"[bench_kernels] {kind} {shape[0]} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        timer = Timer(device=device, reps=reps, deadline=time.perf_counter() + shape_budget_s)
        files.add(measure_fn[kind](*shape, device=device, timer=timer))
        if device == "cuda":
            torch.cuda.empty_cache()
        res["seconds"] = time.perf_counter() - t0
    files.write()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="the kernel report (a dry run without CUDA)")
    ap.add_argument("--dry-run", action="store_true", help="the report's code on tiny CPU shapes")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="report directory")
    ap.add_argument("--quick", action="store_true", help="first shape of each kernel only")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining shapes after this many seconds")
    ap.add_argument("--shape-budget-s", type=float, default=90.0, help="stop measuring one shape after this many seconds")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128, help="K = V")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = ap.parse_args(argv)
    if args.gpu or args.dry_run:
        if args.gpu and not args.dry_run and not torch.cuda.is_available():
            print("[bench_kernels] no CUDA: running the dry run", file=sys.stderr)
        res = report(out_dir=args.out, quick=args.quick, budget_s=args.budget_s, reps=args.reps,
                     shape_budget_s=args.shape_budget_s, dry_run=args.dry_run)
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
