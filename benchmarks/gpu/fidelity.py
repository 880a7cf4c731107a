"""Section fidelity: the same tokens' log-probs from different plans, and the same plan run twice.

    fidelity_section(ctx, sec)   # per dtype, executor mode and workload: expanded, rerun, tree, repacked

Forward only on a seeded subset, four runs on the same weights; rerun, tree and repacked each
against expanded (max and mean absolute log-prob difference, bitwise equality, equal expert
loads), in the default mode and with `deterministic` / `batch_invariant` where `ExecutorConfig`
has them (`executor_modes`): benchmarks/README.md ("The trainer on a GPU").
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
