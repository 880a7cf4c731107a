"""Section profile: where one windows training step spends its time, from a `torch.profiler` trace.

    profile_section(ctx, sec)                          # one train_step of a subset under the profiler
    summary = summarize(trace_events(prof), microbatches=n)

Top CUDA kernels, the device's idle gaps between kernels, and counts per step and per microbatch
(kernels, memcpys, launches, aten ops, mm-family ops, host synchronisations by kind,
device-to-host copies): benchmarks/README.md ("The trainer on a GPU", "How the sections run").
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu.context import BenchContext, plan_summary
from benchmarks.gpu.runner import Section
from trainer.executor import Executor, train_step
from trainer.optim import make_optimizer

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaLaunchCooperativeKernel")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
MM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::_scaled_mm")
#: gap buckets in microseconds: [lo, hi)
GAP_BUCKETS = ((0, 10), (10, 100), (100, 1000), (1000, float("inf")))
TOP = 20


def trace_events(prof) -> list[tuple[str, bool, int, int]]:
    """(name, on the device, start ns, duration ns) of every event of a finished profile, user
    annotations left out (on the device they span kernels, they are none)."""
    cuda = torch.autograd.DeviceType.CUDA
    events = prof.profiler.kineto_results.events()
    annotation = [getattr(e, "is_user_annotation", bool)() for e in events]  # a torch without the method: none
    return [(e.name(), e.device_type() == cuda, e.start_ns(), e.duration_ns()) for e, a in zip(events, annotation) if not a]


def _gaps(device: list[tuple[str, int, int]]) -> dict:
    """Idle time between the device intervals (name, start ns, duration ns)."""
    device = sorted(device, key=lambda e: e[1])
    merged: list[list] = []  # [start, end, first name, last name]
    for name, start, dur in device:
        if merged and start <= merged[-1][1]:
            if start + dur > merged[-1][1]:
                merged[-1][1], merged[-1][3] = start + dur, name
        else:
            merged.append([start, start + dur, name, name])
    gaps = [((b[0] - a[1]) / 1e3, a[3], b[2]) for a, b in zip(merged, merged[1:])]
    span_us = (merged[-1][1] - merged[0][0]) / 1e3
    idle_us = sum(g for g, _, _ in gaps)
    buckets = []
    for lo, hi in GAP_BUCKETS:
        sel = [g for g, _, _ in gaps if lo <= g < hi]
        buckets.append({"from_us": lo, "to_us": hi, "count": len(sel), "total_ms": sum(sel) / 1e3})
    largest = sorted(gaps, reverse=True)[:5]
    return {"span_ms": span_us / 1e3, "busy_ms": (span_us - idle_us) / 1e3, "idle_ms": idle_us / 1e3,
            "idle_fraction": idle_us / span_us if span_us else 0.0, "gaps": len(gaps), "buckets": buckets,
            "largest": [{"us": g, "after": a[:120], "before": b[:120]} for g, a, b in largest]}


def summarize(events: list[tuple[str, bool, int, int]], *, microbatches: int) -> dict:
    """The profile section's tables and counts from `trace_events` (benchmarks/README.md, "The trainer on a GPU")."""
    host = Counter(name for name, on_device, _, _ in events if not on_device)
    device = [(name, start, dur) for name, on_device, start, dur in events if on_device]
    memcpy = [e for e in device if e[0].startswith("Memcpy")]
    memset = [e for e in device if e[0].startswith("Memset")]
    kernels = [e for e in device if not e[0].startswith(("Memcpy", "Memset"))]
    counts = {
        "kernels": len(kernels), "memcpys": len(memcpy), "memsets": len(memset),
        "kernel_launches": sum(host[n] for n in LAUNCHES),
        "aten_ops": sum(c for n, c in host.items() if n.startswith("aten::")),
        "mm_ops": sum(host[n] for n in MM_OPS),
        "host_syncs": sum(host[n] for n in SYNCS),
        "device_to_host_copies": sum("DtoH" in e[0] for e in memcpy),
    }
    out = {"counts": counts, "host_syncs_by_kind": {n: host[n] for n in SYNCS},
           "per_microbatch": {k: v / max(microbatches, 1) for k, v in counts.items()}}
    inclusive = defaultdict(int)
    for name, on_device, _, dur in events:
        if not on_device and name.startswith("aten::"):
            inclusive[name] += dur
    out["top_aten_ops"] = [{"name": n, "count": c, "inclusive_ms": inclusive[n] / 1e6}
                           for n, c in host.most_common() if n.startswith("aten::")][:TOP]
    if kernels:
        total = defaultdict(lambda: [0, 0])
        for name, _, dur in kernels:
            total[name][0] += 1
            total[name][1] += dur
        all_ns = sum(t for _, t in total.values())
        out["kernel_ms"] = all_ns / 1e6
        out["top_kernels"] = [{"name": n[:160], "calls": c, "total_ms": t / 1e6, "mean_us": t / c / 1e3, "share": t / all_ns}
                              for n, (c, t) in sorted(total.items(), key=lambda kv: -kv[1][1])[:TOP]]
        out["gaps"] = _gaps(device)
    return out


def profile_section(ctx: BenchContext, sec: Section) -> None:
    s = ctx.s
    plan = ctx.plan(s.workloads[0].name, "windows", tokens=s.profile_tokens)
    sec.data["workload"] = s.workloads[0].name
    sec.data["plan"] = plan_summary(plan)
    model = ctx.model(ctx.dtype, trains=True)
    ex = Executor(model, ctx.executor_config())
    opt = make_optimizer(model.parameters(), lr=s.lr)
    for key in ("warmup_seconds", "step_seconds"):
        ctx.sync()
        t0 = time.perf_counter()
        train_step(ex, plan, opt)
        ctx.sync()
        sec.data[key] = time.perf_counter() - t0
    sec.save()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        res = train_step(ex, plan, opt)
        ctx.sync()
    sec.data["profiled_step_seconds"] = time.perf_counter() - t0
    sec.data["microbatches"] = res.microbatches
    t0 = time.perf_counter()
    events = trace_events(prof)
    sec.data["trace_events"] = len(events)
    sec.data.update(summarize(events, microbatches=res.microbatches))
    sec.data["analysis_seconds"] = time.perf_counter() - t0
    if not ctx.cuda:
        sec.note("no CUDA: no kernels or device gaps; the counts and aten ops come from the CPU trace")
