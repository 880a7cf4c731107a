"""Synthetic agentic rollouts shaped like published agent statistics (issue 6).

Three sampling schemes, one tree per task (`tree_id` = task id):

- `group`: GRPO group sampling. G rollouts per task share the system+tools prompt and the task
  statement, then branch at the first action; each rollout is an independent multi-turn
  action/observation episode. Sharing is the prompt only, so compression stays modest.
- `tree`: tree sampling at turn boundaries (tree search, retries from a checkpoint). A task's
  rollout branches `branching` ways after the observation of a sampled turn, `levels` times, so that
  branch depths fall at arbitrary token positions relative to the linear-attention chunk
  boundaries. Leaves are the trajectories (`branching ** levels` per task unless truncated).
- `percall`: one training sample per model call of a reasoning agent whose chat template drops the
  reasoning of earlier turns (Qwen3/DeepSeek-R1 style). Call i sees system + task + (action_j,
  observation_j for j < i) and produces reasoning_i + action_i, so its sample is the spine's prefix
  plus a private leaf: a caterpillar tree per rollout (G rollouts hang below the shared prompt).
  The loss mask is 1 on the call's own output only; earlier actions are context there.

Lengths follow the statistics the issue cites (SWE-agent-like): a system+tools prompt of 2-6k
tokens, a task statement of 0.5-2k, 10-100 turns, actions of 20-1,500 tokens, observations of
100-4,000 tokens (reasoning of 50-2,000 in `percall`). Each length is drawn from a log-normal whose
median is the geometric mean of its range and whose +-2 sigma span the range, clipped to it. `scale`
multiplies every token length (never the turn counts) after sampling, so a seed gives the same
structure at every scale and CPU-sized runs keep the shape. The system prompt is one token sequence
shared by ALL tasks, but trees are per task: flat ingest merges prefixes only within a tree_id, so it
is counted once per task (a deliberate choice: tasks are independent trees in the plan).

Siblings always differ at their first token, so the radix tree that ingest builds has exactly the
branch points generated here, and `unique_tokens` / `compression_ideal` are exact. Advantages are
GRPO-style: a Bernoulli(p_task) reward per rollout, advantage = reward - the task's mean reward.

Python API: `generate(scheme, tasks, seed, scale, ...) -> dict` (the JSON input document), or
`generate_workload(WorkloadConfig(...)) -> Workload` for the numpy arrays and `write_json`.
CLI: `harts gen --scheme tree --tasks 4 --seed 0 --scale 0.05 -o rollouts.json`.

Legend: M nodes (runs of tokens without branching, as generated), P pieces (system, task, action,
observation, reasoning), N distinct node tokens, T trajectories, N_e expanded tokens.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import IO

import numpy as np

log = logging.getLogger(__name__)

SCHEMES = ("group", "tree", "percall")

SYSTEM, TASK, ACTION, OBSERVATION, REASONING = range(5)
KIND_NAMES = ("system", "task", "action", "observation", "reasoning")


@dataclass(slots=True, kw_only=True)
class WorkloadConfig:
    """What to generate. Token ranges are at full scale, inclusive, and scaled by `scale`."""

    scheme: str
    """One of SCHEMES: "group", "tree" or "percall" (see the module docstring)."""
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


@dataclass(slots=True, kw_only=True)
class Workload:
    """A generated batch as flat arrays: the rollout trees (nodes) and the trajectories."""

    config: WorkloadConfig
    tokens: np.ndarray
    """int32 [N] tokens of every node, node after node."""
    loss_mask: np.ndarray
    """uint8 [N] 1 on trained tokens (actions; percall: the call's reasoning + action)."""
    old_logprobs: np.ndarray | None
    """float32 [N] rollout log-probs (0 on untrained tokens), None unless requested."""
    node_parent: np.ndarray
    """int32 [M] parent node, -1 for a task root; parents precede children."""
    node_offset: np.ndarray
    """int64 [M+1] token range of each node in `tokens`."""
    node_task: np.ndarray
    """int32 [M] task of each node."""
    piece_kind: np.ndarray
    """int8 [P] SYSTEM/TASK/ACTION/OBSERVATION/REASONING of each piece (after truncation)."""
    piece_node: np.ndarray
    """int32 [P] node of each piece; pieces of a node are contiguous and in order."""
    piece_offset: np.ndarray
    """int64 [P+1] token range of each piece in `tokens`."""
    traj_node: np.ndarray
    """int32 [T] last node of each trajectory (its path is the root-to-node chain)."""
    traj_rollout: np.ndarray
    """int32 [T] rollout of each trajectory (percall: several samples per rollout)."""
    traj_reward: np.ndarray
    """float32 [T] reward of the trajectory's rollout."""
    traj_advantage: np.ndarray
    """float32 [T] reward minus the mean reward of the task's rollouts."""
    traj_offset: np.ndarray
    """int64 [T+1] offsets of each trajectory's positions in `traj_index`."""
    traj_index: np.ndarray
    """int32 (int64 when N >= 2**31) [N_e] for every trajectory position, its token index in `tokens`."""
    task_ids: list[str] = field(default_factory=list)
    """[tasks] tree ids."""

    @property
    def num_trajectories(self) -> int:
        return int(self.traj_node.shape[0])

    @property
    def unique_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def expanded_tokens(self) -> int:
        return int(self.traj_offset[-1])

    def traj_ids(self) -> list[str]:
        """Trajectory ids "<task>/<k>", k counting the task's trajectories."""
        task = self.node_task[self.traj_node]
        starts = np.searchsorted(task, np.arange(len(self.task_ids)))
        k = np.arange(task.shape[0]) - starts[task]
        return [f"{self.task_ids[a]}/{b}" for a, b in zip(task.tolist(), k.tolist())]

    def trajectory(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32 [L], loss_mask uint8 [L]) of trajectory t."""
        idx = self.traj_index[self.traj_offset[t] : self.traj_offset[t + 1]]
        return self.tokens[idx], self.loss_mask[idx]

    def branch_depths(self) -> np.ndarray:
        """int64 [*] depth of every branch point (first depth after the end of a node with >= 2 children)."""
        depth = self.node_depth()
        counts = np.bincount(self.node_parent[self.node_parent >= 0], minlength=self.node_parent.shape[0])
        parents = np.flatnonzero(counts >= 2)
        return depth[parents] + np.diff(self.node_offset)[parents]

    def node_depth(self) -> np.ndarray:
        """int64 [M] depth of each node's first token."""
        length = np.diff(self.node_offset)
        depth = np.zeros(length.shape[0], np.int64)
        for m in np.flatnonzero(self.node_parent >= 0):  # parents precede children
            p = self.node_parent[m]
            depth[m] = depth[p] + length[p]
        return depth

    def stats(self) -> dict:
        """Summary printed by `harts gen` (exact: siblings differ at their first token)."""
        lengths = np.diff(self.traj_offset)
        return {
            "batch_id": self.config.batch_id,
            "scheme": self.config.scheme,
            "tasks": self.config.tasks,
            "trajectories": self.num_trajectories,
            "nodes": int(self.node_parent.shape[0]),
            "unique_tokens": self.unique_tokens,
            "expanded_tokens": self.expanded_tokens,
            "compression_ideal": self.expanded_tokens / max(1, self.unique_tokens),
            "loss_tokens": int(self.loss_mask[self.traj_index].sum(dtype=np.int64)),
            "mean_trajectory_tokens": float(lengths.mean()),
            "max_trajectory_tokens": int(lengths.max()),
        }

    def to_json(self, form: str = "flat") -> dict:
        """The JSON input document (Python lists), flat trajectories or explicit trees."""
        return json.loads(self.dumps(form))

    def dumps(self, form: str = "flat") -> str:
        """The JSON input document as a string."""
        parts: list[str] = []
        self._write(parts.append, form, progress=False)
        return "".join(parts)

    def write_json(self, fp: IO[str], form: str = "flat", *, progress: bool = True) -> None:
        """Stream the JSON input document to `fp`; logs progress every few seconds when asked."""
        self._write(fp.write, form, progress=progress)

    def _write(self, write, form: str, *, progress: bool) -> None:
        if form not in ("flat", "tree"):
            raise ValueError(f"form: expected 'flat' or 'tree', got {form!r}")
        cfg = self.config
        write(f'{{"batch_id": {json.dumps(cfg.batch_id)}, "vocab_size": {cfg.vocab_size}, ')
        ids = self.traj_ids()
        task = self.node_task[self.traj_node]
        tick = _Progress(self.num_trajectories, enabled=progress)
        if form == "flat":
            write('"trajectories": [')
            for t in range(self.num_trajectories):
                idx = self.traj_index[self.traj_offset[t] : self.traj_offset[t + 1]]
                write(("" if t == 0 else ",\n") + "{" + self._traj_fields(t, ids[t], idx))
                write(f', "tree_id": {json.dumps(self.task_ids[task[t]])}, "tokens": [{_ints(self.tokens[idx])}]}}')
                tick(t + 1)
            write("]}\n")
            return
        write('"trees": [')
        local = np.zeros(self.node_parent.shape[0], np.int64)
        for a, name in enumerate(self.task_ids):
            nodes = np.flatnonzero(self.node_task == a)
            local[nodes] = np.arange(nodes.shape[0])
            write(("" if a == 0 else ",\n") + f'{{"id": {json.dumps(name)}, "nodes": [')
            for j, m in enumerate(nodes.tolist()):
                p = int(self.node_parent[m])
                toks = _ints(self.tokens[self.node_offset[m] : self.node_offset[m + 1]])
                parent = "null" if p < 0 else str(int(local[p]))
                write(("" if j == 0 else ", ") + f'{{"id": {j}, "parent": {parent}, "tokens": [{toks}]}}')
            write('], "trajectories": [')
            for j, t in enumerate(np.flatnonzero(task == a).tolist()):
                idx = self.traj_index[self.traj_offset[t] : self.traj_offset[t + 1]]
                write(("" if j == 0 else ", ") + "{" + self._traj_fields(t, ids[t], idx))
                write(f', "node": {int(local[self.traj_node[t]])}}}')
                tick(t + 1)
            write("]}")
        write("]}\n")

    def _traj_fields(self, t: int, tid: str, idx: np.ndarray) -> str:
        task = self.task_ids[self.node_task[self.traj_node[t]]]
        out = (
            f'"id": {json.dumps(tid)}, "group_id": {json.dumps(task)}, '
            f'"advantage": {_float(self.traj_advantage[t])}, "reward": {_float(self.traj_reward[t])}, '
            f'"loss_mask": [{_ints(self.loss_mask[idx])}]'
        )
        if self.old_logprobs is not None:
            out += f', "old_logprobs": [{",".join(self.old_logprobs[idx].astype(str).tolist())}]'
        return out


class _Progress:
    """Logs "k/n trajectories" at most every 2 s (stderr through logging)."""

    def __init__(self, total: int, *, enabled: bool):
        self.total, self.enabled = total, enabled
        self.t0 = self.last = time.perf_counter()

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.last >= 2.0 or (done == self.total and now - self.t0 >= 2.0):
            self.last = now
            log.info("gen: wrote %d/%d trajectories (%.0f s)", done, self.total, now - self.t0)


def _ints(a: np.ndarray) -> str:
    return ",".join(map(str, a.tolist()))


def _float(x) -> str:
    return repr(float(np.float32(x)))


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
    node_parent = np.asarray(s.node_parent, np.int32)
    node_task = np.asarray(s.node_task, np.int32)
    may_end = np.asarray(s.node_may_end, bool)
    node_rollout = np.asarray(s.node_rollout, np.int32)
    p_node = np.concatenate(s.piece_node)
    p_kind = np.concatenate(s.piece_kind)
    p_trained = np.concatenate(s.piece_trained)
    p_copy = np.concatenate(s.piece_copy)
    M, P = node_parent.shape[0], p_node.shape[0]

    # Lengths, one draw per kind in piece order; copies take their source's length.
    ranges = (cfg.system_tokens, cfg.task_tokens, None, cfg.observation_tokens, cfg.reasoning_tokens)
    p_len = np.zeros(P, np.int64)
    for kind in (SYSTEM, TASK, ACTION, OBSERVATION, REASONING):
        sel = np.flatnonzero((p_kind == kind) & (p_copy < 0))
        p_len[sel] = sample_lengths(len_rng, ranges[kind] or cfg.action_tokens, sel.shape[0], cfg.scale)
    is_copy = p_copy >= 0
    p_len[is_copy] = p_len[p_copy[is_copy]]

    # Depths, then truncation at the context limit and pruning of nodes no trajectory reaches.
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

    # Raw tokens: one stream for original pieces; copies read their source's range.
    raw_alloc = np.where(is_copy, 0, p_len)
    raw_start = np.cumsum(raw_alloc) - raw_alloc
    raw_start[is_copy] = raw_start[p_copy[is_copy]]
    raw = tok_rng.integers(0, cfg.vocab_size, size=int(raw_alloc.sum()), dtype=np.int32)
    # Siblings differ at their first token: child j of a parent gets (base_parent + j) mod vocab.
    kids = np.flatnonzero(useful & (node_parent >= 0))
    order = kids[np.argsort(node_parent[kids], kind="stable")]
    par = node_parent[order]
    rank = np.arange(order.shape[0]) - np.searchsorted(par, par)
    base = tok_rng.integers(0, cfg.vocab_size, size=M)
    first = node_first[order]
    assert not is_copy[first].any(), "a node's first piece must be an original piece"
    raw[raw_start[first]] = ((base[par] + rank) % cfg.vocab_size).astype(np.int32)

    # Kept pieces -> node tokens.
    keep = useful[p_node] & (p_keep_len > 0)
    k_len = p_keep_len[keep]
    k_off = np.concatenate([[0], np.cumsum(k_len)])
    N = int(k_off[-1])
    src = np.repeat(raw_start[keep] - k_off[:-1], k_len) + np.arange(N)
    tokens = raw[src]
    loss_mask = np.repeat(p_trained[keep].astype(np.uint8), k_len)
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

    # Trajectories: end nodes in order; paths by walking up, all trajectories at once.
    ends = np.flatnonzero(is_end)
    T = ends.shape[0]
    traj_node = new_id[ends].astype(np.int32)
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

    # Rewards per rollout, advantage = reward - the task's mean over its rollouts.
    rollout = np.where(node_rollout[ends] >= 0, node_rollout[ends], np.arange(T) + 10**9).astype(np.int64)
    uniq, traj_rollout = np.unique(rollout, return_inverse=True)
    ro_task = np.zeros(uniq.shape[0], np.int64)
    ro_task[traj_rollout] = node_task[ends]
    p_task = rew_rng.random(cfg.tasks)
    ro_reward = (rew_rng.random(uniq.shape[0]) < p_task[ro_task]).astype(np.float64)
    mean = np.bincount(ro_task, weights=ro_reward, minlength=cfg.tasks) / np.maximum(np.bincount(ro_task, minlength=cfg.tasks), 1)
    traj_reward = ro_reward[traj_rollout].astype(np.float32)
    traj_adv = (ro_reward - mean[ro_task])[traj_rollout].astype(np.float32)

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
