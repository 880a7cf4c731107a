"""Count what one microbatch costs the host: aten ops, GEMM launches and host reads (CPU, no GPU needed).

Run: `.venv/bin/python -m benchmarks.op_count [--experts 16 --top-k 4 --rows 512] [--path gpu [--triton]
[--chains]]` (one JSON object on stdout): a small hybrid MoE runs one microbatch forward + backward
through the executor under a `TorchDispatchMode` counting `aten_ops`, `view_ops`, `gemm_ops`,
`host_reads` and `launches` (what a GPU would launch); `--triton` runs the Triton kernels under the
interpreter and counts their launches too; `--chains` counts the elementwise chains' launches, eager
against compiled (`chain_launches`). A count that grows with the number of layers or experts is a
host-bound design (benchmarks/README.md, "Smaller benchmarks").
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harts_client.synthetic import generate
from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step
from plan.microbatch import decode_microbatch
from trainer.executor import Executor, ExecutorConfig, normalizers_from_header
from trainer.layout import layout_from_arrays
from trainer.models.config import FULL, LINEAR, ModelConfig
from trainer.models.materialize import materialize, meta_model, seed_rows
from trainer.models.ops import CHAINS, FAST, compiled_ops

GEMMS = {"mm", "addmm", "bmm", "_grouped_mm", "grouped_mm", "baddbmm"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while active, and remembers the tensors they made (what a GPU run
    would hold on the device)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.views = 0
        self.made: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        self.ops[name] += 1
        if any(r.alias_info is not None for r in func._schema.returns):
            self.views += 1
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = weakref.ref(t)
        return out

    @property
    def launches(self) -> int:
        """Ops a GPU would launch a kernel for: neither views nor allocations."""
        return sum(n for name, n in self.ops.items() if not name.startswith("empty")) - self.views

    def has_made(self, t: torch.Tensor) -> bool:
        ref = self.made.get(id(t))
        return ref is not None and ref() is t


class HostReads:
    """Counts `tolist()` / `numpy()` calls while active (patched on torch.Tensor) on tensors an aten
    op made (`OpCounter.made`): reads of computed values, a host synchronisation on a GPU; the
    plan's index tensors (made from numpy arrays on the host) are not counted."""

    def __init__(self, ops: "OpCounter"):
        self.ops = ops
        self.count = 0

    def __enter__(self):
        self._orig = torch.Tensor.tolist, torch.Tensor.numpy
        counter = self

        def tolist(t, *a, **k):
            counter.count += counter.ops.has_made(t)
            return counter._orig[0](t, *a, **k)

        def numpy(t, *a, **k):
            counter.count += counter.ops.has_made(t)
            return counter._orig[1](t, *a, **k)

        torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._orig


class ChainCalls:
    """Wraps FAST's elementwise chains: how often each runs, and the arguments of its first call."""

    def __init__(self):
        self.calls: Counter[str] = Counter()
        self.first: dict[str, tuple[tuple, dict]] = {}

    def ops(self):
        def spy(name, fn):
            def call(*args, **kwargs):
                self.calls[name] += 1
                self.first.setdefault(name, (args, kwargs))
                return fn(*args, **kwargs)
            return call
        return dataclasses.replace(FAST, **{name: spy(name, getattr(FAST, name)) for name in CHAINS})


class TritonLaunches:
    """Counts Triton kernel launches while active (under `TRITON_INTERPRET=1`: every launch goes
    through `InterpretedFunction.run`); the interpreter's own tensor work inside a launch is hidden
    from the op counter (on a GPU a launch is one kernel)."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        from torch.utils._python_dispatch import _disable_current_modes
        from triton.runtime.interpreter import InterpretedFunction

        self._cls, self._orig = InterpretedFunction, InterpretedFunction.run
        counter = self

        def run(fn, *args, grid, warmup, **kwargs):
            counter.count += not warmup
            with _disable_current_modes():
                return counter._orig(fn, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._orig


def _fresh(args: tuple) -> list:
    """New leaf tensors shaped like a call's arguments (gradients where the originals had them)."""
    return [torch.randn(a.shape, dtype=a.dtype).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
            for a in args]


def _forward_backward(fn, args: list, kwargs: dict) -> None:
    out = fn(*args, **kwargs)
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
    if outs:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _launches(code: str) -> int:
    """Kernel launches in the `call` of one generated Inductor wrapper: calls of the kernels it
    defines, and of torch's own (`extern_kernels.*`, and the ops it falls back to, `aten.*`)."""
    kernels = re.findall(r"^(\w+) = async_compile\.\w+\(", code, re.M)
    call = code[code.find("def call("):].split("\nrunner = ", 1)[0]
    launch = re.compile(r"^(?:[\w, ]+ = )?(?:(?:" + "|".join(map(re.escape, kernels)) + r")(?:\.run)?\("
                        r"|extern_kernels\.|(?:torch\.ops\.)?aten\.)" if kernels else
                        r"^(?:[\w, ]+ = )?(?:extern_kernels\.|(?:torch\.ops\.)?aten\.)")
    return sum(bool(launch.match(line.strip())) for line in call.splitlines())


def chain_launches(chains: ChainCalls) -> dict:
    """Per chain of one microbatch: its calls, the launches of one call run eagerly (forward +
    backward, `OpCounter.launches`), and the kernel launches of its compiled forward and backward
    (`executor.compile`; counted in the code Inductor generates here for the CPU, whose fusion
    decisions its GPU code shares: an estimate of the GPU's). Inductor's caches are off, so every
    graph's code is generated here."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    compiled = compiled_ops()
    out = {}
    for name in chains.calls:
        args, kwargs = chains.first[name]
        counter = OpCounter()
        fresh = _fresh(args)
        with counter:
            _forward_backward(getattr(FAST, name), fresh, kwargs)
        torch._dynamo.reset()
        fresh = _fresh(args)
        with inductor_config.patch(fx_graph_cache=False, compile_threads=1):
            _, codes = run_and_get_code(lambda: _forward_backward(getattr(compiled, name), fresh, kwargs))  # noqa: B023
        out[name] = {"calls": chains.calls[name], "eager_launches_per_call": counter.launches,
                     "compiled_launches_per_call": sum(_launches(c) for c in codes)}
    torch._dynamo.reset()
    return {"chains": out,
            "eager_launches": sum(c["calls"] * c["eager_launches_per_call"] for c in out.values()),
            "compiled_launches": sum(c["calls"] * c["compiled_launches_per_call"] for c in out.values())}


def tiny_microbatch(*, experts: int, top_k: int, rows: int, layers: int, seed: int = 0, **executor):
    """(model, executor, layout, normalisers) of one microbatch on the CPU: a small hybrid MoE (3 GDN
    layers to 1 attention layer), the first microbatch of a seeded tree-sampling batch planned at
    B = `rows`, C = 16; `executor`: further ExecutorConfig fields."""
    torch.manual_seed(seed)
    cfg = ModelConfig(num_experts=experts, num_experts_per_tok=top_k, num_hidden_layers=layers,
                      layer_types=([LINEAR] * 3 + [FULL]) * (layers // 4) + [LINEAR] * (layers % 4))
    model = materialize(meta_model(cfg), "cpu", seed_rows(cfg, seed=seed))
    doc = generate(scheme="tree", tasks=1, seed=seed, scale=0.01, turns=(4, 6), vocab_size=cfg.vocab_size)
    plan = plan_step(forest_from_json(doc), PlanConfig(chunk_size=16, microbatch_tokens=rows, all_positions=True))
    ex = Executor(model, ExecutorConfig(chunk_size=16, validate="none", **executor))
    a = decode_microbatch(plan.ranks[0].microbatches[0], plan.header.params)
    return model, ex, layout_from_arrays(a, chunk_size=16), normalizers_from_header(plan.header)


def count(*, experts: int, top_k: int, rows: int, layers: int, seed: int = 0, path: str = "cpu",
          chains: bool = False, triton: bool = False) -> dict:
    """The counts of one microbatch and one step (benchmarks/README.md, "Smaller benchmarks"). `path`: "cpu" (the CPU's
    primitives) or "gpu" (the GPU's: `trainer.models.ops.FAST`, grouped-GEMM experts through torch's
    CPU implementation, the chunked head), both run here on the CPU; `chains` (GPU path): also
    `chain_launches` of the microbatch; `triton` (GPU path, under `TRITON_INTERPRET=1`): the gated
    delta rule and tree attention through their Triton kernels, whose launches `triton_launches`
    counts, instead of the CPU's PyTorch forms."""
    if (chains or triton) and path != "gpu":
        raise ValueError("chains, triton: counted on the GPU path (path='gpu')")
    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("triton: needs TRITON_INTERPRET=1 in the environment before triton is imported")
    kernels = dict(backend="triton", attention_backend="triton") if triton else {}
    model, ex, layout, norm = tiny_microbatch(experts=experts, top_k=top_k, rows=rows, layers=layers, seed=seed,
                                              **kernels)
    spies = ChainCalls()
    if path == "gpu":
        ex.run_options.ops, ex.run_options.head = spies.ops(), "chunked"
    ex.forward(layout, None, norm, grad=True)[1].loss.backward()  # warm-up (kernel layouts built once)
    model.zero_grad(set_to_none=True)
    ops = OpCounter()
    reads = HostReads(ops)
    spies.calls.clear()
    launches = TritonLaunches() if triton else contextlib.nullcontext()
    with reads, ops, launches:
        out, mb_loss = ex.forward(layout, None, norm, grad=True)
        mb_loss.loss.backward()
    total = sum(ops.ops.values())
    extra = {"triton_launches": launches.count} if triton else {}
    if chains:
        extra["chain_launches"] = chain_launches(spies)
    return {
        "model": {"layers": layers, "experts": experts, "top_k": top_k, "hidden": model.config.hidden_size}, "path": path,
        "rows": layout.num_rows, "aten_ops": total, "view_ops": ops.views, "non_view_ops": total - ops.views,
        "launches": ops.launches + extra.get("triton_launches", 0),
        "gemm_ops": sum(v for k, v in ops.ops.items() if k in GEMMS),
        "host_reads": ops.ops.get("_local_scalar_dense", 0) + reads.count,
        "top_ops": dict(ops.ops.most_common(12)), **extra,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--rows", type=int, default=512, help="microbatch token budget B")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--path", choices=("cpu", "gpu"), default="cpu",
                    help="the primitives counted: the CPU's, or the GPU's run on the CPU (grouped GEMMs, chunked head)")
    ap.add_argument("--chains", action="store_true",
                    help="with --path gpu: the elementwise chains' launches, eager against compiled by Inductor")
    ap.add_argument("--triton", action="store_true",
                    help="with --path gpu: the gated delta rule and tree attention through their Triton kernels "
                         "(run under the Triton interpreter), their launches counted")
    args = ap.parse_args(argv)
    if (args.chains or args.triton) and args.path != "gpu":
        ap.error("--chains and --triton need --path gpu")
    if args.triton and os.environ.get("TRITON_INTERPRET") != "1":  # triton reads it at import: start again with it
        argv = sys.argv[1:] if argv is None else argv
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.op_count", *argv],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    torch.set_num_threads(1)
    json.dump(count(experts=args.experts, top_k=args.top_k, rows=args.rows, layers=args.layers, path=args.path,
                    chains=args.chains, triton=args.triton), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
