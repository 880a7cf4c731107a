"""Generator side: turn inference-engine outputs into a HARTS rollout batch and submit it.

    traj = Trajectory("task-7/s0", prompt_ids, group_id="task-7")    # prompt: context, no loss
    traj.add_completion(ids, logprobs)           # what the policy sampled: loss tokens, old log-probs
    traj.add_observation(tool_ids)               # a tool result / user turn: context, no loss
    batch = RolloutBatchBuilder("step-3", vocab_size=151936, policy_version=version); batch.add(traj)
    grpo_advantages(batch.trajectories)          # or set traj.advantage yourself
    batch.submit(client, form="tree", world_size=8, microbatch_tokens=65536, chunk_size=64)

Needs only numpy, protobuf and httpx. The forms, the engine adapters and `latest_export`:
docs/rollouts.md ("From a generator in Python"), docs/design/training-loop.md.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proto.arrays import pack
from proto.harts.v1 import rollouts_pb2

log = logging.getLogger(__name__)
_warned: list[bool] = []  # the missing-contract warning is logged once per process

__all__ = ["Sample", "Trajectory", "RolloutTree", "RolloutBatchBuilder", "grpo_advantages", "samples_from_vllm",
           "samples_from_sglang", "latest_export", "supports_policy_version"]


@dataclass(slots=True)
class Sample:
    """One engine completion: its prompt, the sampled ids and their log-probs under the sampling policy."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None = None
    """One per sampled token (None: the engine did not return them; the trainer then runs on-policy)."""


def samples_from_vllm(request_output) -> list[Sample]:
    """Samples of a vLLM `RequestOutput` (n completions of one prompt).

    Reads `prompt_token_ids` and, per `outputs[i]`, `token_ids` and `logprobs` (a list with one
    {token_id: Logprob(logprob=...)} per position, as vLLM returns with `SamplingParams(logprobs=k)`).
    """
    prompt = [int(t) for t in request_output.prompt_token_ids]
    out = []
    for comp in request_output.outputs:
        ids = [int(t) for t in comp.token_ids]
        lps = None
        if getattr(comp, "logprobs", None):
            lps = []
            for tok, entry in zip(ids, comp.logprobs):
                v = entry[tok]
                lps.append(float(getattr(v, "logprob", v)))
        out.append(Sample(prompt, ids, lps))
    return out


def samples_from_sglang(result: dict, prompt_ids: list[int]) -> Sample:
    """The Sample of one SGLang `/generate` answer (`return_logprob=True`).

    `meta_info.output_token_logprobs` is a list of (logprob, token_id, text) triples; `output_ids`
    is used for the ids when present.
    """
    meta = result.get("meta_info", {})
    triples = meta.get("output_token_logprobs") or []
    ids = [int(t) for t in (result.get("output_ids") or [t[1] for t in triples])]
    lps = [float(t[0]) for t in triples] if triples else None
    if lps is not None and len(lps) != len(ids):
        raise ValueError(f"meta_info.output_token_logprobs: expected {len(ids)} entries (one per output id), got {len(lps)}")
    return Sample([int(t) for t in prompt_ids], ids, lps)


@dataclass(slots=True)
class _Part:
    tokens: list[int]
    policy: bool
    logprobs: list[float] | None


def _f32(values) -> list[float]:
    """Floats as the float32 numbers the wire carries, spelled shortest in JSON (`-0.6931472`, not
    `-0.6931471824645996`): lossless for the float32 arrays ingest builds."""
    return [float(str(v)) for v in np.asarray(values, np.float32)]


class Trajectory:
    """One rollout as a sequence of parts: the prompt, then completions and observations in turn.

    Args:
        id: unique in the batch.
        prompt_ids: the first prompt (context: no loss).
        group_id: the sampling group (GRPO); also the default tree of `form="tree"`.
        tree_id: prefix-merging namespace (default: group_id).
    """

    def __init__(self, id: str, prompt_ids: list[int], *, group_id: str = "", tree_id: str | None = None):
        if not id:
            raise ValueError("id: expected a non-empty trajectory id, got ''")
        self.id = id
        self.group_id = group_id
        self.tree_id = tree_id if tree_id is not None else group_id
        self.parts: list[_Part] = []
        self.reward = 0.0
        self.advantage: float | list[float] = 0.0
        self.weight: float | None = None
        if prompt_ids:
            self.add_observation(prompt_ids)

    def add_completion(self, token_ids: list[int], logprobs: list[float] | None = None) -> "Trajectory":
        """Tokens the policy sampled (loss tokens) with their log-probs under the sampling policy."""
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"{self.id}: logprobs: expected {len(token_ids)} values (one per token), got {len(logprobs)}")
        self.parts.append(_Part([int(t) for t in token_ids], True, None if logprobs is None else _f32(logprobs)))
        return self

    def add_observation(self, token_ids: list[int]) -> "Trajectory":
        """Context tokens the policy did not produce (prompt, tool result, user turn): no loss."""
        self.parts.append(_Part([int(t) for t in token_ids], False, None))
        return self

    @classmethod
    def from_sample(cls, id: str, sample: Sample, **kw) -> "Trajectory":
        return cls(id, sample.prompt_ids, **kw).add_completion(sample.token_ids, sample.logprobs)

    @property
    def tokens(self) -> list[int]:
        return [t for p in self.parts for t in p.tokens]

    @property
    def loss_mask(self) -> list[int]:
        return [int(p.policy) for p in self.parts for _ in p.tokens]

    @property
    def has_logprobs(self) -> bool:
        return any(p.policy and p.logprobs is not None for p in self.parts)

    def old_logprobs(self) -> list[float]:
        """Per position: the sampling log-prob of policy tokens, 0.0 for context (not used by the loss)."""
        out: list[float] = []
        for p in self.parts:
            if p.policy and p.logprobs is None:
                raise ValueError(f"{self.id}: expected log-probs for every completion when any has them, got a completion without")
            out += p.logprobs if p.policy else [0.0] * len(p.tokens)
        return out

    def fields(self, with_logprobs: bool, *, per_position: bool = True) -> dict:
        """Per-trajectory JSON fields besides id/tokens/node (docs/rollouts.md); `per_position=False`
        leaves out loss_mask and old_logprobs (a compact tree's nodes carry them)."""
        d: dict = {"reward": float(self.reward), "advantage": self.advantage}
        if per_position:
            d["loss_mask"] = self.loss_mask
            if with_logprobs:
                d["old_logprobs"] = self.old_logprobs()
        if self.group_id:
            d["group_id"] = self.group_id
        if self.weight is not None:
            d["weight"] = float(self.weight)
        return d


class RolloutTree:
    """An explicit tree for generators that know their branching (tree search, forked turns).

        tree = RolloutTree("task-7")
        root = tree.node(None, prompt_ids)                        # context
        a = tree.node(root, ids_a, logprobs=lps_a)                # policy tokens
        tree.trajectory("task-7/a", a, advantage=1.0, reward=1.0)
    """

    def __init__(self, id: str):
        self.id = id
        self.nodes: list[dict] = []
        self._path: dict[int, list[_Part]] = {}
        self.trajectories: list[tuple[str, int, dict]] = []

    def node(self, parent: int | None, token_ids: list[int], *, logprobs: list[float] | None = None,
             policy: bool | None = None, observation: list[int] = ()) -> int:
        """Add a node continuing `parent` (None: a root); returns its id. `policy` (default: whether
        log-probs are given) marks sampled tokens (loss) versus context; `observation`: context
        tokens that follow them in the same node (the tool's answer to a sampled turn: one node
        per turn instead of two)."""
        if parent is not None and parent not in self._path:
            raise ValueError(f"tree {self.id}: parent: expected an existing node id, got {parent}")
        if not token_ids:
            raise ValueError(f"tree {self.id}: token_ids: expected at least one token, got none")
        policy = logprobs is not None if policy is None else policy
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError(f"tree {self.id}: logprobs: expected {len(token_ids)} values, got {len(logprobs)}")
        nid = len(self.nodes)
        self.nodes.append({"id": nid, "parent": parent, "tokens": [int(t) for t in [*token_ids, *observation]]})
        parts = [_Part([int(t) for t in token_ids], policy, None if logprobs is None else _f32(logprobs))]
        if len(observation):
            parts.append(_Part([int(t) for t in observation], False, None))
        self._path[nid] = ([] if parent is None else self._path[parent]) + parts
        return nid

    def trajectory(self, id: str, node: int, *, advantage: float | list[float] = 0.0, reward: float = 0.0,
                   group_id: str = "", weight: float | None = None) -> None:
        """The root-to-`node` path is trajectory `id`."""
        if node not in self._path:
            raise ValueError(f"tree {self.id}: node: expected an existing node id, got {node}")
        t = Trajectory(id, [], group_id=group_id, tree_id=self.id)
        t.parts = list(self._path[node])
        t.reward, t.advantage, t.weight = reward, advantage, weight
        self.trajectories.append((id, node, {"traj": t}))


def grpo_advantages(trajectories: list[Trajectory], *, scale_by_std: bool = True, eps: float = 1e-6) -> None:
    """Set each trajectory's scalar advantage to its reward minus its group's mean reward
    (divided by the group's std with `scale_by_std`, as GRPO does; Dr. GRPO: False). In place."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    for members in groups.values():
        r = np.array([t.reward for t in members], np.float64)
        a = r - r.mean()
        if scale_by_std:
            a = a / (r.std() + eps)
        for t, v in zip(members, _f32(a)):
            t.advantage = v


def supports_policy_version() -> bool:
    """Whether the wire contract (proto/harts/v1/rollouts.proto) has RolloutBatch.policy_version."""
    return "policy_version" in rollouts_pb2.RolloutBatch.DESCRIPTOR.fields_by_name


class RolloutBatchBuilder:
    """One training step's rollouts, sent flat or as explicit trees.

    Args:
        batch_id: the step id the trainer trains (idempotency key: resubmitting is safe).
        vocab_size: the policy's vocabulary size.
        policy_version: the trainer version (export `policy_version`) the rollouts were sampled with.
    """

    def __init__(self, batch_id: str, *, vocab_size: int, policy_version: int | None = None):
        if not batch_id:
            raise ValueError("batch_id: expected a non-empty step id, got ''")
        if vocab_size < 1:
            raise ValueError(f"vocab_size: expected >= 1, got {vocab_size}")
        self.batch_id = batch_id
        self.vocab_size = vocab_size
        self.policy_version = policy_version
        self.trajectories: list[Trajectory] = []
        self.trees: list[RolloutTree] = []

    def add(self, *trajectories: Trajectory) -> "RolloutBatchBuilder":
        self.trajectories.extend(trajectories)
        return self

    def add_tree(self, tree: RolloutTree) -> "RolloutBatchBuilder":
        """An explicit tree; it is sent as a tree in either form."""
        self.trees.append(tree)
        return self

    def _all(self) -> list[Trajectory]:
        return self.trajectories + [d["traj"] for tree in self.trees for _, _, d in tree.trajectories]

    def _with_logprobs(self) -> bool:
        flags = {t.has_logprobs for t in self._all()}
        if len(flags) > 1:
            raise ValueError("old_logprobs: expected log-probs on all trajectories or on none, got a mix")
        return flags == {True}

    def _head(self) -> dict:
        doc: dict = {"batch_id": self.batch_id, "vocab_size": self.vocab_size}
        if self.policy_version is not None:
            if supports_policy_version():
                doc["policy_version"] = int(self.policy_version)
            elif not _warned:
                _warned.append(True)
                log.warning("policy_version %s not sent: this planner contract has no RolloutBatch.policy_version "
                            "(staleness is then not bounded)", self.policy_version)
        return doc

    def to_json(self, form: str = "tree") -> dict:
        """The JSON document (docs/rollouts.md) in `form` "flat" or "tree"."""
        if form not in ("flat", "tree"):
            raise ValueError(f"form: expected 'flat' or 'tree', got {form!r}")
        if not self._all():
            raise ValueError("trajectories: expected at least one trajectory, got none")
        lp = self._with_logprobs()
        doc = self._head()
        trees = [self._tree_json(t.id, t.nodes, [(tid, node, d["traj"]) for tid, node, d in t.trajectories], lp)
                 for t in self.trees]
        if form == "tree":
            trees = [_compact(tree, lp) for tree in trees]
        if form == "flat":
            flat = []
            for t in self.trajectories:
                obj = {"id": t.id, "tokens": t.tokens, **t.fields(lp)}
                if t.tree_id:
                    obj["tree_id"] = t.tree_id
                flat.append(obj)
            if flat:
                doc["trajectories"] = flat
        else:
            by_tree: dict[str, list[Trajectory]] = {}
            for t in self.trajectories:
                by_tree.setdefault(t.tree_id or "default", []).append(t)
            for name, members in by_tree.items():
                nodes, ends = _radix([t.tokens for t in members])
                trees.append(_compact(self._tree_json(name, nodes, [(t.id, end, t) for t, end in zip(members, ends)], lp), lp))
        if trees:
            doc["trees"] = trees
        return doc

    @staticmethod
    def _tree_json(name: str, nodes: list[dict], trajs: list[tuple[str, int, Trajectory]], lp: bool) -> dict:
        return {"id": name, "nodes": nodes,
                "trajectories": [{"id": tid, "node": node, **t.fields(lp)} for tid, node, t in trajs]}


    def to_proto(self, form: str = "tree") -> rollouts_pb2.RolloutBatch:
        """The protobuf RolloutBatch (arrays as little-endian bytes) of `to_json(form)`."""
        doc = self.to_json(form)
        msg = rollouts_pb2.RolloutBatch(batch_id=doc["batch_id"], vocab_size=doc["vocab_size"])
        if "policy_version" in doc:
            msg.policy_version = doc["policy_version"]

        def fill(m, obj: dict) -> None:
            if "loss_mask" in obj:
                m.loss_mask = pack(obj["loss_mask"], "uint8")
            if "old_logprobs" in obj:
                m.old_logprobs = pack(obj["old_logprobs"], "float32")
            adv = obj["advantage"]
            if isinstance(adv, list):
                m.advantages = pack(adv, "float32")
            else:
                m.advantage = float(adv)
            m.reward = obj["reward"]
            m.group_id = obj.get("group_id", "")
            if "weight" in obj:
                m.weight = obj["weight"]

        for obj in doc.get("trajectories", []):
            m = msg.trajectories.add(id=obj["id"], tree_id=obj.get("tree_id", ""), tokens=pack(obj["tokens"], "int32"))
            fill(m, obj)
        for tree in doc.get("trees", []):
            tm = msg.trees.add(id=tree["id"])
            for n in tree["nodes"]:
                node = tm.nodes.add(id=n["id"], tokens=pack(n["tokens"], "int32"))
                if n["parent"] is not None:
                    node.parent = n["parent"]
                if "loss_mask" in n:
                    node.loss_mask = pack(n["loss_mask"], "uint8")
                if "old_logprobs" in n:
                    node.old_logprobs = pack(n["old_logprobs"], "float32")
            for obj in tree["trajectories"]:
                fill(tm.trajectories.add(id=obj["id"], node=obj["node"]), obj)
        return msg

    def submit(self, client, *, form: str = "tree", protobuf: bool = False, **topology) -> dict:
        """Submit with a `harts_client.client.PlannerClient` (idempotent by batch_id); `topology` plans it at once
        (world_size, microbatch_tokens, chunk_size, no_windows, ...). Returns the service's answer."""
        batch = self.to_proto(form) if protobuf else self.to_json(form)
        return client.submit(batch, **topology)


def _compact(tree: dict, with_logprobs: bool) -> dict:
    """The tree with loss_mask / old_logprobs moved from its trajectories onto its nodes (the compact
    form: a shared token's mask and sampled log-prob are sent once), when every trajectory through
    a node agrees on them (always for a RolloutTree; merged trajectories whose shared tokens were
    sampled separately may differ in the last float bit: that tree keeps the per-trajectory arrays).
    Nodes on no trajectory's path get context values (mask 0)."""
    nodes = tree["nodes"]
    index = {n["id"]: i for i, n in enumerate(nodes)}
    start = [0] * len(nodes)
    for i, n in enumerate(nodes):  # parents come before their children in both builders
        if n["parent"] is not None:
            p = index[n["parent"]]
            start[i] = start[p] + len(nodes[p]["tokens"])
    names = ("loss_mask", "old_logprobs") if with_logprobs else ("loss_mask",)
    values: list[dict] = [{} for _ in nodes]
    for traj in tree["trajectories"]:
        i = index[traj["node"]]
        while True:
            a, b = start[i], start[i] + len(nodes[i]["tokens"])
            for name in names:
                got = traj[name][a:b]
                if values[i].setdefault(name, got) != got:
                    return tree
            if nodes[i]["parent"] is None:
                break
            i = index[nodes[i]["parent"]]
    out_nodes = []
    for n, v in zip(nodes, values):
        length = len(n["tokens"])
        out_nodes.append({**n, **{name: v.get(name, [0] * length if name == "loss_mask" else [0.0] * length)
                                  for name in names}})
    trajs = [{k: v for k, v in t.items() if k not in names} for t in tree["trajectories"]]
    return {"id": tree["id"], "nodes": out_nodes, "trajectories": trajs}


def _radix(paths: list[list[int]]) -> tuple[list[dict], list[int]]:
    """Explicit-tree nodes of token paths (equal prefixes merged, unbranched runs as one node) and
    the node each path ends at. A path that ends inside another's node splits that node there."""
    trie: list[dict] = [{}]  # token -> child index; node 0 is a virtual root
    tok: list[int] = [-1]
    end_at: list[int] = []
    for path in paths:
        cur = 0
        for t in path:
            nxt = trie[cur].get(t)
            if nxt is None:
                nxt = len(trie)
                trie[cur][t] = nxt
                trie.append({})
                tok.append(t)
            cur = nxt
        end_at.append(cur)
    ends = set(end_at)
    nodes: list[dict] = []
    node_of: dict[int, int] = {}
    stack = [(child, None) for child in reversed(list(trie[0].values()))]
    while stack:
        start, parent = stack.pop()
        run, cur = [tok[start]], start
        while len(trie[cur]) == 1 and cur not in ends:
            cur = next(iter(trie[cur].values()))
            run.append(tok[cur])
        nid = len(nodes)
        nodes.append({"id": nid, "parent": parent, "tokens": run})
        node_of[cur] = nid
        stack.extend((child, nid) for child in reversed(list(trie[cur].values())))
    return nodes, [node_of[e] for e in end_at]


def latest_export(root: str | Path) -> tuple[Path, int] | None:
    """(directory, policy_version) of the trainer's newest export under `root`, None before the first.

    The trainer writes `root/latest` last, atomically, after the export directory is complete.
    """
    pointer = Path(root) / "latest"
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    meta = json.loads((path / "harts.json").read_text())
    return path, int(meta["policy_version"])

