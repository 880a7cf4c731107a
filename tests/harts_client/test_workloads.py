"""The synthetic agentic workload generator (harts_client/synthetic.py).

Shapes are checked against an independent oracle: a plain dict trie built from the flat JSON
document, the same structure ingest builds (prefixes merged within a tree_id).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from harts_client.synthetic import (
    ACTION,
    KIND_NAMES,
    OBSERVATION,
    REASONING,
    SYSTEM,
    TASK,
    WorkloadConfig,
    generate,
    generate_workload,
)

NO_LIMIT = 10**9  # max_tokens_per_trajectory that never truncates


class Trie:
    """Radix view of a dict trie over one tree's token lists (the ingest oracle)."""

    def __init__(self, seqs: list[list[int]]):
        self.root: dict = {}
        self.nodes = 0
        for seq in seqs:
            node = self.root
            for tok in seq:
                if tok not in node:
                    node[tok] = {}
                    self.nodes += 1
                node = node[tok]

    def branch_points(self) -> list[tuple[int, int]]:
        """(depth, number of children) of every token node with >= 2 children (depth = index of the
        first token after the shared prefix)."""
        out, stack = [], [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if len(node) >= 2:
                out.append((depth, len(node)))
            stack.extend((child, depth + 1) for child in node.values())
        return sorted(out)

    @staticmethod
    def branches_below(node: dict) -> bool:
        while len(node) == 1:
            node = next(iter(node.values()))
        return len(node) >= 2

    def is_caterpillar(self, node: dict | None = None) -> bool:
        """Every branch point has at most one child whose subtree branches again."""
        node = self.root if node is None else node
        while True:
            while len(node) == 1:
                node = next(iter(node.values()))
            if not node:
                return True
            cont = [c for c in node.values() if self.branches_below(c)]
            if len(cont) > 1:
                return False
            if not cont:
                return True
            node = cont[0]


def by_tree(doc: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for t in doc["trajectories"]:
        out.setdefault(t["tree_id"], []).append(t)
    return out


def piece_walk(w, t: int):
    """(kind, length) of the pieces on trajectory t's path, root first, from the piece table."""
    path, m = [], int(w.traj_node[t])
    while m >= 0:
        path.append(m)
        m = int(w.node_parent[m])
    out = []
    for m in reversed(path):
        for p in np.flatnonzero(w.piece_node == m):
            out.append((int(w.piece_kind[p]), int(w.piece_offset[p + 1] - w.piece_offset[p]), m))
    return out


@pytest.mark.parametrize("scheme", ["group", "tree", "percall"])
def test_lengths_within_scaled_ranges(scheme):
    cfg = WorkloadConfig(scheme=scheme, tasks=6, seed=1, scale=0.05, max_tokens_per_trajectory=NO_LIMIT)
    w = generate_workload(cfg)
    length = np.diff(w.piece_offset)
    ranges = {SYSTEM: cfg.system_tokens, TASK: cfg.task_tokens, ACTION: cfg.action_tokens,
              OBSERVATION: cfg.observation_tokens, REASONING: cfg.reasoning_tokens}
    for kind, full in ranges.items():
        sel = length[w.piece_kind == kind]
        if kind == REASONING and scheme != "percall":
            assert sel.size == 0
            continue
        lo, hi = cfg.scaled_range(full)
        assert sel.size > 0, KIND_NAMES[kind]
        assert lo <= sel.min() and sel.max() <= hi, (KIND_NAMES[kind], lo, hi, sel.min(), sel.max())
    # The system prompt is 100-300 tokens at 5%, one sequence for all tasks.
    assert cfg.scaled_range(cfg.system_tokens) == (100, 300)
    systems = {w.tokens[w.piece_offset[p] : w.piece_offset[p + 1]].tobytes() for p in np.flatnonzero(w.piece_kind == SYSTEM)}
    assert len(systems) == 1 and (w.piece_kind == SYSTEM).sum() == cfg.tasks
    # Turns per rollout (group: actions per trajectory) within range.
    if scheme == "group":
        for t in range(w.num_trajectories):
            n = sum(k == ACTION for k, _, _ in piece_walk(w, t))
            assert cfg.turns[0] <= n <= cfg.turns[1]


@pytest.mark.parametrize("scheme", ["group", "tree", "percall"])
def test_loss_mask_is_one_exactly_on_actions(scheme):
    w = generate_workload(WorkloadConfig(scheme=scheme, tasks=3, seed=2, scale=0.03))
    for t in range(w.num_trajectories):
        tokens, mask = w.trajectory(t)
        pieces = piece_walk(w, t)
        last = pieces[-1][2]
        want = []
        for kind, n, node in pieces:
            trained = (node == last) if scheme == "percall" else (kind == ACTION)
            want += [int(trained)] * n
        assert mask.tolist() == want, t
        assert tokens.shape == mask.shape


def test_group_shape():
    G = 5
    w = generate_workload(WorkloadConfig(scheme="group", tasks=3, seed=3, scale=0.05, group_size=G))
    doc = w.to_json()
    for tree_id, trajs in by_tree(doc).items():
        assert len(trajs) == G
        trie = Trie([t["tokens"] for t in trajs])
        # One branch point, G ways, right after system + task: every rollout shares exactly that prefix.
        [(depth, ways)] = trie.branch_points()
        assert ways == G
        first = trajs[0]
        prompt = first["loss_mask"].index(1)
        assert depth == prompt
        assert all(t["tokens"][:prompt] == first["tokens"][:prompt] for t in trajs)
        assert all(set(t["loss_mask"][:prompt]) == {0} and t["loss_mask"][prompt] == 1 for t in trajs)
    prompts = {tuple(t["tokens"][: t["loss_mask"].index(1)][:50]) for t in doc["trajectories"]}
    assert len(prompts) == 1, "the system prompt is shared by all tasks"


def test_tree_branches_at_unaligned_depths_several_levels_deep():
    cfg = WorkloadConfig(scheme="tree", tasks=8, seed=4, scale=0.05, branching=3, levels=3,
                         max_tokens_per_trajectory=NO_LIMIT)
    w = generate_workload(cfg)
    doc = w.to_json()
    depths = []
    for tree_id, trajs in by_tree(doc).items():
        trie = Trie([t["tokens"] for t in trajs])
        points = trie.branch_points()
        assert all(ways == 3 for _, ways in points)
        depths += [d for d, _ in points]
        # Nested: some trajectory passes at least two branch points.
        assert len(points) >= 2
        assert len(trajs) == 1 + 2 * len(points)  # a full k-ary tree with k = 3
    assert sorted(depths) == sorted(w.branch_depths().tolist())
    for C in (16, 64):
        residues = {d % C for d in depths}
        assert len(residues) > min(C, len(depths)) // 3, (C, residues)
        assert any(d % C for d in depths)
    # Branches happen at turn boundaries: the token before each branch ends an observation.
    assert w.stats()["trajectories"] == sum(len(v) for v in by_tree(doc).values())


@pytest.mark.parametrize("group_size", [1, 3])
def test_percall_is_a_caterpillar(group_size):
    w = generate_workload(WorkloadConfig(scheme="percall", tasks=2, seed=5, scale=0.03, group_size=group_size))
    doc = w.to_json()
    for tree_id, trajs in by_tree(doc).items():
        rollouts: dict[int, list[list[int]]] = {}
        for t, row in zip(np.flatnonzero(w.node_task[w.traj_node] == w.task_ids.index(tree_id)), trajs):
            rollouts.setdefault(int(w.traj_rollout[t]), []).append(row["tokens"])
        assert len(rollouts) == group_size
        whole = Trie([t["tokens"] for t in trajs])
        assert whole.is_caterpillar() == (group_size == 1)
        for samples in rollouts.values():
            trie = Trie(samples)
            assert trie.is_caterpillar()
            # One sample per call; every branch point has exactly 2 ways (this call's leaf, the spine).
            assert all(ways == 2 for _, ways in trie.branch_points())
            assert len(trie.branch_points()) == len(samples) - 1
            # Each sample's context is the previous sample's context plus (action, observation),
            # without the previous reasoning: the previous sample's leaf is not a prefix of the next.
            for a, b in zip(samples, samples[1:]):
                assert len(b) > 0 and a != b[: len(a)]


@pytest.mark.parametrize("scheme", ["group", "tree", "percall"])
def test_exact_unique_tokens_and_trajectory_limit(scheme):
    cfg = WorkloadConfig(scheme=scheme, tasks=3, seed=6, scale=0.02, max_tokens_per_trajectory=40_000)
    w = generate_workload(cfg)
    doc = w.to_json()
    unique = sum(Trie([t["tokens"] for t in trajs]).nodes for trajs in by_tree(doc).values())
    expanded = sum(len(t["tokens"]) for t in doc["trajectories"])
    assert (unique, expanded) == (w.unique_tokens, w.expanded_tokens)
    assert w.stats()["compression_ideal"] == pytest.approx(expanded / unique)
    assert max(len(t["tokens"]) for t in doc["trajectories"]) <= cfg.scaled_max_tokens() == 800
    assert all(1 in t["loss_mask"] for t in doc["trajectories"])


def test_truncation_drops_late_turns():
    long = generate_workload(WorkloadConfig(scheme="group", tasks=2, seed=7, scale=0.02, max_tokens_per_trajectory=NO_LIMIT))
    cut = generate_workload(WorkloadConfig(scheme="group", tasks=2, seed=7, scale=0.02, max_tokens_per_trajectory=30_000))
    assert long.stats()["max_trajectory_tokens"] > 600
    assert cut.stats()["max_trajectory_tokens"] == 600
    for t in range(cut.num_trajectories):  # a truncated trajectory is a prefix of the untruncated one
        a, b = cut.trajectory(t)[0], long.trajectory(t)[0]
        assert a.tolist() == b[: a.shape[0]].tolist()


def test_advantages_are_grpo_style():
    for scheme in ("group", "tree", "percall"):
        w = generate_workload(WorkloadConfig(scheme=scheme, tasks=12, seed=8, scale=0.02))
        assert set(np.unique(w.traj_reward).tolist()) <= {0.0, 1.0}
        task = w.node_task[w.traj_node]
        for a in range(12):
            sel = task == a
            _, first = np.unique(w.traj_rollout[sel], return_index=True)
            rewards = w.traj_reward[sel][first]  # one per rollout
            np.testing.assert_allclose(w.traj_advantage[sel][first], rewards - rewards.mean(), atol=1e-6)
        for r in np.unique(w.traj_rollout):  # percall samples of one rollout share its reward
            assert np.unique(w.traj_reward[w.traj_rollout == r]).size == 1
        assert np.abs(w.traj_advantage).max() > 0


def test_deterministic_by_seed_and_scale_keeps_structure():
    kw = dict(scheme="tree", tasks=3, scale=0.03, old_logprobs=True)
    a = generate(seed=11, **kw)
    assert a == generate(seed=11, **kw)
    assert a != generate(seed=12, **kw)
    small = generate_workload(WorkloadConfig(scheme="tree", tasks=3, seed=11, scale=0.03, max_tokens_per_trajectory=NO_LIMIT))
    big = generate_workload(WorkloadConfig(scheme="tree", tasks=3, seed=11, scale=0.3, max_tokens_per_trajectory=NO_LIMIT))
    np.testing.assert_array_equal(small.node_parent, big.node_parent)
    np.testing.assert_array_equal(small.piece_kind, big.piece_kind)
    assert big.unique_tokens > 5 * small.unique_tokens


def test_old_logprobs_and_explicit_form():
    w = generate_workload(WorkloadConfig(scheme="percall", tasks=2, seed=9, scale=0.02, old_logprobs=True))
    flat, tree = w.to_json("flat"), w.to_json("tree")
    for t in flat["trajectories"]:
        lp, mask = np.array(t["old_logprobs"]), np.array(t["loss_mask"])
        assert (lp[mask == 1] < 0).all() and (lp[mask == 0] == 0).all()
    # The explicit form rebuilds exactly the flat trajectories.
    rows = {t["id"]: t for t in flat["trajectories"]}
    n = 0
    for tr in tree["trees"]:
        nodes = {nd["id"]: nd for nd in tr["nodes"]}
        for t in tr["trajectories"]:
            toks, m = [], t["node"]
            while m is not None:
                toks = nodes[m]["tokens"] + toks
                m = nodes[m]["parent"]
            assert toks == rows[t["id"]]["tokens"] and t["loss_mask"] == rows[t["id"]]["loss_mask"]
            n += 1
    assert n == len(rows)
    assert len(json.dumps(tree)) < len(json.dumps(flat))  # node tokens written once


@pytest.mark.parametrize("form", ["flat", "tree"])
@pytest.mark.parametrize("scheme", ["group", "tree", "percall"])
def test_documents_pass_ingest(scheme, form):
    try:  # optional: the planner extra (harts_client is tested without it too)
        from planner_service.ingest import forest_from_json
    except ImportError:
        pytest.skip("planner_service.ingest.forest_from_json has not landed")
    w = generate_workload(WorkloadConfig(scheme=scheme, tasks=3, seed=10, scale=0.02, old_logprobs=True))
    forest = forest_from_json(w.dumps(form))
    forest.check()
    stats = forest.stats()
    assert (stats["unique_tokens"], stats["expanded_tokens"]) == (w.unique_tokens, w.expanded_tokens)
    assert stats["trajectories"] == w.num_trajectories and stats["trees"] == 3
    assert forest.vocab_size == 256 and int(forest.loss_mask.sum()) == w.stats()["loss_tokens"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(scheme="beam"), "scheme"),
        (dict(tasks=0), "tasks"),
        (dict(scale=0.0), "scale"),
        (dict(group_size=0), "group_size"),
        (dict(branching=1), "branching"),
        (dict(turns=(5, 2)), "turns"),
        (dict(vocab_size=4, group_size=8), "vocab_size"),
        (dict(max_tokens_per_trajectory=5000), "max_tokens_per_trajectory"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    base = dict(scheme="group", tasks=1)
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        WorkloadConfig(**{**base, **kwargs})
