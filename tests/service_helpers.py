"""Shared helpers of the planner-service tests: small rollout documents and a loopback server."""
from __future__ import annotations

import numpy as np

TOPOLOGY = {"world_size": 2, "microbatch_tokens": 128, "chunk_size": 16}
"""A topology small enough to plan in milliseconds."""


def rollout_doc(batch_id: str, *, seed: int = 0, trajectories: int = 6, vocab: int = 64) -> dict:
    """A flat rollout document: `trajectories` rollouts of 30-90 tokens sharing a 24-token prompt
    (two groups that also share a few turns), with loss masks, old log-probs and advantages."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, 24).tolist()
    turns = [rng.integers(0, vocab, int(rng.integers(4, 20))).tolist() for _ in range(2)]
    out = []
    for i in range(trajectories):
        tail = rng.integers(0, vocab, int(rng.integers(6, 60))).tolist()
        tokens = prompt + turns[i % 2] + tail
        mask = [0] * (len(prompt) + len(turns[i % 2])) + [1] * len(tail)
        out.append({
            "id": f"{batch_id}-t{i}",
            "tree_id": "task-0",
            "tokens": tokens,
            "loss_mask": mask,
            "old_logprobs": np.round(-rng.random(len(tokens)), 4).tolist(),
            "advantage": float(np.round(rng.normal(), 4)),
            "group_id": "g0",
        })
    return {"batch_id": batch_id, "vocab_size": vocab, "trajectories": out}
