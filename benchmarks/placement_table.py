"""The placement table of `harts bench --full`: makespan ratio and compression over ranks and budgets.

    result = run_placement(cfg)            # {"mode", "chunk_size", "rows"}: one row per (workload, W, B)
    markdown = placement_table(result["rows"])

Each cell is planned free, with a looser makespan slack, and lock-step (with and without windows
across ranks); `placement_bound.compression_bound` bounds what any placement reaches.
"""
from __future__ import annotations

import logging
import time

from benchmarks.placement_bound import compression_bound, placement_specs
from benchmarks.suite_config import SuiteConfig, optional_attr, run_mode
from benchmarks.tables import fmt
from harts_client.synthetic import WorkloadConfig, generate_workload

log = logging.getLogger("benchmarks.suite")

#: the placement table: ranks, microbatch budgets and chunk size (full scale / quick)
PLACEMENT_GRID = {"full": ((8, 32, 64), (16384, 32768, 65536), 64), "quick": ((2, 4), (256, 512), 16)}


#: the goal for the lock-step plan of every cell (lockstep_makespan / makespan; benchmarks/README.md)
LOCKSTEP_TARGET = 1.10
#: the goal for the lock-step plans with windows across ranks at W >= 32: compression / ideal
#: at least this, at a step (lock-step makespan) at most CROSS_GOAL_RATIO x the lower bound
CROSS_GOAL_COMPRESSION = 0.95
CROSS_GOAL_RATIO = 1.05
#: a second placement per cell that accepts a makespan up to this factor above the lower bound
#: (PlanConfig.makespan_slack) to duplicate less: the trade-off between the two targets
PLACEMENT_LOOSE_SLACK = 1.25


def run_placement(cfg: SuiteConfig) -> dict:
    """Makespan ratio (max rank cost / max(total / W, longest trajectory)) and compression of
    the default planner (sharing windows, computed-rows cost model) over the grid of ranks and
    microbatch budgets; one plan per cell, timed in wall and CPU seconds, plus the same cell
    planned with makespan_slack = PLACEMENT_LOOSE_SLACK (its ratio and compression only) and as a
    lock-step plan (its lockstep_ratio and phases; with windows across ranks allowed, the two plans
    `plan_step` compared: compression, makespan ratio and step over the lower bound of each, the
    bytes the crossing one exchanges per step against the duplicated rows' activation bytes it
    saves), and upper bounds on the compression any placement reaches
    (`placement_bound.compression_bound`)."""
    plan_step = optional_attr("planner_service.planner", "plan_step")
    PlanConfig = optional_attr("planner_service.planner", "PlanConfig")
    forest_from_json = optional_attr("planner_service.ingest", "forest_from_json")
    worlds, budgets, chunk = PLACEMENT_GRID["quick" if cfg.quick else "full"]
    optional_attr("planner_service.planner", "warmup")()
    rows = []
    for name, gen in placement_specs(quick=cfg.quick):
        w = generate_workload(WorkloadConfig(**gen))
        forest = forest_from_json(w.dumps("tree"))
        trees = len(forest.tree_ids)
        for W in worlds:
            for B in budgets:
                c0, t0 = time.process_time(), time.perf_counter()
                plan = plan_step(forest, PlanConfig(world_size=W, microbatch_tokens=B, chunk_size=chunk))
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                loose = plan_step(forest, PlanConfig(world_size=W, microbatch_tokens=B, chunk_size=chunk,
                                                     makespan_slack=PLACEMENT_LOOSE_SLACK)).header.stats
                lock = plan_step(forest, PlanConfig(world_size=W, microbatch_tokens=B, chunk_size=chunk, lockstep=True)).header.stats
                st = plan.header.stats
                target = 1.05 if trees >= 2 * W else 1.25
                vs_ideal = st.compression_achieved / st.compression_ideal
                with_x, without_x = lock.with_cross_edges, lock.without_cross_edges
                row_bytes = plan.header.params.memory.activation_row_bytes
                rows.append({
                    "workload": name, "world_size": W, "microbatch_tokens": B, "trees_per_rank": trees / W,
                    "expanded_tokens": int(st.expanded_tokens), "makespan_ratio": float(st.makespan_ratio),
                    "target": target, "ratio_met": st.makespan_ratio <= target,
                    "compression_vs_ideal": vs_ideal, "compression_met": vs_ideal >= 0.95,
                    "duplicated_tokens": int(st.duplicated_tokens), "microbatches": int(st.microbatches),
                    "recomputed": sum(mb.recompute for r in plan.ranks for mb in r.microbatches),
                    "peak_live_tokens": int(st.peak_live_tokens), "plan_seconds": wall, "plan_cpu_seconds": cpu,
                    "loose_makespan_ratio": float(loose.makespan_ratio),
                    "loose_compression_vs_ideal": loose.compression_achieved / loose.compression_ideal,
                    # the best any placement can reach (benchmarks/placement_bound.py): at this
                    # plan's makespan, and anywhere the ratio target is met
                    "bound_at_makespan": compression_bound(forest, st.makespan),
                    "bound_at_target": compression_bound(forest, target * st.makespan_lower_bound),
                    # the same cell as a lock-step plan (docs/design/lockstep.md): its phases' makespan over its free
                    # makespan, and over this (free) plan's
                    "lockstep_ratio": float(lock.lockstep_ratio), "lockstep_met": lock.lockstep_ratio <= LOCKSTEP_TARGET,
                    "lockstep_vs_free": lock.lockstep_makespan / st.makespan if st.makespan > 0 else 1.0,
                    "lockstep_phases": int(lock.lockstep_phases),
                    # windows across ranks (docs/design/cross-rank.md): the lock-step plan's edges, and the two plans it was chosen from
                    "cross_edges": int(lock.cross_edges), "lockstep_plan_seconds": float(lock.plan_seconds),
                    "lockstep_compression_vs_ideal": lock.compression_achieved / lock.compression_ideal,
                    "lockstep_step_vs_bound": lock.lockstep_makespan / lock.makespan_lower_bound,
                    **_crossing_columns(with_x, without_x, lock.compression_ideal, row_bytes, W),
                })
                log.info("bench placement: %s W=%d B=%d: makespan ratio %.3f, compression %.3f of ideal, lock-step ratio "
                         "%.3f, %.2f s", name, W, B, st.makespan_ratio, vs_ideal, lock.lockstep_ratio, wall)
        del forest, w
    return {"mode": run_mode(cfg), "chunk_size": chunk, "rows": rows}


def _crossing_columns(with_x, without_x, ideal: float, row_bytes: int, world: int) -> dict:
    """The placement table's columns of the two lock-step plans compared (PlanStats.with_cross_edges,
    without_cross_edges): compression / ideal, makespan ratio and step / lower bound of each, the
    crossing plan's exchanged bytes and the activation bytes of the duplicated rows it saves, and
    the goal on the plan with crossing windows (W >= 32: CROSS_GOAL_COMPRESSION at CROSS_GOAL_RATIO)."""
    if not without_x.lockstep_makespan:
        return {}
    out = {}
    for tag, c in (("crossing", with_x), ("local", without_x)):
        out[f"{tag}_compression_vs_ideal"] = c.compression_achieved / ideal if c.lockstep_makespan else None
        out[f"{tag}_makespan_ratio"] = c.makespan_ratio if c.lockstep_makespan else None
        out[f"{tag}_step_vs_bound"] = c.lockstep_makespan / c.makespan_lower_bound if c.lockstep_makespan else None
    if with_x.lockstep_makespan:
        out["exchanged_gib"] = with_x.exchanged_bytes / 2**30
        out["saved_activation_gib"] = (without_x.duplicated_tokens - with_x.duplicated_tokens) * row_bytes / 2**30
        if world >= 32:
            out["crossing_goal_met"] = (out["crossing_compression_vs_ideal"] >= CROSS_GOAL_COMPRESSION
                                        and out["crossing_step_vs_bound"] <= CROSS_GOAL_RATIO)
    return out


PLACEMENT_COLUMNS = (
    ("workload", "workload"), ("world_size", "W"), ("microbatch_tokens", "B"), ("trees_per_rank", "trees / rank"),
    ("makespan_ratio", "makespan ratio"), ("target", "target"), ("compression_vs_ideal", "compression / ideal"),
    ("duplicated_tokens", "duplicated tokens"), ("recomputed", "recomputed windows"), ("plan_seconds", "plan s (wall)"),
    ("plan_cpu_seconds", "plan s (CPU)"), ("loose_makespan_ratio", f"ratio, slack {PLACEMENT_LOOSE_SLACK}"),
    ("loose_compression_vs_ideal", f"compression / ideal, slack {PLACEMENT_LOOSE_SLACK}"),
    ("bound_at_makespan", "bound at this makespan"), ("bound_at_target", "bound at the ratio target"),
    ("lockstep_ratio", "lockstep_ratio"), ("lockstep_vs_free", "lock-step / free makespan"),
    ("lockstep_phases", "lock-step phases"), ("lockstep_plan_seconds", "lock-step plan s (wall)"),
    ("cross_edges", "lock-step cross edges"),
    ("lockstep_compression_vs_ideal", "lock-step compression / ideal"), ("lockstep_step_vs_bound", "lock-step step / bound"),
    ("crossing_compression_vs_ideal", "with crossing: compression / ideal"), ("crossing_makespan_ratio", "with crossing: ratio"),
    ("crossing_step_vs_bound", "with crossing: step / bound"),
    ("local_compression_vs_ideal", "without: compression / ideal"), ("local_makespan_ratio", "without: ratio"),
    ("local_step_vs_bound", "without: step / bound"),
    ("exchanged_gib", "exchanged GiB / step"), ("saved_activation_gib", "saved duplicated activations GiB"),
)


def placement_table(rows: list[dict]) -> str:
    """The markdown placement table; a ratio or compression that misses its target is marked."""
    lines = ["| " + " | ".join(h for _, h in PLACEMENT_COLUMNS) + " |", "|" + "---|" * len(PLACEMENT_COLUMNS)]
    for r in rows:
        cells = []
        for key, _ in PLACEMENT_COLUMNS:
            v = r.get(key)
            if key == "makespan_ratio":
                cells.append(f"{v:.3f}" + ("" if r["ratio_met"] else " (missed)"))
            elif key == "compression_vs_ideal":
                cells.append(f"{v:.3f}" + ("" if r["compression_met"] else " (< 0.95)"))
            elif key == "target":
                cells.append(f"<= {v}")
            elif key == "trees_per_rank":
                cells.append(f"{v:.2f}")
            elif key == "lockstep_ratio":
                cells.append("" if v is None else f"{v:.3f}" + ("" if r["lockstep_met"] else f" (> {LOCKSTEP_TARGET:.2f})"))
            elif key == "crossing_step_vs_bound" and "crossing_goal_met" in r and v is not None:
                cells.append(f"{v:.3f}" + ("" if v <= CROSS_GOAL_RATIO else f" (> {CROSS_GOAL_RATIO})"))
            elif key == "crossing_compression_vs_ideal" and "crossing_goal_met" in r and v is not None:
                cells.append(f"{v:.3f}" + ("" if v >= CROSS_GOAL_COMPRESSION else f" (< {CROSS_GOAL_COMPRESSION})"))
            elif key.startswith(("loose_", "bound_", "lockstep_vs", "lockstep_compression", "lockstep_step", "crossing_",
                                 "local_")):
                cells.append("" if v is None else f"{v:.3f}")
            elif key.endswith("_gib"):
                cells.append("" if v is None else f"{v:.1f}")
            else:
                cells.append(fmt(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
