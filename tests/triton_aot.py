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
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction, create_function_from_signature

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
    kernel's first autotune config), heuristics applied, with the specialisation a real launch
    gets (the JIT's own binder: 16-byte aligned pointers, integers divisible by 16 or equal to 1);
    the compiled kernel (`.asm["ttgir"]`, `.asm["ptx"]`, ...)."""
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
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(**{p.name: args[p.name] for p in fn.params},
                                            num_warps=config.num_warps, num_stages=config.num_stages)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(num_warps=config.num_warps,
                                                                        num_stages=config.num_stages),
                                                          bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


_MMA_TRANS = re.compile(r"tt\.trans .*: tensor<[^>]*#mma\d*>")


def mma_transposes(ttgir: str) -> list[str]:
    """TTGIR lines that transpose a tensor in an MMA (accumulator) layout: `tl.trans` of a dot
    result, the operand fla #640's miscompile needs."""
    return [line.strip() for line in ttgir.splitlines() if _MMA_TRANS.search(line)]
