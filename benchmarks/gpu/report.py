"""DIR/report.md from the section files: every table the run has, partial sections included.

    python -m benchmarks.bench_gpu --render DIR      # again, from the files alone

Written after every section, so a run cut short still leaves a readable report. Missing values
print as "-": a section that timed out shows the rows it finished.
"""
from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu.settings import SECTIONS


def load(out: Path) -> dict[str, dict]:
    """Section name -> its result document, for the files present."""
    docs = {}
    for name in SECTIONS:
        path = out / f"{name}.json"
        if path.is_file():
            docs[name] = json.loads(path.read_text())
    return docs


def _f(x, spec: str = ".3g") -> str:
    if x is None or x == "":
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, spec)
    return str(x)


def _gb(x) -> str:
    return "-" if x is None else f"{x / 2**30:.1f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out + [""]


def markdown(docs: dict[str, dict], command: str = "python -m benchmarks.bench_gpu --out DIR") -> str:
    env = docs.get("env", {}).get("data", {})
    settings = env.get("settings", {})
    device = env.get("device", {})
    out = ["# GPU benchmark (`benchmarks.bench_gpu`)", "",
           f"Command: `{command}`; settings `{settings.get('name', '?')}`; model `{settings.get('model', '?')}` "
           f"({_f(env.get('model', {}).get('parameters'), ',')} parameters), {settings.get('dtype', '?')}, "
           f"B = {settings.get('microbatch_tokens', '?')}, C = {settings.get('chunk_size', '?')}; "
           f"device {device.get('name', '?')}; " + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
           + ".", ""]
    out += _table(["section", "status", "seconds", "budget (s)", "notes"],
                  [[n, d["status"], _f(d["seconds"], ".0f"), _f(d["budget_s"], ".0f"), "; ".join(d["notes"])[:300]]
                   for n, d in docs.items()])
    m = env.get("matmul")
    if m:
        out += [f"Matmul ({m['n']}^3 {m['dtype']} torch.mm, median): {m['tflops']:.1f} TFLOP/s, the MFU denominator.", ""]
    out += _throughput(docs.get("throughput", {}).get("data", {}))
    out += _fidelity(docs.get("fidelity", {}).get("data", {}))
    out += _profile(docs.get("profile", {}).get("data", {}))
    out += _peer(docs.get("peer", {}).get("data", {}))
    k = docs.get("kernels", {}).get("data", {})
    if k:
        out += ["## Kernels", "", f"`{k.get('command', '')}`{' (fla hidden)' if k.get('fla_hidden') else ''}: exit code "
                f"{_f(k.get('returncode'))}, files {', '.join(k.get('files', [])) or 'none'} (under kernels/).", ""]
    return "\n".join(out)


def _throughput(d: dict) -> list[str]:
    if not d.get("rows"):
        return []
    out = ["## Update throughput (forward + backward + AdamW)", ""]
    rows = []
    for r in d["rows"]:
        for mode in ("windows", "expanded", "windows_compiled"):
            x = r.get(mode)
            if x is None:
                continue
            rows.append([r["workload"], mode.replace("_", ", "), _f(x.get("expanded_tokens"), ","), _f(x.get("microbatches")),
                         _f(x.get("windows")), _f(x.get("warmup_seconds"), ".2f"), _f(x.get("seconds"), ".3f"),
                         _f(x.get("tokens_per_s"), ",.0f"), _f(x.get("tflops"), ".1f"), _f(x.get("mfu"), ".1%"),
                         _gb(x.get("peak_allocated_bytes"))])
    out += _table(["workload", "plan", "expanded tokens", "microbatches", "windows", "warm-up s", "step s",
                   "expanded tok/s", "model TFLOP/s", "MFU", "peak GiB"], rows)
    out += _table(["workload", "batch (expanded / distinct)", "FLOP ideal", "windows / expanded", "of ideal",
                   "compiled / eager windows"],
                  [[r["workload"], f"{r['expanded_tokens']:,} / {r['unique_tokens']:,}", _f(r.get("flop_ideal"), ".2f"),
                    _f(r.get("windows_vs_expanded"), ".2f"), _f(r.get("fraction_of_ideal"), ".2f"),
                    _f(r.get("compiled_speedup"), ".2f")] for r in d["rows"]])
    return out


def _fidelity(d: dict) -> list[str]:
    if not d.get("runs"):
        return []
    rows = []
    for c in d["runs"]:
        if "error" in c:
            rows.append([c["dtype"], c["mode"], c["workload"], "-", c["error"][:120], "", "", ""])
        for vs, x in c.get("vs_expanded", {}).items():
            rows.append([c["dtype"], c["mode"], c["workload"], vs, _f(x["max_abs"]), _f(x["mean_abs"]),
                         _f(x["bitwise_equal"]), _f(x["expert_load_equal"])])
    return ["## Log-prob fidelity (forward only, against the expanded plan)", ""] + _table(
        ["dtype", "mode", "workload", "run", "max abs", "mean abs", "bitwise", "expert loads equal"], rows)


def _profile(d: dict) -> list[str]:
    if not d.get("counts"):
        return []
    c, per = d["counts"], d["per_microbatch"]
    out = [f"## Profile of one windows step ({d.get('workload')}, {d.get('microbatches')} microbatches, "
           f"{_f(d.get('step_seconds'), '.3f')} s unprofiled)", ""]
    out += _table(["count", "step", "per microbatch"], [[k, f"{v:,}", f"{per[k]:,.0f}"] for k, v in c.items()])
    if d.get("top_kernels"):
        out += _table(["kernel", "calls", "total ms", "mean us", "share"],
                      [[k["name"][:90], k["calls"], f"{k['total_ms']:.2f}", f"{k['mean_us']:.1f}", f"{k['share']:.1%}"]
                       for k in d["top_kernels"]])
        g = d["gaps"]
        out += [f"Device idle between kernels: {g['idle_ms']:.1f} of {g['span_ms']:.1f} ms ({g['idle_fraction']:.1%}), "
                f"{g['gaps']:,} gaps: " + ", ".join(f"{b['count']:,} of {b['from_us']}-{b['to_us']} us ({b['total_ms']:.1f} ms)"
                                                     for b in g["buckets"]) + ".", ""]
    out += _table(["aten op", "count", "inclusive ms"],
                  [[a["name"], f"{a['count']:,}", f"{a['inclusive_ms']:.1f}"] for a in d.get("top_aten_ops", [])[:10]])
    return out


def _peer(d: dict) -> list[str]:
    if not d.get("variants"):
        return []
    out = [f"## transformers peer ({d.get('workload')}: {d.get('trajectories')} trajectories, {_f(d.get('tokens'), ',')} "
           f"tokens; gated delta rule bound: {d.get('bound')})", ""]
    out += _table(["variant", "tok/s", "warm-up s", "peak GiB", "error"],
                  [[n, _f(v.get("tokens_per_s"), ",.0f"), _f(v.get("warmup_seconds"), ".1f"),
                    _gb(v.get("peak_allocated_bytes")), (v.get("error") or "")[:160]] for n, v in d["variants"].items()])
    if d.get("ratios"):
        out += ["Ours over the peer (expanded tokens/s): " + ", ".join(f"{k} {v:.2f}x" for k, v in d["ratios"].items()) + ".", ""]
    if d.get("grad_check"):
        g = d["grad_check"]
        out += [f"fla with its guard lifted vs transformers' PyTorch gated delta rule, linear-attention gradients of a "
                f"{g['trajectory_tokens']}-token trajectory: max relative error {g['grad_rel_err_max']:.3g} ({g['worst_parameter']}).", ""]
    if d.get("agreement"):
        a = d["agreement"]
        out += [f"Peer vs our log-probs on the same trajectories: max {a['max_abs']:.3g}, mean {a['mean_abs']:.3g} "
                f"over {a['positions']:,} entries.", ""]
    return out
