"""Synthetic agentic rollouts shaped like published agent statistics: group, tree and per-call sampling.

    doc = generate("tree", tasks=4, seed=0, scale=0.05)          # the JSON input document
    w = generate_workload(WorkloadConfig(scheme="percall", ...))  # numpy arrays (harts_client.workload)
    harts gen --scheme tree --tasks 4 --seed 0 --scale 0.05 -o rollouts.json

The schemes, the length statistics and why `unique_tokens` / `compression_ideal` are exact:
docs/design/training-loop.md ("Synthetic workloads"). Legend: M nodes (runs of tokens without
branching, as generated), P pieces (system, task, action, observation, reasoning), N distinct node
tokens, T trajectories, N_e expanded tokens.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from harts_client.workload import Workload

log = logging.getLogger(__name__)

SCHEMES = ("group", "tree", "percall")

SYSTEM, TASK, ACTION, OBSERVATION, REASONING = range(5)
KIND_NAMES = ("system", "task", "action", "observation", "reasoning")


@dataclass(slots=True, kw_only=True)
class WorkloadConfig:
    """What to generate. Token ranges are at full scale, inclusive, and scaled by `scale`."""

    scheme: str
    """One of SCHEMES: "group", "tree" or "percall" (docs/design/training-loop.md, "Synthetic workloads")."""
    tasks: int
    """Number of tasks; one rollout tree (tree_id) per task."""
    seed: int = 0
    """Seed of every random draw; equal configs give identical workloads."""
    scale: float = 1.0
    """Multiplier of every token length (not of turn counts); e.g. 0.02 for CPU training runs."""
    vocab_size: int = 256
    """Token ids are drawn uniformly from [0, vocab_size)."""
    group_size: int | None = None
    """Rollouts per task for `group` (default 8) and `percall` (default 4); unused by `tree`."""
    branching: int = 2
    """`tree`: ways of each branch point."""
    levels: int = 3
    """`tree`: number of nested branch points on every root-to-leaf path (before truncation)."""
    system_tokens: tuple[int, int] = (2000, 6000)
    """Shared system + tools prompt length range."""
    task_tokens: tuple[int, int] = (500, 2000)
    """Task statement length range."""
    turns: tuple[int, int] = (10, 100)
    """Turns (model calls) per rollout."""
    action_tokens: tuple[int, int] = (20, 1500)
    """Action (tool call / visible model output) length range."""
    observation_tokens: tuple[int, int] = (100, 4000)
    """Observation (tool output) length range."""
    reasoning_tokens: tuple[int, int] = (50, 2000)
    """`percall`: reasoning length range of each call (dropped from later calls' history)."""
    max_tokens_per_trajectory: int = 131072
    """Context limit at full scale (scaled too): longer trajectories are truncated, later turns dropped."""
    old_logprobs: bool = False
    """Also emit rollout-policy log-probs (negative on trained positions, 0 elsewhere)."""
    batch_id: str = ""
    """Batch id of the document; empty: "<scheme>-n<tasks>-s<seed>"."""

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme: expected one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        if self.tasks < 1:
            raise ValueError(f"tasks: expected >= 1, got {self.tasks}")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ValueError(f"scale: expected a finite number > 0, got {self.scale}")
        if self.group_size is None:
            self.group_size = {"group": 8, "percall": 4, "tree": 1}[self.scheme]
        if self.group_size < 1:
            raise ValueError(f"group_size: expected >= 1, got {self.group_size}")
        if self.branching < 2:
            raise ValueError(f"branching: expected >= 2, got {self.branching}")
        if self.levels < 1:
            raise ValueError(f"levels: expected >= 1, got {self.levels}")
        for name in ("system_tokens", "task_tokens", "turns", "action_tokens", "observation_tokens", "reasoning_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: expected a range 1 <= lo <= hi, got ({lo}, {hi})")
            setattr(self, name, (int(lo), int(hi)))
        siblings = {"group": self.group_size, "tree": self.branching, "percall": 2 * self.group_size}[self.scheme]
        if self.vocab_size < max(2, siblings):
            raise ValueError(
                f"vocab_size: expected >= {max(2, siblings)} (siblings must differ at their first token), "
                f"got {self.vocab_size}"
            )
        prompt = self.scaled_range(self.system_tokens)[1] + self.scaled_range(self.task_tokens)[1]
        if self.scaled_max_tokens() <= prompt:
            raise ValueError(
                f"max_tokens_per_trajectory: expected more than the longest prompt ({prompt} tokens at scale "
                f"{self.scale}), got {self.scaled_max_tokens()} after scaling"
            )
        if not self.batch_id:
            self.batch_id = f"{self.scheme}-n{self.tasks}-s{self.seed}"

    def scaled_range(self, rng: tuple[int, int]) -> tuple[int, int]:
        """The inclusive range a full-scale token range becomes at `scale` (lengths are >= 1)."""
        lo = max(1, round(rng[0] * self.scale))
        return lo, max(lo, round(rng[1] * self.scale))

    def scaled_max_tokens(self) -> int:
        return max(1, round(self.max_tokens_per_trajectory * self.scale))


def sample_lengths(rng: np.random.Generator, rng_range: tuple[int, int], n: int, scale: float = 1.0) -> np.ndarray:
    """int64 [n] lengths: log-normal with median sqrt(lo*hi) and +-2 sigma at lo/hi, clipped, scaled.

    Args:
        rng_range: inclusive full-scale range (lo, hi).
        scale: multiplier applied after sampling; the result is clipped to the scaled range.
    """
    lo, hi = rng_range
    mu, sigma = 0.5 * math.log(lo * hi), max(math.log(hi / lo) / 4.0, 1e-9)
    x = np.clip(rng.lognormal(mu, sigma, size=n), lo, hi)
    slo = max(1, round(lo * scale))
    shi = max(slo, round(hi * scale))
    return np.clip(np.rint(x * scale), slo, shi).astype(np.int64)


class _Structure:
    """Nodes and pieces before lengths and tokens exist (plain lists; a node's pieces are contiguous)."""

    def __init__(self) -> None:
        self.node_parent: list[int] = []
        self.node_task: list[int] = []
        self.node_may_end: list[bool] = []
        self.node_rollout: list[int] = []
        self.piece_node: list[np.ndarray] = []
        self.piece_kind: list[np.ndarray] = []
        self.piece_trained: list[np.ndarray] = []
        self.piece_copy: list[np.ndarray] = []
        self.num_pieces = 0

    def node(self, parent: int, task: int, kinds, trained, copy=None, *, may_end=True, rollout=-1) -> int:
        """Add a node made of pieces `kinds`; `copy[i]` >= 0 makes piece i repeat that piece's tokens."""
        m = len(self.node_parent)
        kinds = np.asarray(kinds, np.int8)
        n = kinds.shape[0]
        self.node_parent.append(parent)
        self.node_task.append(task)
        self.node_may_end.append(may_end)
        self.node_rollout.append(rollout)
        self.piece_node.append(np.full(n, m, np.int32))
        self.piece_kind.append(kinds)
        self.piece_trained.append(np.broadcast_to(np.asarray(trained, bool), (n,)))
        self.piece_copy.append(np.full(n, -1, np.int64) if copy is None else np.asarray(copy, np.int64))
        self.num_pieces += n
        return m

    def first_piece(self) -> int:
        """Index the next node's first piece will get."""
        return self.num_pieces


def _turn_kinds(n: int, *, last_observation: bool) -> np.ndarray:
    """Pieces of n turns: ACTION, OBSERVATION, ...; the last observation only if asked."""
    kinds = np.tile(np.array([ACTION, OBSERVATION], np.int8), n)
    return kinds if last_observation else kinds[:-1]


def _build_group(cfg: WorkloadConfig, rng: np.random.Generator, s: _Structure, task: int, root: int) -> None:
    turns = sample_lengths(rng, cfg.turns, cfg.group_size)
    for n in turns.tolist():
        kinds = _turn_kinds(n, last_observation=False)
        s.node(root, task, kinds, kinds == ACTION)


def _build_tree(cfg: WorkloadConfig, rng: np.random.Generator, s: _Structure, task: int, system_piece: int) -> None:
    # Branch turns are spread so that the expected gaps between levels are even: a node starting at
    # turn `start` with r branch points left (itself included) branches after turn
    # start + 1 + U * 2 (T - start - 1) / (r + 1); the root may branch right after the task (turn 0).
    total = int(sample_lengths(rng, cfg.turns, 1)[0])
    b0 = min(total - 1, int(rng.random() * 2 * total / (cfg.levels + 1)))
    kinds = np.concatenate([np.array([SYSTEM, TASK], np.int8), _turn_kinds(b0, last_observation=True)])
    copy = np.full(kinds.shape[0], -1, np.int64)
    if task:
        copy[0] = system_piece
    root = s.node(-1, task, kinds, kinds == ACTION, copy)
    stack = [(root, b0, 1)]
    while stack:
        parent, start, level = stack.pop()
        children = []
        for _ in range(cfg.branching):
            if level < cfg.levels and total - start >= 2:
                r = cfg.levels - level
                end = min(total - 1, start + 1 + int(rng.random() * 2 * (total - start - 1) / (r + 1)))
                kinds = _turn_kinds(end - start, last_observation=True)
                children.append((s.node(parent, task, kinds, kinds == ACTION), end, level + 1))
            else:
                end = max(start + 1, int(sample_lengths(rng, cfg.turns, 1)[0]))
                kinds = _turn_kinds(end - start, last_observation=False)
                s.node(parent, task, kinds, kinds == ACTION)
        stack.extend(reversed(children))


def _build_percall(cfg: WorkloadConfig, rng: np.random.Generator, s: _Structure, task: int, root: int, rollout0: int) -> None:
    turns = sample_lengths(rng, cfg.turns, cfg.group_size)
    for r, n in enumerate(turns.tolist()):
        parent = root
        for i in range(n):
            # Leaf: this call's reasoning + action (trained). Spine: the same action as history
            # without the reasoning (the leaf's action copies its tokens) + the observation.
            last = i + 1 == n
            spine_first = s.first_piece() + 2
            s.node(parent, task, [REASONING, ACTION], True, None if last else [-1, spine_first], rollout=rollout0 + r)
            if not last:
                parent = s.node(parent, task, [ACTION, OBSERVATION], False, may_end=False)


def generate_workload(cfg: WorkloadConfig) -> Workload:
    """Generate the batch `cfg` describes (deterministic in cfg)."""
    t0 = time.perf_counter()
    s_rng, len_rng, tok_rng, rew_rng = (np.random.default_rng(ss) for ss in np.random.SeedSequence(cfg.seed).spawn(4))
    s = _Structure()
    system_piece = 0
    task_ids = [f"task-{a:0{len(str(cfg.tasks - 1))}d}" for a in range(cfg.tasks)]
    for a in range(cfg.tasks):
        copy = None if a == 0 else [system_piece, -1]
        if cfg.scheme == "tree":
            _build_tree(cfg, s_rng, s, a, system_piece)
            continue
        root = s.node(-1, a, [SYSTEM, TASK], False, copy, may_end=False)
        if cfg.scheme == "group":
            _build_group(cfg, s_rng, s, a, root)
        else:
            _build_percall(cfg, s_rng, s, a, root, a * cfg.group_size)
    w = _materialise(cfg, s, len_rng, tok_rng, rew_rng, task_ids)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("gen: %s in %.2f s", w.stats(), time.perf_counter() - t0)
    return w


def _materialise(cfg, s: _Structure, len_rng, tok_rng, rew_rng, task_ids: list[str]) -> Workload:
    """The Workload of structure `s`: lengths, pruning at the context limit, tokens, trajectories,
    rewards (the random draws in this order)."""
    node_parent = np.asarray(s.node_parent, np.int32)
    node_task = np.asarray(s.node_task, np.int32)
    p_node = np.concatenate(s.piece_node)
    p_kind = np.concatenate(s.piece_kind)
    p_copy = np.concatenate(s.piece_copy)
    M = node_parent.shape[0]
    p_len = _piece_lengths(cfg, p_kind, p_copy, len_rng)
    node_first, p_keep_len, useful, is_end = _prune(cfg, node_parent, np.asarray(s.node_may_end, bool), p_node, p_len)
    raw, raw_start = _raw_tokens(cfg, p_len, p_copy, node_parent, node_first, useful, tok_rng)

    # Kept pieces -> node tokens.
    keep = useful[p_node] & (p_keep_len > 0)
    k_len = p_keep_len[keep]
    k_off = np.concatenate([[0], np.cumsum(k_len)])
    N = int(k_off[-1])
    src = np.repeat(raw_start[keep] - k_off[:-1], k_len) + np.arange(N)
    tokens = raw[src]
    loss_mask = np.repeat(np.concatenate(s.piece_trained)[keep].astype(np.uint8), k_len)
    old_lp = None
    if cfg.old_logprobs:
        old_lp = np.where(loss_mask == 1, -tok_rng.exponential(0.5, size=N), 0.0).astype(np.float32)

    # Renumber kept nodes.
    new_id = np.full(M, -1, np.int64)
    kept_nodes = np.flatnonzero(useful)
    new_id[kept_nodes] = np.arange(kept_nodes.shape[0])
    k_node = new_id[p_node[keep]].astype(np.int32)
    n_len = np.bincount(k_node, weights=k_len, minlength=kept_nodes.shape[0]).astype(np.int64)
    node_offset = np.concatenate([[0], np.cumsum(n_len)])
    parent_old = node_parent[kept_nodes]
    new_parent = np.where(parent_old >= 0, new_id[np.maximum(parent_old, 0)], -1).astype(np.int32)

    ends = np.flatnonzero(is_end)
    traj_node = new_id[ends].astype(np.int32)
    traj_offset, traj_index = _trajectory_index(traj_node, new_parent, n_len, node_offset)
    traj_rollout, traj_reward, traj_adv = _rewards(cfg, np.asarray(s.node_rollout, np.int32)[ends], node_task[ends],
                                                   rew_rng)
    return Workload(
        config=cfg,
        tokens=tokens,
        loss_mask=loss_mask,
        old_logprobs=old_lp,
        node_parent=new_parent,
        node_offset=node_offset.astype(np.int64),
        node_task=node_task[kept_nodes],
        piece_kind=p_kind[keep],
        piece_node=k_node,
        piece_offset=k_off.astype(np.int64),
        traj_node=traj_node,
        traj_rollout=traj_rollout.astype(np.int32),
        traj_reward=traj_reward,
        traj_advantage=traj_adv,
        traj_offset=traj_offset.astype(np.int64),
        traj_index=traj_index.astype(np.int32 if N < 2**31 else np.int64),
        task_ids=task_ids,
    )


def _piece_lengths(cfg, p_kind: np.ndarray, p_copy: np.ndarray, len_rng) -> np.ndarray:
    """int64 [P] lengths, one draw per kind in piece order; copies take their source's length."""
    ranges = (cfg.system_tokens, cfg.task_tokens, None, cfg.observation_tokens, cfg.reasoning_tokens)
    p_len = np.zeros(p_kind.shape[0], np.int64)
    for kind in (SYSTEM, TASK, ACTION, OBSERVATION, REASONING):
        sel = np.flatnonzero((p_kind == kind) & (p_copy < 0))
        p_len[sel] = sample_lengths(len_rng, ranges[kind] or cfg.action_tokens, sel.shape[0], cfg.scale)
    is_copy = p_copy >= 0
    p_len[is_copy] = p_len[p_copy[is_copy]]
    return p_len


def _prune(cfg, node_parent: np.ndarray, may_end: np.ndarray, p_node: np.ndarray, p_len: np.ndarray):
    """Depths, then truncation at the context limit and pruning of nodes no trajectory reaches.

    Returns node_first int [M] (first piece of each node), p_keep_len int64 [P] (kept tokens per
    piece), useful bool [M] (a trajectory reaches the node) and is_end bool [M] (a trajectory ends there).
    """
    M = node_parent.shape[0]
    node_len = np.bincount(p_node, weights=p_len, minlength=M).astype(np.int64)
    node_depth = np.zeros(M, np.int64)
    for m in range(M):  # parents precede children
        if node_parent[m] >= 0:
            node_depth[m] = node_depth[node_parent[m]] + node_len[node_parent[m]]
    p_cum = np.cumsum(p_len) - p_len
    node_first = np.searchsorted(p_node, np.arange(M))
    p_depth = node_depth[p_node] + p_cum - p_cum[node_first[p_node]]
    limit = cfg.scaled_max_tokens()
    p_keep_len = np.clip(limit - p_depth, 0, p_len)
    useful = node_depth < limit
    has_child = np.zeros(M, bool)
    for m in range(M - 1, -1, -1):
        if useful[m]:
            useful[m] = has_child[m] or may_end[m]
            if useful[m] and node_parent[m] >= 0:
                has_child[node_parent[m]] = True
    is_end = useful & may_end & ~has_child
    return node_first, p_keep_len, useful, is_end


def _raw_tokens(cfg, p_len: np.ndarray, p_copy: np.ndarray, node_parent: np.ndarray, node_first: np.ndarray,
                useful: np.ndarray, tok_rng) -> tuple[np.ndarray, np.ndarray]:
    """Raw tokens: one stream for original pieces, copies read their source's range; siblings differ
    at their first token (child j of a parent gets (base_parent + j) mod vocab). Returns the
    stream int32 and each piece's start in it int64 [P]."""
    is_copy = p_copy >= 0
    raw_alloc = np.where(is_copy, 0, p_len)
    raw_start = np.cumsum(raw_alloc) - raw_alloc
    raw_start[is_copy] = raw_start[p_copy[is_copy]]
    raw = tok_rng.integers(0, cfg.vocab_size, size=int(raw_alloc.sum()), dtype=np.int32)
    kids = np.flatnonzero(useful & (node_parent >= 0))
    order = kids[np.argsort(node_parent[kids], kind="stable")]
    par = node_parent[order]
    rank = np.arange(order.shape[0]) - np.searchsorted(par, par)
    base = tok_rng.integers(0, cfg.vocab_size, size=node_parent.shape[0])
    first = node_first[order]
    assert not is_copy[first].any(), "a node's first piece must be an original piece"
    raw[raw_start[first]] = ((base[par] + rank) % cfg.vocab_size).astype(np.int32)
    return raw, raw_start


def _trajectory_index(traj_node: np.ndarray, new_parent: np.ndarray, n_len: np.ndarray, node_offset: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Trajectories (one per end node, in order): their offsets [T+1] and the node-token index of
    every position [N_e]; paths by walking up, all trajectories at once."""
    T = traj_node.shape[0]
    pair_t, pair_n = [], []
    cur = traj_node.astype(np.int64)
    alive = np.arange(T)
    while alive.shape[0]:
        pair_t.append(alive)
        pair_n.append(cur)
        nxt = new_parent[cur]
        ok = nxt >= 0
        alive, cur = alive[ok], nxt[ok].astype(np.int64)
    pt, pn = np.concatenate(pair_t), np.concatenate(pair_n)
    o = np.lexsort((pn, pt))
    pt, pn = pt[o], pn[o]
    seg_len = n_len[pn]
    traj_len = np.bincount(pt, weights=seg_len, minlength=T).astype(np.int64)
    traj_offset = np.concatenate([[0], np.cumsum(traj_len)])
    seg_cum = np.cumsum(seg_len) - seg_len
    traj_index = np.repeat(node_offset[pn] - seg_cum, seg_len) + np.arange(int(seg_len.sum()))
    return traj_offset, traj_index


def _rewards(cfg, end_rollout: np.ndarray, end_task: np.ndarray, rew_rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rewards per rollout, advantage = reward - the task's mean over its rollouts: (rollout of
    each trajectory, its reward float32, its advantage float32) [T] each."""
    T = end_rollout.shape[0]
    rollout = np.where(end_rollout >= 0, end_rollout, np.arange(T) + 10**9).astype(np.int64)
    uniq, traj_rollout = np.unique(rollout, return_inverse=True)
    ro_task = np.zeros(uniq.shape[0], np.int64)
    ro_task[traj_rollout] = end_task
    p_task = rew_rng.random(cfg.tasks)
    ro_reward = (rew_rng.random(uniq.shape[0]) < p_task[ro_task]).astype(np.float64)
    mean = np.bincount(ro_task, weights=ro_reward, minlength=cfg.tasks) / np.maximum(np.bincount(ro_task, minlength=cfg.tasks), 1)
    traj_reward = ro_reward[traj_rollout].astype(np.float32)
    traj_adv = (ro_reward - mean[ro_task])[traj_rollout].astype(np.float32)
    return traj_rollout, traj_reward, traj_adv


def generate(scheme: str, tasks: int, seed: int = 0, scale: float = 1.0, *, form: str = "flat", **knobs) -> dict:
    """The JSON input document of a synthetic batch (see WorkloadConfig for the knobs).

    Args:
        scheme: "group", "tree" or "percall".
        tasks: number of tasks (trees).
        seed: seed of every random draw.
        scale: multiplier of every token length.
        form: "flat" (trajectories) or "tree" (explicit trees).
    """
    return generate_workload(WorkloadConfig(scheme=scheme, tasks=tasks, seed=seed, scale=scale, **knobs)).to_json(form)
