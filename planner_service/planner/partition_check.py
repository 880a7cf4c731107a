"""The plan builder's checks of a Partition: every token kept once, ranks, windows, steps, phases.

    layouts, kept_mb, topo = check_layouts(forest, cfg, partition, k)
    steps, rank_order = rank_orders(partition, cfg)
    phases = check_phases(partition, cfg, steps)       # uint8 [P], or None for a free plan

Each raises PlanningError naming the partition's field (docs/design/planner.md, "The builder").
Legend: N_u forest tokens, M microbatches.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from planner_service.errors import PlanningError
from planner_service.forest import Forest
from planner_service.planner.config import PlanConfig
from planner_service.planner.row_layout import Layout
from planner_service.planner.spec import MicrobatchSpec, Partition
from plan.phases import PHASE_FORWARD


def check_layouts(forest: Forest, cfg: PlanConfig, partition: Partition, k: SimpleNamespace
                 ) -> tuple[list[Layout], np.ndarray, list[int]]:
    """One Layout per microbatch with its kept and duplicated tokens, after checking that the
    partition keeps every forest token once, places microbatches on existing ranks and keeps
    sharing windows on one rank (unless cfg.crossing: a lock-step plan with windows across ranks).

    Returns:
        layouts, kept_mb int32 [N_u] (the microbatch keeping each token), topological order.
    """
    specs = partition.microbatches
    layouts = [Layout(mb=m, spec=sp, kept_tok=_kept_tokens(forest, sp, m, k)) for m, sp in enumerate(specs)]
    for L in layouts:
        dup = _kept_tokens(forest, L.spec, L.mb, k, "dup_ranges")
        L.dup_tok = np.unique(dup)
        if L.dup_tok.shape[0] != dup.shape[0]:
            raise PlanningError(f"partition.microbatches[{L.mb}].dup_ranges: expected distinct tokens, got a repeat")
    kept_mb = np.full(forest.unique_tokens, -1, np.int32)
    for L in layouts:
        kept_mb[L.kept_tok] = L.mb
        L.kept_mb = kept_mb
    if sum(L.kept_tok.shape[0] for L in layouts) != forest.unique_tokens or (kept_mb < 0).any():
        for L in layouts:  # slow path, only to name the culprit
            if (kept_mb[L.kept_tok] != L.mb).any() or np.unique(L.kept_tok).shape[0] != L.kept_tok.shape[0]:
                raise PlanningError(f"partition.microbatches[{L.mb}].ranges: expected each forest token kept once, got a repeat")
        raise PlanningError(f"partition: expected every forest token kept, token {int(np.flatnonzero(kept_mb < 0)[0])} is in no microbatch")
    for m, sp in enumerate(specs):
        if not 0 <= sp.rank < cfg.world_size:
            raise PlanningError(f"partition.microbatches[{m}].rank: expected 0 <= rank < {cfg.world_size}, got {sp.rank}")
    topo = _topological(specs)
    for m, sp in enumerate(specs):
        if sp.parent >= 0 and sp.shared and not cfg.windows:
            raise PlanningError(f"partition.microbatches[{m}].shared: expected False with windows off, got True")
        if sp.parent >= 0 and sp.shared and specs[sp.parent].rank != sp.rank and not cfg.crossing:
            raise PlanningError(
                f"partition.microbatches[{m}].rank: expected {specs[sp.parent].rank} (a sharing window stays on "
                f"its parent's rank without cross_rank_windows in a lock-step plan), got {sp.rank}"
            )
    return layouts, kept_mb, topo


def rank_orders(partition: Partition, cfg: PlanConfig) -> tuple[list[list[tuple[str, int]]], list[list[int]]]:
    """Every rank's steps (the partition's, else depth-first) and its microbatches in order of
    first step, after checking that each microbatch has one F and one B step on its own rank."""
    specs = partition.microbatches
    M = len(specs)
    steps = partition.rank_steps if any(partition.rank_steps) else _default_steps(specs, cfg.world_size)
    if len(steps) != cfg.world_size:
        raise PlanningError(f"partition.rank_steps: expected {cfg.world_size} ranks, got {len(steps)}")
    placed = np.zeros(M, np.int64)
    rank_order: list[list[int]] = []
    for r in range(cfg.world_size):
        order: list[int] = []
        for kind, m in steps[r]:
            if m == -1:  # a stand-in (checked against the phases in `check_phases`)
                if not cfg.lockstep:
                    raise PlanningError(f"partition.rank_steps[{r}]: expected no stand-ins (microbatch -1) in a free plan "
                                        f"(cfg.lockstep false)")
                continue
            if not 0 <= m < M or specs[m].rank != r:
                raise PlanningError(f"partition.rank_steps[{r}]: microbatch {m} is not placed on rank {r}")
            if kind not in ("F", "B"):
                raise PlanningError(f"partition.rank_steps[{r}]: expected step kind 'F' or 'B', got {kind!r}")
            if placed[m] == 0:
                order.append(m)
            placed[m] += 1
        rank_order.append(order)
    if (placed != 2).any():
        raise PlanningError(f"partition.rank_steps: microbatch {int(np.flatnonzero(placed != 2)[0])} must have one F and one B step")
    return steps, rank_order


def check_phases(partition: Partition, cfg: PlanConfig, steps) -> np.ndarray | None:
    """The lock-step phases (uint8 [P]) of a cfg.lockstep partition, after checking that every
    rank has one step per phase of its kind; None for a free plan."""
    if partition.phases is None:
        if cfg.lockstep and any(steps):
            raise PlanningError("partition.phases: expected the phases of a lock-step plan (cfg.lockstep), got none")
        return np.zeros(0, np.uint8) if cfg.lockstep else None
    if not cfg.lockstep:
        raise PlanningError("partition.phases: expected none in a free plan (cfg.lockstep false)")
    phases = np.asarray(partition.phases, np.uint8)
    want = ["F" if ph == PHASE_FORWARD else "B" for ph in phases.tolist()]
    for r, rs in enumerate(steps):
        if [kind for kind, _ in rs] != want:
            raise PlanningError(f"partition.rank_steps[{r}]: expected one step per phase of partition.phases, of its kind")
    return phases


def _topological(specs: list[MicrobatchSpec]) -> list[int]:
    """Microbatch ids, parents before children; raises on unknown parents or cycles."""
    n = len(specs)
    kids: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for m, sp in enumerate(specs):
        if sp.parent >= n or sp.parent < -1 or sp.parent == m:
            raise PlanningError(f"partition.microbatches[{m}].parent: expected -1 or another id < {n}, got {sp.parent}")
        (kids[sp.parent] if sp.parent >= 0 else roots).append(m)
    order = []
    stack = roots[::-1]
    while stack:
        m = stack.pop()
        order.append(m)
        stack.extend(kids[m][::-1])
    if len(order) != n:
        raise PlanningError("partition: microbatch parents form a cycle")
    return order


def _kept_tokens(forest: Forest, spec: MicrobatchSpec, m: int, k: SimpleNamespace, what: str = "ranges") -> np.ndarray:
    """int64 forest tokens of `spec.<what>` (kept ranges, or dup_ranges), in range order."""
    rng = np.asarray(getattr(spec, what), np.int64).reshape(-1, 3)
    if rng.shape[0] == 0:
        return np.zeros(0, np.int64)
    s, a, b = rng[:, 0], rng[:, 1], rng[:, 2]
    bad = (s < 0) | (s >= forest.num_segments)
    if not bad.any():
        bad = (a < 0) | (b <= a) | (b > forest.seg_length[s])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PlanningError(f"partition.microbatches[{m}].{what}[{i}]: expected a non-empty range inside its segment, got {rng[i].tolist()}")
    return k.expand_ranges(forest.seg_offset[s] + a, b - a)


def _default_steps(specs: list[MicrobatchSpec], world: int) -> list[list[tuple[str, int]]]:
    """Depth-first per rank over the microbatch forest: F on entry, B after every dependent."""
    kids: list[list[int]] = [[] for _ in specs]
    for m, sp in enumerate(specs):
        if sp.parent >= 0 and specs[sp.parent].rank == sp.rank and sp.shared:
            kids[sp.parent].append(m)
    steps: list[list[tuple[str, int]]] = [[] for _ in range(world)]

    def visit(m: int) -> None:
        steps[specs[m].rank].append(("F", m))
        for c in kids[m]:
            visit(c)
        steps[specs[m].rank].append(("B", m))

    for m, sp in enumerate(specs):
        if not (sp.parent >= 0 and specs[sp.parent].rank == sp.rank and sp.shared):
            visit(m)
    return steps


