"""Sections env and throughput: the device and its matmul rate, then windows vs expanded update throughput.

    env_section(ctx, sec)          # versions, numerics flags, parameter count, the n^3 torch.mm rate (MFU denominator)
    throughput_section(ctx, sec)   # per workload: windows plan vs a subset's expanded plan, as training steps

Per plan: expanded tokens/s (fastest timed step after warm-ups), model FLOPs (3 x `trainer.flops`),
TFLOP/s, MFU, peak memory; per workload windows / expanded against the FLOP ideal; then each
windows plan again with the elementwise chains compiled (`executor.compile`) against the eager one
(benchmarks/README.md, "The trainer on a GPU").
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
import time
from dataclasses import asdict

import torch

from benchmarks.gpu.context import BenchContext, config_dict, plan_summary
from benchmarks.gpu.runner import Section
from harts_client.timing import repeat
from trainer.executor import Executor, train_step
from trainer.optim import make_optimizer

#: distributions whose versions the env section records
PACKAGES = ("torch", "triton", "transformers", "numpy", "numba", "protobuf", "fla-core", "flash-linear-attention",
            "flash-attn", "safetensors")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def env_section(ctx: BenchContext, sec: Section) -> None:
    d = sec.data
    d["settings"] = asdict(ctx.s)
    d["python"] = sys.version.split()[0]
    d["versions"] = {p: _version(p) for p in PACKAGES}
    d["cuda_runtime"] = torch.version.cuda
    d["fla_importable"] = importlib.util.find_spec("fla") is not None
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        d["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}", "memory_bytes": p.total_memory,
                       "multiprocessors": p.multi_processor_count, "count": torch.cuda.device_count()}
    else:
        d["device"] = {"name": f"cpu ({platform.machine()})", "threads": torch.get_num_threads()}
    d["flags"] = {
        **{k: os.environ.get(k) for k in ("HARTS_AUTOTUNE", "CUBLAS_WORKSPACE_CONFIG", "TRITON_CACHE_DIR", "NUMBA_CACHE_DIR")},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    d["model"] = {"name": ctx.s.model, "parameters": ctx.num_parameters, "config": ctx.model_config.to_hf_dict()}
    sec.save()
    n = ctx.s.matmul_size
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(ctx.device, ctx.dtype)
    b = torch.randn(n, n, generator=gen).to(ctx.device, ctx.dtype)
    median = repeat(lambda: torch.mm(a, b), 10, warmup=3, sync=ctx.sync).median("wall")
    d["matmul"] = {"n": n, "dtype": ctx.s.dtype, "seconds_median": median, "tflops": 2.0 * n**3 / median / 1e12}


def throughput_section(ctx: BenchContext, sec: Section) -> None:
    s = ctx.s
    peak = (ctx.results.get("env") or {}).get("matmul", {}).get("tflops")
    if not peak:
        sec.note("no matmul rate from the env section: MFU left out")
    model = ctx.model(ctx.dtype, trains=True)
    cfg = ctx.executor_config()
    sec.data.update(model_build_seconds=ctx.build_seconds, executor=config_dict(cfg), rows=[])
    ex = Executor(model, cfg)
    opt = make_optimizer(model.parameters(), lr=s.lr)
    step = lambda plan: train_step(ex, plan, opt)  # noqa: E731
    for w in s.workloads:
        b = ctx.batch(w.name)
        row = {"workload": w.name, "command": w.command(ctx.model_config.vocab_size),
               "trajectories": b.forest.num_trajectories, "expanded_tokens": int(b.forest.expanded_tokens),
               "unique_tokens": int(b.forest.unique_tokens)}
        sec.data["rows"].append(row)
        windows = ctx.plan(w.name, "windows")
        expanded = ctx.plan(w.name, "expanded", tokens=s.baseline_tokens)
        row["flop_ideal"] = ctx.flops(ctx.plan(w.name, "expanded")) / ctx.flops(windows)
        sec.save()
        for mode, plan in (("windows", windows), ("expanded", expanded)):
            row[mode] = timed_steps(ctx, step, plan, peak)
            sec.save()
        row["windows_vs_expanded"] = row["windows"]["tokens_per_s"] / row["expanded"]["tokens_per_s"]
        row["fraction_of_ideal"] = row["windows_vs_expanded"] / row["flop_ideal"]
    if s.compiled:  # after every row is saved: a timeout here loses only this comparison
        compiled = Executor(model, ctx.executor_config(compile=True))
        step = lambda plan: train_step(compiled, plan, opt)  # noqa: E731
        for row in sec.data["rows"]:
            row["windows_compiled"] = timed_steps(ctx, step, ctx.plan(row["workload"], "windows"), peak)
            row["compiled_speedup"] = row["windows_compiled"]["tokens_per_s"] / row["windows"]["tokens_per_s"]
            sec.save()


def timed_steps(ctx: BenchContext, step, plan, peak_tflops: float | None) -> dict:
    """Warm-up and timed `step(plan)` calls; the plan's rates, FLOPs, MFU and memory."""
    s = ctx.s
    out = plan_summary(plan)
    flops = ctx.flops(plan)
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(s.warmup_steps):
        step(plan)
    ctx.sync()
    out["warmup_seconds"] = time.perf_counter() - t0
    ctx.reset_peak_memory()
    before = ctx.memory()["allocated_bytes"]
    runs = repeat(lambda: step(plan), s.timed_steps, sync=ctx.sync)
    wall = runs.fastest("wall").wall
    res = runs.result
    tflops = flops / wall / 1e12
    out.update(seconds=wall, seconds_median=runs.median("wall"), tokens_per_s=out["expanded_tokens"] / wall,
               model_flops=flops, tflops=tflops, mfu=tflops / peak_tflops if peak_tflops else None,
               computed_tokens=res.computed_tokens, allocated_before_bytes=before,
               peak_allocated_bytes=ctx.memory()["peak_allocated_bytes"])
    return out
