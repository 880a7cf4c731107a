"""The suite's result files: summary.md, README-table.md, <name>.md per benchmark, results.json, plots.

    paths = write_results(doc, cfg)      # doc: `suite.run_suite`'s results document

Headline rows come from `headline.py`, the placement table from `placement_table.py`.
"""
from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

import numpy as np

from benchmarks import suite_config
from benchmarks.placement_table import (CROSS_GOAL_COMPRESSION, CROSS_GOAL_RATIO, LOCKSTEP_TARGET, PLACEMENT_LOOSE_SLACK,
                                        placement_table)
from benchmarks.suite_config import SuiteConfig
from benchmarks.tables import flatten, fmt, headline_table

log = logging.getLogger("benchmarks.suite")

#: published update-throughput speedups, for context in the table and the plot
PUBLISHED = (
    ("HARTS (arXiv 2608.28158), SWE-bench trees", 4.77, 10.45),
    ("Tree Training (arXiv 2511.00413)", 6.2, 6.2),
    ("AReaL-DTA (arXiv 2602.00482), tau2-bench", 8.31, 8.31),
)


def _published_line() -> str:
    parts = [f"{name} {lo}x" if lo == hi else f"{name} {lo}-{hi}x" for name, lo, hi in PUBLISHED]
    return "Published update-throughput speedups for context (GPU clusters, large models): " + "; ".join(parts) + "."


def _threads_text(rows: list[dict]) -> str:
    used = sorted({r["trainer_threads"] for r in rows if "trainer_threads" in r})
    if not used:
        return "torch's intra-op threads"
    return f"{'/'.join(map(str, used))} intra-op thread{'s' if used != [1] else ''}"


def _workload_notes(rows: list[dict], mode: str) -> list[str]:
    notes = []
    for r in rows:
        for key in ("error", "skipped", "trainer_note", "planner_ref_note"):
            if key in r:
                notes.append(f"- {r['workload']}: {r[key]}.")
    if mode == "full":
        notes.append("- Full scale: planning only (8 ranks, sharing windows, B = 65,536, C = 64); no trainer run.")
    else:
        notes.append("- CPU scale: token lengths x0.02 (quick: x0.01) and fewer turns; one rank, B = 2,048 (quick: 256, "
                     "below the trees' sizes: sharing windows), C = 16 (a 64-token chunk would span several scaled "
                     "turns and inflate replay); the expanded plan packs whole trajectories (B raised to the longest); "
                     "update throughput in expanded tokens per CPU second of this process (fastest timed step of "
                     "each mode; the machine is shared, so wall time is noisier) with "
                     f"{_threads_text(rows)}, fixed malloc thresholds, reference kernels, fused AdamW; transformers: "
                     "Qwen3NextForCausalLM on the same weights (exported with `trainer.export`), trajectory by "
                     "trajectory, on a seeded subset of up to 20,000 expanded tokens of the batch.")
    return notes


def render_result(name: str, entry: dict) -> str:
    """Markdown of one benchmark's entry: a key/value table, and a table per list of dict rows."""
    lines = [f"# Benchmark: {name}", ""]
    if name in suite_config.MODULES:
        lines += [suite_config.MODULES[name][1] + ".", ""]
    lines.append(f"Status: **{entry['status']}** in {entry.get('seconds', 0):.1f} s.")
    if entry["status"] == "skipped":
        lines.append(f"Skipped: {entry['reason']}.")
    if entry["status"] == "failed":
        lines += ["", "```", entry.get("traceback", entry.get("error", "")).strip(), "```"]
    result = entry.get("result")
    own = None
    if name in suite_config.MODULES and entry["status"] == "ok":  # a module that renders its own tables
        own = getattr(importlib.import_module(suite_config.MODULES[name][0]), "result_markdown", None)
    if isinstance(result, dict) and own is not None:
        return "\n".join(lines) + "\n\n" + own(result) + "\n"
    if isinstance(result, dict):
        scalars, tables = {}, {}
        for k, v in flatten(result).items():
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                tables[k] = v
            else:
                scalars[k] = v
        if scalars:
            lines += ["", "| metric | value |", "|---|---|"]
            lines += [f"| {k} | {fmt(v if not isinstance(v, (list, tuple)) else ', '.join(fmt(x) for x in v))} |" for k, v in scalars.items()]
        for k, rows in tables.items():
            cols = list(dict.fromkeys(c for r in rows for c in flatten(r)))
            lines += ["", f"**{k}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
            for r in rows:
                fr = flatten(r)
                lines.append("| " + " | ".join(fmt(fr.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write_results(doc: dict, cfg: SuiteConfig) -> list[Path]:
    """Write summary.md, README-table.md, <name>.md, results.json and the plots; returns the paths."""
    out = cfg.out_dir
    suffix = "-full" if cfg.full else ""
    written = []
    wl = doc["benchmarks"].get("workloads", {})
    rows = wl.get("result", {}).get("rows", [])
    plots = write_plots(rows, out, suffix) if rows else []
    written += plots

    table = headline_table(rows) if rows else "(the workloads benchmark did not run)"
    notes = _workload_notes(rows, doc["mode"])
    intro = (f"Synthetic agentic workloads from `harts_client/synthetic.py` ({doc['mode']} scale, "
             f"`{doc['command']}`, commit {doc['machine']['commit']}, {doc['machine']['cpus']} CPUs). ")
    intro += ("Planning only." if cfg.full else
              f"Update throughput: the `{'tiny' if cfg.quick else cfg.model}` Qwen3-Next-style model on the CPU, forward + backward + AdamW step, "
              "expanded tokens per CPU second; fraction of ideal = throughput ratio / the plan's FLOP compression "
              "(`trainer/flops.py`: expanded plan FLOPs / tree plan FLOPs); speedup vs transformers = tree "
              "throughput / transformers' on the same weights; the last column divides that by the FLOP compression "
              "(target >= 90%).")
    if not cfg.full and (not cfg.only or "workloads" in cfg.only):
        readme = [intro, "", table, "", _published_line(), *([""] + notes if notes else []), "",
                  "![compression](benchmarks/results/compression.png)", ""]
        (out / "README-table.md").write_text("\n".join(readme))
        written.append(out / "README-table.md")

    summary = [f"# HARTS benchmark results ({doc['mode']})", "", f"Command: `{doc['command']}`; started {doc['started']}; "
               f"machine: {doc['machine']['platform']}, Python {doc['machine']['python']}, {doc['machine']['cpus']} CPUs, "
               f"commit {doc['machine']['commit']}.", "", "## Headline", "", intro, "", table, "", _published_line()]
    if notes:
        summary += ["", *notes]
    placement = wl.get("result", {}).get("placement", {}).get("rows", [])
    if placement:
        summary += ["", "## Placement", "",
                    "Makespan ratio = max rank cost / max(total cost / W, longest trajectory's cost) with the default "
                    "planner (sharing windows, C = 64, cost = computed rows, makespan_slack 1.02); targets: <= 1.05 with "
                    "at least 2 trees per rank, <= 1.25 otherwise; compression achieved >= 0.95 of ideal. The "
                    f"two slack columns plan the same cell with makespan_slack {PLACEMENT_LOOSE_SLACK} (a longer step for "
                    "less duplication). The bounds are the highest compression / ideal any placement can reach "
                    "(benchmarks/placement_bound.py: every rank computes the root path of what it keeps) with no rank "
                    "above this plan's makespan, and with the makespan ratio at its target. The lock-step columns plan "
                    "the cell with lockstep=True (one global sequence of phases, docs/design/lockstep.md; forward 1/3 and backward "
                    f"2/3 of a microbatch's cost, a phase as long as its slowest rank): lockstep_ratio = lock-step "
                    f"makespan / that plan's makespan (target <= {LOCKSTEP_TARGET}), and the same over the free plan's "
                    "makespan. The lock-step plan may give windows across ranks (docs/design/cross-rank.md: a tree's shared prefix "
                    "imported from the rank that computes it); the planner builds it with and without them and keeps "
                    "the crossing one only where its step (lock-step makespan) is shorter, or at most 1% longer with "
                    "fewer duplicated rows: 'lock-step cross edges' and the next two columns are the chosen plan's, then "
                    "both candidates' compression / ideal, makespan ratio and step / lower bound, the bytes the crossing "
                    "candidate exchanges per step (exports and their gradients) and the activations of the duplicated "
                    f"rows it saves; goal at W >= 32: >= {CROSS_GOAL_COMPRESSION} of ideal at a step <= "
                    f"{CROSS_GOAL_RATIO} x the bound.", "",
                    placement_table(placement)]
    summary += ["", "## Benchmarks", "", "| benchmark | status | seconds | details |", "|---|---|---|---|"]
    for name, entry in doc["benchmarks"].items():
        detail = entry.get("reason") or entry.get("error") or f"[{name}{suffix}.md]({name}{suffix}.md)"
        summary.append(f"| {name} | {entry['status']} | {entry['seconds']:.1f} | {fmt(detail)} |")
        (out / f"{name}{suffix}.md").write_text(render_result(name, entry))
        written.append(out / f"{name}{suffix}.md")
    summary += [""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    (out / f"summary{suffix}.md").write_text("\n".join(summary))
    written.append(out / f"summary{suffix}.md")
    (out / f"results{suffix}.json").write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    written.append(out / f"results{suffix}.json")
    log.info("bench: wrote %s", ", ".join(str(p) for p in written))
    return written


def _json_default(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    return repr(v)


def write_plots(rows: list[dict], out: Path, suffix: str = "") -> list[Path]:
    """compression.png (token / plan / FLOP compression and throughput ratio per workload, published
    figures as a band) and planner.png (Numba vs reference planner seconds)."""
    # optional: matplotlib only where plots are written, its Agg backend chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    names = [r["workload"] for r in rows]
    x = np.arange(len(rows))
    series = [("compression_ideal", "token compression (expanded / unique)"),
              ("compression_achieved", "plan compression (expanded / computed)"),
              ("flop_compression", "ideal: FLOP compression of the plan"),
              ("throughput_ratio", "update throughput, tree / expanded")]
    series = [(k, label) for k, label in series if any(k in r for r in rows)]
    fig, ax = plt.subplots(figsize=(8.5, 4.2), dpi=110)
    width = 0.8 / max(1, len(series))
    for i, (key, label) in enumerate(series):
        vals = [r.get(key, np.nan) for r in rows]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=label)
        ax.bar_label(bars, labels=[f"{v:.1f}x" if np.isfinite(v) else "" for v in vals], fontsize=7, padding=1)
    lo, hi = PUBLISHED[0][1], PUBLISHED[0][2]
    ax.axhspan(lo, hi, color="0.85", zorder=0, label=f"HARTS published {lo}-{hi}x")
    for name, v, _ in PUBLISHED[1:]:
        ax.axhline(v, color="0.5", lw=0.8, ls="--", zorder=0)
        ax.text(len(rows) - 0.5, v, f" {name.split(' (')[0]} {v}x", fontsize=7, va="bottom", ha="right", color="0.3")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("x over trajectory-expanded")
    ax.set_title("Prefix sharing on synthetic agentic workloads", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    p = out / f"compression{suffix}.png"
    fig.savefig(p)
    plt.close(fig)
    paths.append(p)

    if any("planner_seconds" in r for r in rows):
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=110)
        for i, (key, label) in enumerate((("planner_seconds", "Numba"), ("planner_ref_seconds", "plain-Python reference"))):
            vals = [r.get(key, np.nan) for r in rows]
            ax.bar(x + (i - 0.5) * 0.4, vals, 0.4, label=label)
        ax.set_yscale("log")
        ax.set_xticks(x, names, fontsize=8)
        ax.set_ylabel("planning time (s, log)")
        ax.set_title("Planner time per step", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / f"planner{suffix}.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(p)
    return paths
