"""Compile Triton kernels for a CUDA target on a machine without a GPU and read their IR (tests).

The interpreter runs a kernel's Python, not Triton's compiler; the layouts the compiler assigns
(which `tl.dot` becomes a wgmma, which tensor lives in its accumulator layout) only show in the
compiled IR. `record` runs a backend's host code with every launch of the named kernels captured
instead of executed (their real argument dtypes and constexprs), `compile_launch` compiles one
captured launch for `cuda:<arch>` (ptxas ships with Triton), `mma_transposes` finds the pattern of
fla issue #640 in the TTGIR. scripts/triton_aot_check.py does the same for register and spill counts.
"""
from __future__ import annotations

import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

_TYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.int64: "i64", torch.int32: "i32"}


def record(monkeypatch, *modules) -> list[tuple[str, object, dict]]:
    """Replace every `_*_kernel` Triton kernel in `modules` by a recorder for the test's duration;
    returns the list the launches [(name, kernel, kwargs)] are appended to."""
    launches: list[tuple[str, object, dict]] = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            return lambda **kwargs: launches.append((self.name, self.kernel, kwargs))

    for module in modules:
        for name in dir(module):
            obj = getattr(module, name)
            if name.startswith("_") and name.endswith("_kernel") and isinstance(obj, (JITFunction, Autotuner, Heuristics)):
                monkeypatch.setattr(module, name, Recorder(name, obj))
    return launches


def compile_launch(kernel, kwargs: dict, *, arch: int = 90, config: triton.Config | None = None):
    """`triton.compile` of one recorded launch for cuda:<arch> under `config` (default: the
    kernel's first autotune config), heuristics applied; the compiled kernel (`.asm["ttgir"]`, ...)."""
    heuristics, configs = {}, [triton.Config({}, num_warps=4, num_stages=3)]
    fn = kernel
    while not isinstance(fn, JITFunction):
        if isinstance(fn, Heuristics):
            heuristics.update(fn.values)
        if isinstance(fn, Autotuner):
            configs = fn.configs
        fn = fn.fn
    config = config or configs[0]
    args = {**kwargs, **config.kwargs}
    for key, rule in heuristics.items():
        args[key] = rule(args)
    sig, const = {}, {}
    for p in fn.params:
        v = args[p.name]
        if p.is_constexpr or v is None:
            sig[p.name], const[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32"
        else:
            sig[p.name] = "fp32"
    return triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


_MMA_TRANS = re.compile(r"tt\.trans .*: tensor<[^>]*#mma\d*>")


def mma_transposes(ttgir: str) -> list[str]:
    """TTGIR lines that transpose a tensor in an MMA (accumulator) layout: `tl.trans` of a dot
    result, the operand fla #640's miscompile needs."""
    return [line.strip() for line in ttgir.splitlines() if _MMA_TRANS.search(line)]
