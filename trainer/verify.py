"""Compare two executions of the same step (tree vs trajectory-expanded) for Invariant E.

    got, got_grads = run_and_capture(executor, plan)          # log-probs, linear outputs, gradients captured
    report = compare_runs(ref, ref_grads, got, got_grads)     # log-prob, loss, gradient, ... differences
    f64 = f64_reference_report(ref64, ref64_grads, {"tree": (got, got_grads), "expanded": (ref, ref_grads)})

Gradient differences are relative per parameter with a floor of GRAD_FLOOR (1%) of the largest
gradient; why the floor and why a float64 oracle: docs/design/numerics.md ("How exactness is
measured").
"""
from __future__ import annotations

import numpy as np
import torch

from trainer.executor import Executor, StepResult

GRAD_FLOOR = 1e-2


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of every parameter gradient (zeros where none)."""
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def run_and_capture(executor: Executor, plan, *, backward: bool = True) -> tuple[StepResult, dict[str, torch.Tensor]]:
    """One step without an optimizer; returns the result and the accumulated gradients."""
    res = executor.run_step(plan, backward=backward)
    return res, grads_of(executor.model) if backward else {}


def _max_abs_rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[float, float, int]:
    mx_abs = mx_rel = 0.0
    n = 0
    for k, x in a.items():
        y = b[k]
        if x.shape != y.shape or not np.array_equal(np.isnan(x), np.isnan(y)):
            return float("inf"), float("inf"), n
        ok = ~np.isnan(x)
        if ok.any():
            d = np.abs(x[ok] - y[ok])
            mx_abs = max(mx_abs, float(d.max()))
            mx_rel = max(mx_rel, float((d / np.maximum(np.abs(x[ok]), 1e-30)).max()))
            n += int(ok.sum())
    return mx_abs, mx_rel, n


def grad_rel_errors(ref_grads: dict[str, torch.Tensor], got_grads: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict[str, float], float]:
    """Per-parameter relative gradient error of `got_grads` against `ref_grads`.

    Returns (floored, raw, top): floored[name] = max|g_got - g_ref| / max(max|g_ref|, floor) with
    floor = GRAD_FLOOR x top, top the largest |g_ref| over all parameters; raw[name] divides by
    max|g_ref| alone. Differences are taken in the wider of the two dtypes (a float64 reference
    sees an fp32 gradient exactly).
    """
    top = max((float(g.abs().max()) for g in ref_grads.values()), default=0.0)
    floor = max(GRAD_FLOOR * top, 1e-30)
    floored, raw = {}, {}
    for name, ga in ref_grads.items():
        d = float((ga - got_grads[name]).abs().max())
        scale = float(ga.abs().max())
        floored[name] = d / max(scale, floor)
        raw[name] = d / max(scale, 1e-30)
    return floored, raw, top


def f64_reference_report(ref64: StepResult, ref64_grads: dict[str, torch.Tensor],
                         runs: dict[str, tuple[StepResult, dict[str, torch.Tensor]]]) -> dict:
    """Errors of each fp32 run (name -> (result, gradients)) against a float64 run of the same step.

    Keys per run NAME: grad_rel_err_NAME (max over parameters of `grad_rel_errors`' floored value),
    worst_param_NAME, logprob_max_abs_err_NAME (NaN patterns must match, else inf), loss_err_NAME.
    With runs "tree" and "expanded": diff_param (where the two fp32 runs differ most, by the same
    measure against the expanded run) with diff_param_err_tree / diff_param_err_expanded (each
    run's error against float64 there), and at_worst_params: for each of worst_param_tree,
    worst_param_expanded and diff_param, both runs' errors and their difference. JSON-serialisable.
    """
    out: dict = {}
    per_run: dict[str, dict[str, float]] = {}
    for name, (res, grads) in runs.items():
        per, _, _ = grad_rel_errors(ref64_grads, grads)
        per_run[name] = per
        worst = max(per, key=per.get) if per else ""
        out[f"grad_rel_err_{name}"] = per[worst] if per else 0.0
        out[f"worst_param_{name}"] = worst
        if ref64.logprobs is not None and res.logprobs is not None:
            out[f"logprob_max_abs_err_{name}"] = _max_abs_rel(ref64.logprobs, res.logprobs)[0]
        out[f"loss_err_{name}"] = abs(res.loss - ref64.loss)
    if {"tree", "expanded"} <= runs.keys() and per_run["tree"]:
        diff, _, _ = grad_rel_errors(runs["expanded"][1], runs["tree"][1])
        name = max(diff, key=diff.get)
        out["diff_param"] = name
        out["diff_param_rel_diff"] = diff[name]
        out["diff_param_err_tree"] = per_run["tree"][name]
        out["diff_param_err_expanded"] = per_run["expanded"][name]
        out["at_worst_params"] = {
            n: {"tree": per_run["tree"][n], "expanded": per_run["expanded"][n], "tree_vs_expanded": diff[n]}
            for n in dict.fromkeys((out["worst_param_tree"], out["worst_param_expanded"], name))
        }
    return out


def compare_runs(ref: StepResult, ref_grads: dict, got: StepResult, got_grads: dict) -> dict:
    """Differences of `got` against `ref` (the expanded run). JSON-serialisable."""
    out: dict = {}
    if ref.logprobs is not None and got.logprobs is not None:
        out["logprob_max_abs_diff"], out["logprob_max_rel_diff"], out["logprob_positions"] = _max_abs_rel(ref.logprobs, got.logprobs)
    out["loss_ref"], out["loss"] = ref.loss, got.loss
    out["loss_diff"] = abs(ref.loss - got.loss)
    if ref_grads and got_grads:
        per, raw, top = grad_rel_errors(ref_grads, got_grads)
        out["grad_rel_diff"] = per
        out["grad_rel_diff_max"] = max(per.values()) if per else 0.0
        out["grad_rel_diff_raw_max"] = max(raw.values()) if raw else 0.0
        out["grad_max_abs"] = top
    if ref.linear_outputs is not None and got.linear_outputs is not None:
        equal, mx, layers = True, 0.0, set()
        for traj, by_layer in ref.linear_outputs.items():
            for layer, x in by_layer.items():
                layers.add(layer)
                y = got.linear_outputs[traj].get(layer)
                if y is None or x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
                    equal = False
                    if y is not None and x.shape == y.shape:
                        ok = ~np.isnan(x)
                        if ok.any():
                            mx = max(mx, float(np.abs(x[ok] - y[ok]).max()))
        out["linear_outputs_bitwise_equal"] = equal
        out["linear_outputs_max_abs_diff"] = mx
        out["linear_layers_compared"] = sorted(layers)
    out["expert_load_equal"] = bool(np.array_equal(ref.expert_load, got.expert_load))
    out["expert_load_total"] = int(ref.expert_load.sum())
    out["computed_tokens_ref"], out["computed_tokens"] = ref.computed_tokens, got.computed_tokens
    out["expanded_tokens"] = got.expanded_tokens
    return out
