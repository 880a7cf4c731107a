"""How little duplication any placement can reach at a given makespan: a lower bound.

    python -m benchmarks.placement_bound            # the full-scale placement workloads, W = 8, 32, 64
    compression_bound(forest, capacity)             # upper bound on compression / ideal, <= capacity rows per rank

Without windows across ranks a rank computes the root path of every token it keeps, so balance
costs duplicated prefixes; the argument (`path_bound`, root segments, disjoint subtrees):
benchmarks/README.md ("The placement table"). Legend: S segments, N_u distinct tokens.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys

import numpy as np

from harts_client.synthetic import WorkloadConfig, generate_workload
from planner_service.forest import Forest
from planner_service.ingest import forest_from_json
from planner_service.planner import PlanConfig, plan_step, warmup

log = logging.getLogger(__name__)


def duplication_lower_bound(forest: Forest, capacity: float) -> int:
    """Rows any placement whose ranks compute at most `capacity` rows each must duplicate (benchmarks/README.md, "The placement table")."""
    parent = forest.seg_parent.astype(np.int64)
    length = forest.seg_length.astype(np.int64)
    depth = forest.seg_depth.astype(np.int64)
    S = parent.shape[0]
    end = depth + length
    size, deepest = length.copy(), end.copy()  # subtree rows, deepest end below (segments in preorder)
    for s in range(S - 1, -1, -1):
        p = parent[s]
        if p >= 0:
            size[p] += size[s]
            deepest[p] = max(deepest[p], deepest[s])
    kids: list[list[int]] = [[] for _ in range(S)]
    for s in range(S):
        if parent[s] >= 0:
            kids[parent[s]].append(s)

    def path_bound(v: int) -> int:
        """Duplicated rows of the longest path below v (at depth >= depth[v]).

        Every rank that keeps rows of a branch off the path computes the path down to the
        branch's attach depth a; the rank holding the path's end computes all l of it. Relaxed to
        branch rows that may split anywhere, the cheapest cover is greedy: the rank holding the
        path's end takes the deepest c - l branch rows; then, while rows are left, one more rank
        computes the path down to the deepest remaining attach depth a (duplicated: a - depth[v]
        rows of it) and takes the next c - a rows.
        """
        top, branches = int(depth[v]), []  # (attach depth, rows) off the path
        while kids[v]:
            on_path = max(kids[v], key=lambda c: deepest[c])
            branches += [(int(depth[c]), float(size[c])) for c in kids[v] if c != on_path]
            v = on_path
        branches.sort(reverse=True)
        dup, room, i = 0, capacity - end[v], 0
        while True:
            while i < len(branches) and branches[i][1] <= room:  # whole branches, deepest first
                room -= branches[i][1]
                i += 1
            if i == len(branches):
                return dup
            attach, rows = branches[i]
            branches[i] = (attach, rows - room)  # the rest of it goes to the next rank
            attach = branches[i][0]
            dup += max(0, attach - top)
            room = capacity - attach

    total = 0
    for root in np.flatnonzero(parent < 0).tolist():
        if size[root] <= capacity:
            continue
        # the root segment on every rank the tree spans, plus each child subtree's path rows
        # (disjoint rows); or the tree's own longest path
        below = sum(path_bound(c) for c in kids[root])
        spans = (math.ceil(size[root] / capacity) - 1) * int(length[root])
        total += max(path_bound(root), spans + below)
    return total


def compression_bound(forest: Forest, capacity: float) -> float:
    """Upper bound on compression_achieved / compression_ideal under that capacity."""
    n = forest.unique_tokens
    return n / (n + duplication_lower_bound(forest, capacity))


def placement_specs(*, quick: bool = False) -> list[tuple[str, dict]]:
    """The workloads of the placement table (`harts bench --full`) and of `run`: few large trees."""
    if quick:
        return [(f"{scheme} (2 tasks)", dict(scheme=scheme, tasks=2, seed=1, scale=0.01, turns=(10, 14)))
                for scheme in ("percall", "group", "tree")]
    return [("percall (8 tasks)", dict(scheme="percall", tasks=8, seed=1)),
            ("group (16 tasks)", dict(scheme="group", tasks=16, seed=0)),
            ("tree (8 tasks)", dict(scheme="tree", tasks=8, seed=0))]


def run(worlds=(8, 32, 64), budget: int = 65536, chunk: int = 64, slacks=(1.0, 1.25)) -> list[dict]:
    """Per placement workload and W: the planner's ratio and compression beside the bounds."""
    warmup()
    rows = []
    for name, gen in placement_specs():
        forest = forest_from_json(generate_workload(WorkloadConfig(**gen)).dumps("tree"))
        for W in worlds:
            st = plan_step(forest, PlanConfig(world_size=W, microbatch_tokens=budget, chunk_size=chunk)).header.stats
            row = {"workload": name, "world_size": W, "lower_bound": st.makespan_lower_bound,
                   "makespan_ratio": round(st.makespan_ratio, 3),
                   "compression_vs_ideal": round(st.compression_achieved / st.compression_ideal, 3)}
            for s in slacks:
                row[f"bound_at_ratio_{s}"] = round(compression_bound(forest, s * st.makespan_lower_bound), 3)
            rows.append(row)
            log.info("placement bound: %s", row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="8,32,64", help="comma-separated W (default 8,32,64)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    print(json.dumps(run(worlds=tuple(int(w) for w in args.world_sizes.split(","))), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
