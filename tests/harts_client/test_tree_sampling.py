"""GRPO tree sampling (harts_client.tree_sampling): trees that branch at turn boundaries, with the
engine's log-probs on the policy nodes, GRPO advantages per instance, and the compact wire form
that ingest turns into the same forest as the flat trajectories of the same episodes."""
from __future__ import annotations

import numpy as np
import pytest

from harts_client.engines import Completion
from harts_client.tasks import make_task
from harts_client.tokenizer import ByteTokenizer
from harts_client.tree_sampling import SamplingConfig, batch_stats, sample_batch, to_batch
from planner_service.ingest import forest_from_json, forest_from_proto


class ScriptedEngine:
    """A stand-in engine: seeded random "up"/"down"/garbage turns with made-up log-probs."""

    policy_version = 3
    model_dir = None

    def __init__(self, words=("up", "down", "sideways")):
        self.calls: list[tuple[int, int]] = []
        self.words = list(words)

    def reload(self) -> bool:
        return False

    def generate(self, prompts, *, n, max_new_tokens, temperature, seed, stop_ids):
        self.calls.append((len(prompts), n))
        rng = np.random.default_rng(seed)
        tok = ByteTokenizer()
        out = []
        for _ in prompts:
            comps = []
            for _ in range(n):
                text = self.words[int(rng.integers(0, len(self.words)))]
                ids = (tok.encode(text) + [stop_ids[0]])[:max_new_tokens]
                comps.append(Completion(ids, (-rng.random(len(ids))).tolist(), ids[-1] == stop_ids[0]))
            out.append(comps)
        return out


def _sample(branching=(4, 2), tasks=3, seed=0):
    task = make_task("seek", size=6)
    engine = ScriptedEngine()
    groups = sample_batch(engine, task, ByteTokenizer(), task.instances("train", tasks, seed=seed),
                          SamplingConfig(branching=list(branching), max_new_tokens=6), seed=seed)
    return task, engine, groups


def test_trees_branch_at_turn_boundaries_and_share_what_came_before():
    task, engine, groups = _sample()
    assert engine.calls[0] == (3, 4) and engine.calls[1][1] == 2  # one engine call per turn, n = branching[t]
    assert all(n == 1 for _, n in engine.calls[2:]) and len(engine.calls) <= task.max_turns
    for g in groups:
        assert len(g.episodes) == len(g.tree.trajectories) == len(g.rewards)
        assert len(g.episodes) <= 8 and len({tuple(ep.turns[0].token_ids) for ep in g.episodes}) <= 4
        nodes = g.tree.nodes
        assert nodes[0]["parent"] is None and sum(n["parent"] is None for n in nodes) == 1
        for ep, (_, node, _) in zip(g.episodes, g.tree.trajectories):
            path = []
            while node is not None:
                path = nodes[node]["tokens"] + path
                node = nodes[node]["parent"]
            assert path == ep.prompt_ids + [t for turn in ep.turns for t in turn.token_ids + turn.observation_ids]
            assert g.rewards[g.episodes.index(ep)] == task.reward(ep)
            assert ep.turns[-1].observation is None  # the episode ended after its last turn


def test_grpo_advantages_per_instance():
    _, _, groups = _sample(tasks=6)
    for g in groups:
        trajs = [d["traj"] for _, _, d in g.tree.trajectories]
        r = np.array(g.rewards)
        adv = np.array([t.advantage for t in trajs])
        expect = (r - r.mean()) / (r.std() + 1e-6)
        assert adv == pytest.approx(expect)
        assert [t.group_id for t in trajs] == [g.tree.id] * len(trajs)


def test_compact_tree_batch_builds_the_forest_of_its_flat_trajectories():
    _, _, groups = _sample(tasks=4, seed=2)
    batch = to_batch(groups, "step-0", vocab_size=256, policy_version=3)
    doc = batch.to_json("tree")
    assert doc["policy_version"] == 3
    for tree in doc["trees"]:
        assert all("loss_mask" in n and "old_logprobs" in n for n in tree["nodes"])
        assert not any("loss_mask" in t or "old_logprobs" in t for t in tree["trajectories"])
    flat = {"batch_id": "step-0", "vocab_size": 256, "policy_version": 3, "trajectories": []}
    for g in groups:
        for _, _, d in g.tree.trajectories:
            t = d["traj"]
            flat["trajectories"].append({"id": t.id, "tree_id": g.tree.id, "tokens": t.tokens, **t.fields(True)})
    a, b, c = forest_from_json(doc), forest_from_json(flat), forest_from_proto(batch.to_proto("tree").SerializeToString())
    for f in (b, c):
        assert f.traj_ids == a.traj_ids and f.unique_tokens == a.unique_tokens and f.expanded_tokens == a.expanded_tokens
        assert np.array_equal(f.loss_mask, a.loss_mask) and np.array_equal(f.advantages, a.advantages)
        assert np.array_equal(f.old_logprobs, a.old_logprobs) and np.array_equal(f.reward, a.reward)
    stats = batch_stats(groups, 1.5)
    assert stats["rollout_trajectories"] == len(a.traj_ids) and stats["rollout_expanded_tokens"] == a.expanded_tokens
    assert stats["rollout_unique_tokens"] == a.unique_tokens and stats["rollout_seconds"] == 1.5
    # the compact form is smaller on the wire than the per-trajectory tree form and than flat trajectories
    import json

    per_trajectory = sum(len(t.tokens) for g in groups for _, _, d in g.tree.trajectories for t in [d["traj"]])
    assert len(json.dumps(doc)) < len(json.dumps(flat)) and per_trajectory == a.expanded_tokens


def test_unfinished_turns_end_their_episode_and_user_rewards_are_used():
    task = make_task("seek", size=6)
    engine = ScriptedEngine()
    groups = sample_batch(engine, task, ByteTokenizer(), task.instances("train", 2, seed=0),
                          SamplingConfig(branching=[2], max_new_tokens=1), seed=0, reward_fn=lambda ep: 0.25)
    for g in groups:  # one token per turn never reaches eos: every episode ends after its first turn
        assert len(g.episodes) == 2 and all(len(ep.turns) == 1 for ep in g.episodes)
        assert g.rewards == [0.25, 0.25]
    with pytest.raises(ValueError, match="finite"):
        sample_batch(engine, task, ByteTokenizer(), task.instances("train", 1, seed=0),
                     SamplingConfig(branching=[1]), seed=0, reward_fn=lambda ep: float("nan"))


def test_sampling_config_validation():
    for bad in (dict(branching=[]), dict(branching=[0]), dict(max_new_tokens=0), dict(temperature=-1)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)


def test_shared_prefix_puts_the_batch_in_one_tree_rooted_at_the_common_prompt():
    """With shared_prefix the prompt prefix every instance shares is one root node (a system prompt
    computed once per batch); groups, advantages and trajectories stay per instance, and the batch
    builds the forest its flat trajectories build (one tree_id)."""
    task = make_task("seek", size=6, random_start=True)
    insts = task.instances("train", 4, seed=1)
    cfg = SamplingConfig(branching=[2, 2], max_new_tokens=6, shared_prefix=True)
    groups = sample_batch(ScriptedEngine(), task, ByteTokenizer(), insts, cfg, seed=3, id_prefix="s0/")
    tree = groups[0].tree
    assert all(g.tree is tree for g in groups) and tree.id == "s0/batch"
    common = b"Find the hidden number 0-5. Move with 'up' or 'down'.\nat "
    assert tree.nodes[0]["parent"] is None and tree.nodes[0]["tokens"] == [1] + list(common)
    rests = {tuple(g.prompt_ids[len(common) + 1:]) for g in groups}
    assert sum(n["parent"] == 0 for n in tree.nodes if n["tokens"] and tuple(n["tokens"]) in rests) == len(rests)
    for g in groups:
        r = np.array(g.rewards)
        adv = np.array([t.advantage for t in g.trajectories])
        assert adv == pytest.approx((r - r.mean()) / (r.std() + 1e-6))
        assert {t.group_id for t in g.trajectories} == {g.id} and all(t.id.startswith(g.id + "/") for t in g.trajectories)
    batch = to_batch(groups, "step-0", vocab_size=256, policy_version=0)
    doc = batch.to_json("tree")
    assert len(doc["trees"]) == 1
    flat = {"batch_id": "step-0", "vocab_size": 256, "policy_version": 0,
            "trajectories": [{"id": t.id, "tree_id": "all", "tokens": t.tokens, **t.fields(True)}
                             for g in groups for t in g.trajectories]}
    a, b = forest_from_json(doc), forest_from_json(flat)
    assert sorted(a.traj_ids) == sorted(t.id for g in groups for t in g.trajectories)
    assert a.expanded_tokens == b.expanded_tokens  # flat merges equal samples of different groups too
    alone = sample_batch(ScriptedEngine(), task, ByteTokenizer(), insts, SamplingConfig(branching=[2, 2], max_new_tokens=6),
                         seed=3, id_prefix="s0/")
    separate = forest_from_json(to_batch(alone, "step-0", vocab_size=256, policy_version=0).to_json("tree"))
    saved = (len(insts) - 1) * (1 + len(common)) + sum(len(g.prompt_ids) - 1 - len(common) for g in groups)
    saved -= sum(len(r) for r in rests)  # equal prompts share their rest too
    assert separate.expanded_tokens == a.expanded_tokens and a.unique_tokens == separate.unique_tokens - saved
