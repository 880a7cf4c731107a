"""Keep every rank's live window stack within M: recomputation first, then duplicated edges.

    est = WindowExports(k, cfg, roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent)
    live = fit_memory(k, cfg, est, mb_parent, shared, recompute, can_dup, rows_now)   # changes shared, recompute

Byte sizes follow `plan.memory_model` (the builder and the validator use the same rules), so the
builder's exact stack never exceeds this estimate (docs/design/planner.md, level 2).
Legend: M microbatches.
"""
from __future__ import annotations

import numpy as np

from planner_service.errors import PlanningError
from planner_service.planner.config import PlanConfig


class WindowExports:
    """The partitioner's estimate of what each window keeps (plan.memory_model's rules).

    `full` are what a microbatch holds while it runs (`RowSizes.full_bytes`: with activation
    checkpointing its kept activations plus one recomputed block's); what it keeps while its
    dependents run is its kept activations (`RowSizes.kept_bytes`), or, recomputed, the exports of
    its own rows that `level2.window_export_counts` bounds from above. The builder's exact stack is
    therefore never larger than this estimate.
    """

    def __init__(self, k, cfg: PlanConfig, roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent):
        self.k, self.cfg = k, cfg
        self.args = (roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent)

    def bytes(self, shared: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(full int64 [M], recomputed-window exports int64 [M]) in bytes."""
        roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent = self.args
        group = self.k.window_groups(mb_parent, shared)
        attn, conv, kern, states = self.k.window_export_counts(
            roots_off, roots, unit_parent, unit_len, unit_depth, unit_mb, mb_parent, shared, group,
            self.cfg.chunk_size, self.cfg.conv_kernel, self.cfg.replay,
        )
        sizes = self.cfg.sizes
        return sizes.full_bytes(rows), sizes.export_bytes(attn, conv, kern, states)


class _Stacks:
    """The live window stacks of one partition while `fit_memory` changes its edge modes in place."""

    def __init__(self, k, cfg: PlanConfig, est: WindowExports, mb_parent, shared, recompute, rows_now,
                 crossing: np.ndarray, imp_now):
        self.k, self.sizes, self.est = k, cfg.sizes, est
        self.mb_parent, self.shared, self.recompute, self.crossing = mb_parent, shared, recompute, crossing
        self.rows_now, self.imp_now = rows_now, imp_now

    def local(self) -> np.ndarray:
        """bool [M] window edges inside one rank's stack."""
        return self.shared & ~self.crossing

    def live(self):
        """(live, running bytes, kept bytes of an open window, exports of a recomputed one), int64 [M] each."""
        rows = self.rows_now()
        full, exports = self.est.bytes(self.shared, rows)
        kept = self.sizes.kept_bytes(rows)
        imp = self.imp_now() if self.imp_now is not None else 0
        held = np.where(self.recompute, exports, kept) + imp
        return self.k.live_stack(self.mb_parent, self.local(), full + imp, held)[0], full, kept, exports

    def chain(self, m: int) -> list[int]:
        """The open windows below which m runs on its rank, nearest first."""
        chain = []
        c = m
        on = self.local()
        while self.mb_parent[c] >= 0 and on[c]:
            c = int(self.mb_parent[c])
            chain.append(c)
        return chain


def fit_memory(k, cfg, est: WindowExports, mb_parent, shared, recompute, can_dup, rows_now, *, minimal: bool = False,
               crossing: np.ndarray | None = None, imp_now=None):
    """Keep every live window stack within M (bytes): mark recomputation where it saves memory,
    then duplicate edges (deepest first along a violating stack). Returns live int64 [M] bytes.

    A violating stack marks every window on it; with `minimal` (lock-step plans, where each
    recomputed window's backward needs a PHASE_RECOMPUTE) only the root-most ones that cover its
    excess. With windows across ranks (`crossing`: bool [M] the parent runs on another rank), a
    stack is a rank's: it starts at a microbatch whose window crosses ranks, which holds the
    exports it receives (`imp_now()`, int64 [M]) while it runs and while it is open.

    Raises:
        PlanningError: a microbatch whose own activations plus the exports of its open windows,
            every one of them recomputed and no edge left to duplicate, exceed M; the message
            gives the numbers and a sufficient budget.
    """
    budget = cfg.memory_bytes
    crossing = np.zeros(mb_parent.shape[0], np.bool_) if crossing is None else crossing
    st = _Stacks(k, cfg, est, mb_parent, shared, recompute, rows_now, crossing, imp_now)
    live, full, kept, exports = st.live()
    if (live <= budget).all():
        return live
    _mark_recompute(st, live, kept, exports, budget, minimal)
    live, full, kept, exports = st.live()
    # Enough M without any duplication: under a larger M the violators are a subset of these and
    # their ancestors get the same marks.
    need = int(live.max())
    while (live > budget).any():
        if not _duplicate_one(st, live, can_dup, budget):
            raise _stack_error(cfg, st, live, full, need)
        live, full, kept, exports = st.live()
    has_kids = np.zeros(mb_parent.shape[0], np.bool_)
    has_kids[mb_parent[(mb_parent >= 0) & shared]] = True
    recompute &= has_kids & (exports < kept)  # only lowers live costs
    return st.live()[0]


def _mark_recompute(st: _Stacks, live, kept, exports, budget: int, minimal: bool) -> None:
    """Mark recomputation on every violating stack: each window whose exports are smaller than what
    it keeps, or with `minimal` only the root-most ones that cover the stack's excess."""
    recompute = st.recompute
    for m in np.flatnonzero(live > budget).tolist():
        chain = st.chain(m)
        if not minimal:
            for c in chain:
                recompute[c] = exports[c] < kept[c]
            continue
        over = int(live[m]) - budget
        for c in reversed(chain):  # root-most first: one mark covers every stack below it
            if over <= 0:
                break
            if not recompute[c] and exports[c] < kept[c]:
                recompute[c] = True
                over -= int(kept[c] - exports[c])


def _duplicate_one(st: _Stacks, live, can_dup, budget: int) -> bool:
    """Duplicate the deepest edge that can along the first violating stack; False when none can."""
    mb_parent, shared = st.mb_parent, st.shared
    for m in np.flatnonzero(live > budget).tolist():
        on = st.local()
        c = m
        while mb_parent[c] >= 0 and on[c]:
            if can_dup[c]:
                shared[c] = False
                return True
            c = int(mb_parent[c])
    return False


def _stack_error(cfg: PlanConfig, st: _Stacks, live, full, need: int) -> PlanningError:
    """The error of a stack that no recomputation or duplication brings within M."""
    sizes, budget = cfg.sizes, cfg.memory_bytes
    worst = int(np.argmax(live))
    chain = st.chain(worst)
    held = int(live[worst] - full[worst])
    return PlanningError(
        f"memory_tokens: microbatch {worst} holds {int(live[worst])} bytes ({sizes.tokens(int(live[worst]))} "
        f"row-equivalents) while it runs, expected <= {budget} ({cfg.memory_tokens} x "
        f"{sizes.row_bytes} bytes per row): its own activations ({int(full[worst])} bytes) plus "
        f"the exports of its {len(chain)} open windows ({held} bytes, every one recomputed) along one "
        f"root-to-leaf path, and no edge on it can duplicate its prefix within microbatch_tokens; raise "
        f"memory_tokens to >= {sizes.tokens(need)}, or raise microbatch_tokens so that deep edges can duplicate "
        f"their prefix"
    )
