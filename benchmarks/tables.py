"""Markdown cells and the headline table of the benchmark suite.

    fmt(1234.5)                  # "1,234"; None -> "-", bools "yes"/"no", floats to 3 significant digits
    headline_table(rows)         # one row per workload (`headline.measure_workload`'s dicts)
"""
from __future__ import annotations

import math

import numpy as np


def fmt(v) -> str:
    """A markdown table cell of `v`."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v).replace("|", "\\|").replace("\n", " ")


HEADLINE = (
    ("workload", "workload"),
    ("expanded_tokens", "expanded tokens"),
    ("compression_ideal", "token compression"),
    ("computed_per_unique", "computed / unique"),
    ("compression_achieved", "achieved compression"),
    ("planner_seconds", "planner Numba (s)"),
    ("planner_ref_seconds", "planner reference (s)"),
    ("calls", "linear-attn calls tree / expanded"),
    ("flop_compression", "ideal: FLOP compression"),
    ("tree_tokens_per_cpu_s", "tree tok/CPU-s"),
    ("expanded_tokens_per_cpu_s", "expanded tok/CPU-s"),
    ("transformers_tokens_per_cpu_s", "transformers tok/CPU-s"),
    ("tree_vs_transformers", "speedup vs transformers"),
    ("expanded_vs_transformers", "expanded / transformers"),
    ("throughput_ratio", "update throughput tree / expanded"),
    ("fraction_of_ideal", "fraction of ideal"),
    ("tree_vs_transformers_ideal", "vs transformers / ideal"),
)


def headline_table(rows: list[dict]) -> str:
    """The markdown headline table (one row per workload); columns no row has a value for are left out."""
    cols = [(k, h) for k, h in HEADLINE
            if k == "workload" or any(("linear_attention_calls" if k == "calls" else k) in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for key, _ in cols:
            if key == "calls":
                cells.append(f"{fmt(r.get('linear_attention_calls'))} / {fmt(r.get('linear_attention_calls_expanded'))}"
                             if "linear_attention_calls" in r else "-")
            elif key in ("compression_ideal", "compression_achieved", "flop_compression", "throughput_ratio",
                         "tree_vs_transformers", "expanded_vs_transformers") and key in r:
                cells.append(f"{r[key]:.2f}x")
            elif key.endswith("_tokens_per_cpu_s") and key in r:
                cells.append(f"{r[key]:,.0f}")
            elif key in ("fraction_of_ideal", "fraction_of_token_compression", "tree_vs_transformers_ideal") and key in r:
                cells.append(f"{100 * r[key]:.0f}%")
            else:
                cells.append(fmt(r.get(key)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict of dotted keys."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
