"""Section peer: transformers' Qwen3NextForCausalLM on the same weights and trajectories, and our rate against it.

    peer_section(ctx, sec)     # variants forward, fla, fla_guard_lifted, torch_gdn, each guarded

The peer (`benchmarks.peer.TransformersPeer.on_device`) runs a seeded subset of the peer
workload's trajectories one at a time; the variants, the gradient check with fla's Hopper refusal
lifted and the ratios: benchmarks/README.md ("The trainer on a GPU", "How the sections run").
"""
from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

import benchmarks.peer as hf_peer
from benchmarks.gpu.context import BenchContext
from benchmarks.gpu.runner import Section
from trainer.executor import Executor
from trainer.verify import grad_rel_errors


def _rate(ctx: BenchContext, sec: Section, run, tokens: int) -> dict:
    """Warm-up call run(first=True), then timed run(first=False) passes while the budget allows."""
    t0 = time.perf_counter()
    run(True)
    out = {"warmup_seconds": time.perf_counter() - t0, "tokens": tokens, "passes": []}
    for _ in range(ctx.s.timed_steps):
        if out["passes"] and sec.left() < 2 * min(out["passes"]):
            break
        t0 = time.perf_counter()
        run(False)
        out["passes"].append(time.perf_counter() - t0)
    out["seconds"] = min(out["passes"])
    out["tokens_per_s"] = tokens / out["seconds"]
    return out


def _lin_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters()
            if "linear_attn" in n and p.grad is not None}


def _grad_check(peer, trajs, masks) -> dict:
    """fla (guard lifted) against transformers' PyTorch gated delta rule: gradients of one short trajectory."""
    i = int(np.argmin([len(t) for t in trajs]))
    grads = {}
    for name, impl in (("torch", hf_peer.torch_gated_delta_rule), ("fla", hf_peer.fla_hopper_guard_lifted)):
        peer.model.zero_grad(set_to_none=True)
        with impl():
            peer.backward(trajs[i], masks[i], n_loss=max(sum(masks[i][1:]), 1))
        grads[name] = _lin_grads(peer.model)
    peer.model.zero_grad(set_to_none=True)
    per, _, top = grad_rel_errors(grads["torch"], grads["fla"])
    worst = max(per, key=per.get)
    return {"trajectory_tokens": len(trajs[i]), "parameters": len(per), "grad_rel_err_max": per[worst],
            "worst_parameter": worst, "grad_max_abs": top}


def _agreement(ctx: BenchContext, peer_lp: list[torch.Tensor], doc: dict) -> dict:
    """Our executor's log-probs of the same trajectories (expanded plan, forward only) against the peer's."""
    s = ctx.s
    plan = ctx.plan(s.peer_workload, "expanded", tokens=s.peer_tokens)
    res = Executor(ctx.model(ctx.dtype), ctx.executor_config(want_logprobs=True)).run_step(plan, backward=False)
    diffs = []
    for t, lp in zip(doc["trajectories"], peer_lp):
        ours = res.logprobs[t["id"]]
        ok = ~np.isnan(ours)
        diffs.append(np.abs(ours[ok] - lp.double().cpu().numpy()[ok]))
    d = np.concatenate(diffs)
    return {"positions": int(d.size), "max_abs": float(d.max()), "mean_abs": float(d.mean())}


def peer_section(ctx: BenchContext, sec: Section) -> None:
    s = ctx.s
    d = sec.data
    doc, _ = ctx.subset(s.peer_workload, s.peer_tokens)
    trajs = [t["tokens"] for t in doc["trajectories"]]
    masks = [t.get("loss_mask", [1] * len(t["tokens"])) for t in doc["trajectories"]]
    tokens = sum(len(t) for t in trajs)
    d.update(workload=s.peer_workload, trajectories=len(trajs), tokens=tokens, variants={})
    ctx.release_models()  # the peak memory below is the peer's alone
    t0 = time.perf_counter()
    peer = hf_peer.TransformersPeer.on_device(ctx.model_config, ctx.reference_state(), device=ctx.device, dtype=ctx.dtype, lr=s.lr)
    d["build_seconds"] = time.perf_counter() - t0
    d["bound"] = hf_peer.gated_delta_rule_bound()
    if d["bound"] != "fla":
        sec.note("transformers bound its PyTorch gated delta rule (fla not importable" +
                 (", hidden on the CPU)" if not ctx.cuda else ")"))
    sec.save()

    def train(first: bool) -> None:
        peer.train_step(trajs[:1] if first else trajs, masks[:1] if first else masks, gauge=False)

    def guarded(name: str, run, wrap=None) -> bool:
        try:
            ctx.reset_peak_memory()
            before = ctx.memory()["allocated_bytes"]
            with wrap() if wrap is not None else contextlib.nullcontext():
                d["variants"][name] = _rate(ctx, sec, run, tokens)
            d["variants"][name].update(allocated_before_bytes=before, peak_allocated_bytes=ctx.memory()["peak_allocated_bytes"])
            return True
        except Exception as exc:  # fla's refusal, a compile error, an OOM: the next variant still runs
            d["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            sec.note(f"{name}: {d['variants'][name]['error'][:200]}")
            return False
        finally:
            peer.model.zero_grad(set_to_none=True)
            sec.save()

    lps: list = []

    def forward(first: bool) -> None:
        lps[:] = peer.logprobs(trajs[:1] if first else trajs)[2]

    if guarded("forward", forward) and lps:  # first: the training variants move the peer's weights
        d["agreement"] = _agreement(ctx, lps, doc)
        ctx.release_models()
        sec.save()
    if d["bound"] == "fla" and not guarded("fla", train):
        if "640" in d["variants"]["fla"]["error"] or "chunk_bwd_dqkwg" in d["variants"]["fla"]["error"]:
            if guarded("fla_guard_lifted", train, hf_peer.fla_hopper_guard_lifted):
                d["grad_check"] = _grad_check(peer, trajs, masks)
                sec.save()
    guarded("torch_gdn", train, hf_peer.torch_gated_delta_rule if d["bound"] == "fla" else None)
    ours = next((r for r in (ctx.results.get("throughput") or {}).get("rows", []) if r["workload"] == s.peer_workload), {})
    d["ratios"] = {f"{mode}_vs_{name}": ours[mode]["tokens_per_s"] / v["tokens_per_s"]
                   for mode in ("windows", "expanded") if "tokens_per_s" in ours.get(mode, {})
                   for name, v in d["variants"].items() if name != "forward" and "tokens_per_s" in v}
    if not d["ratios"]:
        sec.note("no ratios: the throughput section has no rate of this workload, or no peer variant ran")
