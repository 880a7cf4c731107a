"""GRPO tree sampling: the policy plays a task's episodes, branching at turn boundaries.

    groups = sample_batch(engine, task, tokenizer, instances, SamplingConfig(branching=[4, 2]), seed=7)
    batch = to_batch(groups, "step-7", vocab_size=256, policy_version=engine.policy_version)
    batch.submit(client, form="tree", world_size=2, chunk_size=16)

One explicit tree per instance (or one for the batch with `shared_prefix`), equal samples merged,
one GRPO group per instance, one engine call per turn: docs/design/training-loop.md ("Tree
sampling").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from harts_client.chat import as_format, as_messages
from harts_client.rollouts import RolloutBatchBuilder, RolloutTree, grpo_advantages
from harts_client.tasks import Episode, Message, RewardFn, Task, Turn

log = logging.getLogger(__name__)

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
    shared_prefix: bool = False
    """One tree for the whole batch whose root is the prompt prefix every instance shares (a long
    system prompt: computed once per batch, not once per instance); False: one tree per instance."""

    def __post_init__(self) -> None:
        if not self.branching or any(k < 1 for k in self.branching):
            raise ValueError(f"branching: expected a non-empty list of counts >= 1, got {self.branching}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0 (0: greedy), got {self.temperature}")


@dataclass(slots=True)
class SampledGroup:
    """The episodes of one instance (a GRPO group) and the explicit tree that holds them (the
    instance's own, or with `shared_prefix` the batch's, which holds every group)."""

    id: str
    instance: object
    prompt_ids: list[int]
    tree: RolloutTree
    episodes: list[Episode] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    trajectories: list = field(default_factory=list)
    """The group's `harts_client.rollouts.Trajectory`s, one per episode."""


@dataclass(slots=True)
class _Open:
    group: int
    node: int
    context: list[int]
    turns: list[Turn]
    messages: list[Message]
    """The branch's conversation (what a chat template renders the next observation after)."""


def sample_batch(engine, task: Task, tokenizer, instances: list, cfg: SamplingConfig, *, seed: int,
                 reward_fn: RewardFn | None = None, id_prefix: str = "") -> list[SampledGroup]:
    """Play every instance as a tree of episodes (docs/design/training-loop.md, "Tree sampling").

    Args:
        engine: a `harts_client.engines.Engine`.
        tokenizer: a `harts_client.chat` conversation format (plain text or a chat template), or a
            tokenizer (plain text): renders prompts and observations; its stop ids end a policy turn.
        id_prefix: prefix of tree ids ("<prefix><instance id>") and trajectory ids.
    """
    fmt = as_format(tokenizer)
    reward_fn = reward_fn or task.reward
    firsts = [task.prompt(inst) for inst in instances]
    prompts = [fmt.prompt_ids(first) for first in firsts]
    shared = _common_prefix(prompts) if cfg.shared_prefix and len(prompts) > 1 else 0
    batch_tree = RolloutTree(f"{id_prefix}batch") if shared else None
    batch_root = batch_tree.node(None, prompts[0][:shared], policy=False) if shared else None
    groups: list[SampledGroup] = []
    frontier: list[_Open] = []
    rests: dict[tuple[int, ...], int] = {}  # shared tree: one node per distinct rest of a prompt
    for g, (inst, first, prompt) in enumerate(zip(instances, firsts, prompts)):
        gid = f"{id_prefix}{getattr(inst, 'id', g)}"
        if batch_tree is None:
            tree = RolloutTree(gid)
            root = tree.node(None, prompt, policy=False)
        else:
            tree, rest = batch_tree, tuple(prompt[shared:])
            if rest and rest not in rests:
                rests[rest] = tree.node(batch_root, list(rest), policy=False)
            root = rests[rest] if rest else batch_root
        groups.append(SampledGroup(gid, inst, prompt, tree))
        frontier.append(_Open(g, root, prompt, [], as_messages(first, "user")))
    seen: dict[tuple[int, int, tuple[int, ...]], tuple[Turn, int]] = {}
    for t in range(task.max_turns):
        if not frontier:
            break
        k = cfg.branching[t] if t < len(cfg.branching) else 1
        log.debug("turn %d: %d open branch(es) x %d sample(s)", t + 1, len(frontier), k)
        outs = engine.generate([o.context for o in frontier], n=k, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.temperature, seed=int(seed) * 64 + t, stop_ids=fmt.stop_ids)
        nxt: list[_Open] = []
        for o, completions in zip(frontier, outs):
            group = groups[o.group]
            for c in completions:
                key = (o.group, o.node, tuple(c.token_ids))
                if key in seen:  # a sample equal to a sibling's: the same node (the same context, log-probs, tool answer)
                    turn, node = seen[key]
                else:
                    turn = Turn(list(c.token_ids), list(c.logprobs), fmt.decode(c.token_ids))
                    obs = task.observe(group.instance, [u.text for u in o.turns] + [turn.text]) if c.finished else None
                    if obs is not None:
                        said = o.messages + [{"role": "assistant", "content": turn.text}]
                        turn.observation = obs
                        turn.observation_ids = fmt.observation_ids(said, obs, c.token_ids[-1])
                    node = group.tree.node(o.node, c.token_ids, logprobs=c.logprobs, observation=turn.observation_ids)
                    seen[key] = (turn, node)
                turns = o.turns + [turn]
                if turn.observation is None:
                    group.episodes.append(Episode(group.instance, group.prompt_ids, turns))
                    group.tree.trajectory(f"{group.id}/{len(group.episodes) - 1}", node, group_id=group.id)
                    group.trajectories.append(group.tree.trajectories[-1][2]["traj"])
                else:
                    messages = o.messages + [{"role": "assistant", "content": turn.text}, *as_messages(turn.observation, "tool")]
                    nxt.append(_Open(o.group, node, o.context + turn.token_ids + turn.observation_ids, turns, messages))
        frontier = nxt
    for group in groups:
        trajs = group.trajectories
        for ep, traj in zip(group.episodes, trajs):
            r = float(reward_fn(ep))
            if not np.isfinite(r):
                raise ValueError(f"reward of {traj.id}: expected a finite number, got {r}")
            traj.reward = r
            group.rewards.append(r)
        grpo_advantages(trajs, scale_by_std=cfg.scale_by_std)
    return groups


def _common_prefix(seqs: list[list[int]]) -> int:
    """Length of the longest prefix all `seqs` share."""
    n = min(len(s) for s in seqs)
    first = seqs[0]
    for s in seqs[1:]:
        k = 0
        while k < n and s[k] == first[k]:
            k += 1
        n = k
    return n


def _trees(groups: list[SampledGroup]) -> list[RolloutTree]:
    """The distinct trees of a batch (one per group, or the one shared tree)."""
    return list({id(g.tree): g.tree for g in groups}.values())


def _context_len(turns: list[Turn]) -> int:
    """Tokens the turns (and their observations) add after the prompt."""
    return sum(len(u.token_ids) + len(u.observation_ids) for u in turns)


def to_batch(groups: list[SampledGroup], batch_id: str, *, vocab_size: int, policy_version: int | None) -> RolloutBatchBuilder:
    """The step's rollout batch: one explicit tree per instance (or the batch's shared tree)."""
    batch = RolloutBatchBuilder(batch_id, vocab_size=vocab_size, policy_version=policy_version)
    for tree in _trees(groups):
        batch.add_tree(tree)
    return batch


def batch_stats(groups: list[SampledGroup], seconds: float | None = None) -> dict:
    """Reward mean/std, trajectory and token counts of a sampled batch (for the metrics)."""
    rewards = np.asarray([r for g in groups for r in g.rewards], np.float64)
    nodes = [n for tree in _trees(groups) for n in tree.nodes]
    expanded = sum(len(ep.prompt_ids) + _context_len(ep.turns) for g in groups for ep in g.episodes)
    out = {"rollout_reward_mean": float(rewards.mean()) if rewards.size else 0.0,
           "rollout_reward_std": float(rewards.std()) if rewards.size else 0.0,
           "rollout_trajectories": int(rewards.size), "rollout_unique_tokens": sum(len(n["tokens"]) for n in nodes),
           "rollout_expanded_tokens": int(expanded),
           "rollout_turns_mean": float(np.mean([len(ep.turns) for g in groups for ep in g.episodes])) if rewards.size else 0.0}
    if seconds is not None:
        out["rollout_seconds"] = seconds
    return out

