"""A generated batch of synthetic rollouts as flat arrays, and its JSON input document.

    w = generate_workload(cfg)           # harts_client.synthetic
    w.stats(); w.dumps("tree"); w.write_json(fp, "flat")

Legend: M nodes, P pieces, N distinct node tokens, T trajectories, N_e expanded tokens.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import IO

import numpy as np

log = logging.getLogger("harts_client.synthetic")  # the generator's logger: `harts gen` progress lines as before


@dataclass(slots=True, kw_only=True)
class Workload:
    """A generated batch as flat arrays: the rollout trees (nodes) and the trajectories."""

    config: object
    """The `harts_client.synthetic.WorkloadConfig` it was generated from (batch_id, scheme, tasks, vocab_size)."""
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
