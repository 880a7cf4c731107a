"""Compile every Triton kernel of `kernels/` for a CUDA target without a GPU, and report its registers
and spills: the compiled path's check on a machine that has none (the interpreter runs the kernels'
Python, not Triton's compiler, so type and layout errors of the compiled path only show here).

    python scripts/triton_aot_check.py [--arch 90] [--dtype bf16] [--all-configs] [--heads/--dim/--chunk N]

From the repository root, without TRITON_INTERPRET: the backends' host code runs on small CPU
tensors with every launch recorded (real dtypes and constexprs; production tiles by default: H = 16,
K = V = 128, C = 64, tree attention D = 128), each launch is compiled with `triton.compile` for
`cuda:<arch>` under its first autotune config (or all), and `ptxas -v` reads the PTX; one line per
kernel and config, exit 1 when a compilation fails (docs/design/numerics.md).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.gated_delta_rule import chunk_gated_delta_rule, chunk_triton, l2norm_triton  # noqa: E402
from kernels.tree_attention import prepare_tree_layout, tree_attention, triton_kernel  # noqa: E402

LAUNCHES: list[tuple[str, object, dict]] = []
TYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32"}


class _Recorder:
    """Stands in for a kernel: `[grid](**kwargs)` records the launch."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        return lambda **kwargs: LAUNCHES.append((self.name, self.kernel, kwargs))


def _record(module, prefix: str) -> None:
    for name in dir(module):
        obj = getattr(module, name)
        if name.startswith("_") and name.endswith("_kernel") and isinstance(obj, (JITFunction, Autotuner, Heuristics)):
            setattr(module, name, _Recorder(f"{prefix}.{name}", obj))


def record_launches(dtype: torch.dtype, *, H: int = 16, K: int = 128, C: int = 64) -> None:
    """Run the GDN and tree-attention backends (forward and backward) with launches recorded
    (GDN: H heads, K = V, chunk C; tree attention: head dim K)."""
    _record(chunk_triton, "gdn")
    _record(l2norm_triton, "gdn")
    _record(triton_kernel, "tree")
    T, N = 200, 2
    x = [torch.randn(T, H, K, dtype=dtype, requires_grad=True) for _ in range(3)]
    g = torch.zeros(T, H, requires_grad=True)
    beta = torch.zeros(T, H, requires_grad=True)
    h0 = torch.zeros(N, H, K, K, requires_grad=True)
    o, s = chunk_gated_delta_rule(
        *x, g, beta, cu_seqlens=torch.tensor([0, 130, T]), initial_state=h0, export_seq=torch.tensor([0, 1]),
        export_pos=torch.tensor([128, 70]), chunk_size=C, use_qk_l2norm=True, backend="triton",
    )
    torch.autograd.grad([o, s], [*x, g, beta, h0], [torch.zeros_like(o), torch.zeros_like(s)])
    layout = prepare_tree_layout(torch.tensor([0, 100]), torch.tensor([100, 50]), torch.tensor([0, 0, 1]),
                                 torch.tensor([[0, 60]]), num_rows=150, num_kv_rows=180)
    q = torch.randn(150, 16, K, dtype=dtype, requires_grad=True)
    kv = [torch.randn(180, 2, K, dtype=dtype, requires_grad=True) for _ in range(2)]
    o = tree_attention(q, *kv, layout, scale=K**-0.5, backend="triton")
    torch.autograd.grad(o, [q, *kv], torch.zeros_like(o))


def _unwrap(kernel):
    heuristics, configs = {}, [triton.Config({}, num_warps=4, num_stages=3)]
    while not isinstance(kernel, JITFunction):
        if isinstance(kernel, Heuristics):
            heuristics.update(kernel.values)
        if isinstance(kernel, Autotuner):
            configs = kernel.configs
        kernel = kernel.fn
    return kernel, heuristics, configs


def _ptxas_usage(ptx: str, arch: int) -> str:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([str(ptxas), f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}", "-v", "-o", os.devnull, f.name],
                             capture_output=True, text=True, timeout=300)
    finally:
        os.unlink(f.name)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (f"regs={regs.group(1) if regs else '?'} spill_stores={spills.group(1) if spills else '?'} "
            f"spill_loads={spills.group(2) if spills else '?'}")


def compile_launch(name: str, kernel, kwargs: dict, arch: int, all_configs: bool) -> bool:
    fn, heuristics, configs = _unwrap(kernel)
    ok = True
    for cfg in configs if all_configs else configs[:1]:
        args = {**kwargs, **cfg.kwargs}
        for key, rule in heuristics.items():
            args[key] = rule(args)
        sig, const = {}, {}
        for p in fn.params:
            v = args[p.name]
            if p.is_constexpr or v is None:
                sig[p.name], const[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[p.name] = "*" + TYPES[v.dtype]
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            elif isinstance(v, int):
                sig[p.name] = "i32"
            else:
                sig[p.name] = "fp32"
        label = f"{name} {','.join(f'{k}={v}' for k, v in cfg.kwargs.items())} warps={cfg.num_warps} stages={cfg.num_stages}"
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            usage = _ptxas_usage(compiled.asm["ptx"], arch)
            print(f"ok   {label}: {usage} shared={compiled.metadata.shared} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as exc:
            ok = False
            print(f"FAIL {label}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--all-configs", action="store_true", help="every autotune candidate, not only the first")
    ap.add_argument("--only", default="", help="compile only kernels whose name contains this")
    ap.add_argument("--heads", type=int, default=16, help="GDN heads")
    ap.add_argument("--dim", type=int, default=128, help="GDN K = V and the tree attention head dim")
    ap.add_argument("--chunk", type=int, default=64, choices=[16, 32, 64])
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("run without TRITON_INTERPRET (this compiles for a GPU)")
    record_launches(torch.bfloat16 if a.dtype == "bf16" else torch.float32, H=a.heads, K=a.dim, C=a.chunk)
    seen, ok = set(), True
    for name, kernel, kwargs in LAUNCHES:
        if name in seen or a.only not in name:
            continue
        seen.add(name)
        ok &= compile_launch(name, kernel, kwargs, a.arch, a.all_configs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
