"""GRPO tree sampling: the policy plays a task's episodes, branching at turn boundaries.

    from harts_client.tree_sampling import SamplingConfig, sample_batch
    groups = sample_batch(engine, task, tokenizer, instances, SamplingConfig(branching=[4, 2]), seed=7)
    batch = to_batch(groups, "step-7", vocab_size=256, policy_version=engine.policy_version)
    batch.submit(client, form="tree", world_size=2, chunk_size=16)

Per task instance one explicit `RolloutTree`: the prompt is the root; at policy turn t every open
branch samples `branching[t]` completions (1 after the list ends), so the k samples of a turn share
everything before it (prompt, earlier turns, tool observations) and the tree holds each of those
tokens once. A completion and the task's observation after it (`Task.observe`) are one node: the
policy tokens with the engine's log-probs (the policy's real sampling log-probs, the PPO old
log-probs; loss mask 1), then the observation (context, mask 0); the next turn samples from there.
A branch ends when the task says so, when the policy did not finish its turn within
`max_new_tokens`, or after `Task.max_turns`.
Samples of a turn that equal a sibling's (the same ids after the same context) are one node with
one log-prob per token, so the tree holds each distinct token once; branches continue from it
separately. Every leaf is a trajectory (equal episodes are equal trajectories, each counted);
its reward is `reward_fn(episode)` (default `Task.reward`), and the instance's trajectories form
one GRPO group (advantage = (reward - group mean) / group std).

All open branches of a turn are sampled in one engine call (n = branching[t] per branch), so a
batch costs `Task.max_turns` engine calls. The seed of turn t is derived from `seed` and t: a
batch is reproducible given the engine's weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harts_client.rollouts import RolloutBatchBuilder, RolloutTree, grpo_advantages
from harts_client.tasks import Episode, RewardFn, Task, Turn

__all__ = ["SamplingConfig", "SampledGroup", "sample_batch", "to_batch", "batch_stats"]


@dataclass(slots=True, kw_only=True)
class SamplingConfig:
    """How episodes are sampled."""

    branching: list[int] = field(default_factory=lambda: [4, 2])
    """Completions per open branch at policy turn t (turns past the list: 1). Trajectories per
    instance = the product (fewer when episodes end early)."""
    max_new_tokens: int = 16
    """Longest policy turn in tokens; a turn cut there ends its episode."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy). The trainer's log-probs are at temperature 1."""
    scale_by_std: bool = True
    """GRPO: divide the group-centred rewards by the group's std (False: Dr. GRPO)."""

    def __post_init__(self) -> None:
        if not self.branching or any(k < 1 for k in self.branching):
            raise ValueError(f"branching: expected a non-empty list of counts >= 1, got {self.branching}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0 (0: greedy), got {self.temperature}")


@dataclass(slots=True)
class SampledGroup:
    """The episodes of one instance and the explicit tree that holds them."""

    instance: object
    prompt_ids: list[int]
    tree: RolloutTree
    episodes: list[Episode]
    rewards: list[float]


@dataclass(slots=True)
class _Open:
    group: int
    node: int
    context: list[int]
    turns: list[Turn]


def sample_batch(engine, task: Task, tokenizer, instances: list, cfg: SamplingConfig, *, seed: int,
                 reward_fn: RewardFn | None = None, id_prefix: str = "") -> list[SampledGroup]:
    """Play every instance as a tree of episodes (see the module docstring).

    Args:
        engine: a `harts_client.engines.Engine`.
        tokenizer: encodes prompts and observations; its eos id ends a policy turn.
        id_prefix: prefix of tree ids ("<prefix><instance id>") and trajectory ids.
    """
    reward_fn = reward_fn or task.reward
    eos = tokenizer.eos_id
    groups: list[SampledGroup] = []
    frontier: list[_Open] = []
    for g, inst in enumerate(instances):
        prompt = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(task.prompt(inst))
        tree = RolloutTree(f"{id_prefix}{getattr(inst, 'id', g)}")
        root = tree.node(None, prompt, policy=False)
        groups.append(SampledGroup(inst, prompt, tree, [], []))
        frontier.append(_Open(g, root, prompt, []))
    seen: dict[tuple[int, int, tuple[int, ...]], tuple[Turn, int]] = {}
    for t in range(task.max_turns):
        if not frontier:
            break
        k = cfg.branching[t] if t < len(cfg.branching) else 1
        outs = engine.generate([o.context for o in frontier], n=k, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, seed=int(seed) * 64 + t, stop_ids=[eos])
        nxt: list[_Open] = []
        for o, completions in zip(frontier, outs):
            group = groups[o.group]
            for c in completions:
                key = (o.group, o.node, tuple(c.token_ids))
                if key in seen:  # a sample equal to a sibling's: the same node (the same context, log-probs, tool answer)
                    turn, node = seen[key]
                else:
                    turn = Turn(list(c.token_ids), list(c.logprobs), tokenizer.decode(c.token_ids))
                    obs = task.observe(group.instance, [u.text for u in o.turns] + [turn.text]) if c.finished else None
                    if obs is not None:
                        turn.observation, turn.observation_ids = obs, tokenizer.encode(obs)
                    node = group.tree.node(o.node, c.token_ids, logprobs=c.logprobs, observation=turn.observation_ids)
                    seen[key] = (turn, node)
                turns = o.turns + [turn]
                if turn.observation is None:
                    group.episodes.append(Episode(group.instance, group.prompt_ids, turns))
                    group.tree.trajectory(f"{group.tree.id}/{len(group.episodes) - 1}", node, group_id=group.tree.id)
                else:
                    nxt.append(_Open(o.group, node, o.context + turn.token_ids + turn.observation_ids, turns))
        frontier = nxt
    for group in groups:
        trajs = [d["traj"] for _, _, d in group.tree.trajectories]
        for ep, traj in zip(group.episodes, trajs):
            r = float(reward_fn(ep))
            if not np.isfinite(r):
                raise ValueError(f"reward of {traj.id}: expected a finite number, got {r}")
            traj.reward = r
            group.rewards.append(r)
        grpo_advantages(trajs, scale_by_std=cfg.scale_by_std)
    return groups


def _context_len(turns: list[Turn]) -> int:
    """Tokens the turns (and their observations) add after the prompt."""
    return sum(len(u.token_ids) + len(u.observation_ids) for u in turns)


def to_batch(groups: list[SampledGroup], batch_id: str, *, vocab_size: int, policy_version: int | None) -> RolloutBatchBuilder:
    """The step's rollout batch: one explicit tree per instance."""
    batch = RolloutBatchBuilder(batch_id, vocab_size=vocab_size, policy_version=policy_version)
    for group in groups:
        batch.add_tree(group.tree)
    return batch


def batch_stats(groups: list[SampledGroup], seconds: float | None = None) -> dict:
    """Reward mean/std, trajectory and token counts of a sampled batch (for the metrics)."""
    rewards = np.asarray([r for g in groups for r in g.rewards], np.float64)
    nodes = [n for g in groups for n in g.tree.nodes]
    expanded = sum(len(ep.prompt_ids) + _context_len(ep.turns) for g in groups for ep in g.episodes)
    out = {"rollout_reward_mean": float(rewards.mean()) if rewards.size else 0.0,
           "rollout_reward_std": float(rewards.std()) if rewards.size else 0.0,
           "rollout_trajectories": int(rewards.size), "rollout_unique_tokens": sum(len(n["tokens"]) for n in nodes),
           "rollout_expanded_tokens": int(expanded),
           "rollout_turns_mean": float(np.mean([len(ep.turns) for g in groups for ep in g.episodes])) if rewards.size else 0.0}
    if seconds is not None:
        out["rollout_seconds"] = seconds
    return out

