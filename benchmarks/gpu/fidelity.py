"""Section fidelity: the same tokens' log-probs from different plans, and the same plan run twice.

Per model dtype, executor mode and workload, on a seeded subset of the batch, forward only
(`Executor.run_step(plan, backward=False)` with per-trajectory log-probs, what `harts logprobs`
runs), four runs on the same seeded weights:

- expanded: the subset's trajectory-expanded plan (`PlanConfig(sharing=False)`, B);
- rerun: the same plan again (is the executor deterministic?);
- tree: the subset's windows (tree) plan;
- repacked: the expanded plan made at B / 2 (the same trajectories in other microbatches, at
  other row offsets: is the forward batch-invariant?).

Each of the last three against expanded: max and mean absolute log-prob difference over every
log-prob entry, whether they are bitwise equal, and whether the expert loads are equal.

Executor modes: "default" (ExecutorConfig as it is), then each of `deterministic` and
`batch_invariant` set to True where ExecutorConfig has that field (probed on the dataclass, so
the section runs before and after the executor grows them; a missing field is a note). The
global `torch.use_deterministic_algorithms` state is restored after every run, whatever a mode set
(deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG before CUDA starts: `bench_gpu` sets it).
Order (so that a spent budget keeps the most telling runs): every dtype in the default mode, then
the other modes.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from benchmarks.gpu.context import DTYPES, BenchContext, config_dict, plan_summary
from benchmarks.gpu.runner import Section
from trainer.executor import Executor, ExecutorConfig

#: the optional ExecutorConfig switches this section runs when present
MODES = ("deterministic", "batch_invariant")


def executor_modes() -> tuple[list[tuple[str, dict]], list[str]]:
    """([(mode name, ExecutorConfig overrides)], the modes ExecutorConfig lacks)."""
    have = {f.name for f in dataclasses.fields(ExecutorConfig)}
    return [("default", {})] + [(m, {m: True}) for m in MODES if m in have], [m for m in MODES if m not in have]


def logprob_diff(ref, got) -> dict:
    """Log-prob differences of StepResult `got` against `ref` (same trajectories and entries)."""
    a = np.concatenate([ref.logprobs[t] for t in sorted(ref.logprobs)])
    b = np.concatenate([got.logprobs[t] for t in sorted(ref.logprobs)])
    same_entries = bool(np.array_equal(np.isnan(a), np.isnan(b)))
    ok = ~np.isnan(a) & ~np.isnan(b)
    d = np.abs(a[ok] - b[ok])
    return {"positions": int(ok.sum()), "same_entries": same_entries,
            "max_abs": float(d.max()) if d.size else 0.0, "mean_abs": float(d.mean()) if d.size else 0.0,
            "bitwise_equal": same_entries and bool(np.array_equal(a[ok], b[ok])),
            "expert_load_equal": bool(np.array_equal(ref.expert_load, got.expert_load))}


def fidelity_section(ctx: BenchContext, sec: Section) -> None:
    s = ctx.s
    modes, missing = executor_modes()
    for m in missing:
        sec.note(f"ExecutorConfig has no field {m!r}: that mode is not run")
    sec.data.update(modes=[m for m, _ in modes], runs=[])
    order = [(dt, modes[0]) for dt in s.fidelity_dtypes] + [(dt, m) for dt in s.fidelity_dtypes for m in modes[1:]]
    for dtype, (mode, overrides) in order:
        model = ctx.model(DTYPES[dtype])
        for w in s.fidelity_workloads:
            plans = {"expanded": ctx.plan(w, "expanded", tokens=s.fidelity_tokens),
                     "tree": ctx.plan(w, "windows", tokens=s.fidelity_tokens),
                     "repacked": ctx.plan(w, "expanded", tokens=s.fidelity_tokens, microbatch_tokens=s.microbatch_tokens // 2)}
            cell = {"dtype": dtype, "mode": mode, "workload": w, "plans": {k: plan_summary(p) for k, p in plans.items()}}
            sec.data["runs"].append(cell)
            deterministic = (torch.are_deterministic_algorithms_enabled(),
                             torch.is_deterministic_algorithms_warn_only_enabled())
            t0 = time.perf_counter()
            try:
                cfg = ctx.executor_config(want_logprobs=True, **overrides)
                cell["executor"] = config_dict(cfg)
                ex = Executor(model, cfg)
                runs = {name: ex.run_step(plans[kind], backward=False)
                        for name, kind in (("expanded", "expanded"), ("rerun", "expanded"), ("tree", "tree"),
                                           ("repacked", "repacked"))}
                cell["vs_expanded"] = {name: logprob_diff(runs["expanded"], runs[name]) for name in ("rerun", "tree", "repacked")}
            except Exception as exc:  # a mode that cannot run here is a finding, not the end of the section
                cell["error"] = f"{type(exc).__name__}: {exc}"
                sec.note(f"{dtype} {mode} {w}: {cell['error']}")
            finally:
                torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
                cell["seconds"] = time.perf_counter() - t0
                sec.save()
