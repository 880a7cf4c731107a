"""The generator-side API (harts_client/rollouts.py) and examples/generator_submit.py against a real planner.

The example's stand-in engine produces vLLM-shaped outputs for multi-turn tool episodes; the same
episodes submitted as explicit trees and as flat trajectories must give the planner the same
forest (unique and expanded tokens, trajectories, loss tokens). The client and the generator API
import without torch.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from planner_service.ingest import forest_from_json
from planner_service.server import ServerProcess
from proto.arrays import unpack
from harts_client.client import PlannerClient
from harts_client.rollouts import RolloutBatchBuilder, RolloutTree, Trajectory, _radix, samples_from_sglang, samples_from_vllm

ROOT = Path(__file__).resolve().parents[2]


#: what a generator host need not have (`pip install 'harts[client]'`): imports of these fail in the child
BLOCKED = ("torch", "triton", "numba", "llvmlite", "fastapi", "starlette", "uvicorn", "grpc", "transformers")

_ISOLATED = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
import importlib, pkgutil
import harts_client
mods = sorted(m.name for m in pkgutil.walk_packages(harts_client.__path__, "harts_client."))
for name in mods:
    importlib.import_module(name)

from harts_client.rollouts import RolloutBatchBuilder, Trajectory, grpo_advantages
from harts_client.synthetic import WorkloadConfig, generate, generate_workload
from harts_client.timing import repeat

w = generate_workload(WorkloadConfig(scheme="tree", tasks=2, seed=3, scale=0.01, turns=(10, 12), vocab_size=64))
builder = RolloutBatchBuilder("iso", vocab_size=64)
for t in range(w.num_trajectories):
    tokens, mask = w.trajectory(t)
    cut = int(mask.argmax()) if mask.any() else len(tokens)
    traj = Trajectory(f"t{{t}}", tokens[:cut].tolist(), group_id="g")
    traj.add_completion(tokens[cut:].tolist(), [-0.5] * (len(tokens) - cut))
    builder.add(traj)
grpo_advantages(builder.trajectories)
tree_pb, flat_doc = builder.to_proto("tree"), builder.to_json("flat")
assert len(flat_doc["trajectories"]) == w.num_trajectories
assert sum(len(x["tokens"]) for x in flat_doc["trajectories"]) == w.expanded_tokens
doc = generate("group", 1, seed=0, scale=0.01, group_size=3, form="tree")
assert repeat(lambda: generate("percall", 1, seed=1, scale=0.01), 2).result["trajectories"]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r} and sys.modules[m] is not None)
assert not loaded, loaded
print(len(mods), len(tree_pb.SerializeToString()), len(doc["trees"]))
"""


def test_every_client_module_imports_and_generates_without_the_heavy_packages():
    """The generator install: every harts_client module imports, the synthetic generator and the
    batch builder run, with torch, numba, FastAPI, gRPC (and what they pull in) unimportable."""
    heavy = (*BLOCKED, "planner_service", "trainer", "kernels", "benchmarks", "harts_cli")
    code = _ISOLATED.format(blocked=BLOCKED, heavy=heavy)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    n_modules, pb_bytes, trees = map(int, out.stdout.split())
    assert n_modules >= 4 and pb_bytes > 0 and trees == 1


def test_the_client_extra_is_the_generator_install():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {d.split("==")[0] for d in project["dependencies"]}
    assert project["optional-dependencies"]["client"] == []  # the base set is the whole generator install
    assert not base & {*BLOCKED, "torch", "numba", "fastapi", "grpcio"}, base


def test_radix_nodes_rebuild_every_path_and_share_prefixes():
    paths = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2], [7], [1, 2, 3, 4]]
    nodes, ends = _radix(paths)
    parent = {n["id"]: n["parent"] for n in nodes}
    tokens = {n["id"]: n["tokens"] for n in nodes}
    for path, end in zip(paths, ends):
        rebuilt, cur = [], end
        while cur is not None:
            rebuilt = tokens[cur] + rebuilt
            cur = parent[cur]
        assert rebuilt == path
    assert sum(len(t) for t in tokens.values()) == 7  # 1 2 | 3 | 4 | 5 6 | 7: every distinct prefix token once
    assert ends[0] == ends[4]


def test_engine_adapters():
    out = SimpleNamespace(prompt_token_ids=[5, 6], outputs=[
        SimpleNamespace(token_ids=[7, 8], logprobs=[{7: SimpleNamespace(logprob=-0.1), 3: SimpleNamespace(logprob=-2.0)},
                                                    {8: SimpleNamespace(logprob=-0.2)}])])
    (s,) = samples_from_vllm(out)
    assert (s.prompt_ids, s.token_ids, s.logprobs) == ([5, 6], [7, 8], [-0.1, -0.2])
    s = samples_from_sglang({"meta_info": {"output_token_logprobs": [(-0.3, 9, "a"), (-0.4, 10, "b")]}}, [1])
    assert (s.token_ids, s.logprobs) == ([9, 10], [-0.3, -0.4])
    t = Trajectory.from_sample("x", s, group_id="g").add_observation([4]).add_completion([2], [-1.0])
    assert t.tokens == [1, 9, 10, 4, 2] and t.loss_mask == [0, 1, 1, 0, 1]
    assert t.old_logprobs() == [0.0, -0.3, -0.4, 0.0, -1.0]
    with pytest.raises(ValueError, match="logprobs: expected 2 values"):
        Trajectory("y", [1]).add_completion([1, 2], [-1.0])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("gen") / "planner.db").start()
    yield srv
    srv.stop()


@pytest.mark.integration
def test_example_generator_submits_both_forms_and_they_plan_the_same_forest(server):
    answers = {}
    for form, extra in (("tree", []), ("flat", ["--protobuf"])):
        out = subprocess.run([sys.executable, "examples/generator_submit.py", "--url", server.http_url, "--steps", "2",
                              "--form", form, "--batch-prefix", f"{form}-", "--world-size", "2", *extra],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        answers[form] = [json.loads(line) for line in out.stdout.splitlines()]
    for t, f in zip(answers["tree"], answers["flat"]):
        assert "fail" not in t["state"].lower() and "fail" not in f["state"].lower()
        assert (t["trajectories"], t["unique_tokens"], t["expanded_tokens"]) == (
            f["trajectories"], f["unique_tokens"], f["expanded_tokens"])
        assert t["trajectories"] == 6 and t["unique_tokens"] < t["expanded_tokens"]  # the shared prompts count once
    with PlannerClient(server.http_url) as c:
        for step in range(2):
            heads = [c.fetch_plan(f"{form}-{step}", 0, timeout=30).header for form in ("tree", "flat")]
            lengths = [dict(zip(h.trajectory_ids, unpack(h.trajectory_lengths, "int32").tolist())) for h in heads]
            assert lengths[0] == lengths[1]
            assert heads[0].normalizers.total_loss_tokens == heads[1].normalizers.total_loss_tokens > 0


@pytest.mark.integration
def test_explicit_tree_from_a_tree_search_generator(server):
    tree = RolloutTree("search-0")
    root = tree.node(None, [1, 2, 3, 4])
    a = tree.node(root, [5, 6], logprobs=[-0.5, -0.6])
    obs = tree.node(a, [7])
    b1 = tree.node(obs, [8, 9], logprobs=[-0.1, -0.2])
    b2 = tree.node(obs, [10], logprobs=[-0.3])
    tree.trajectory("s0", b1, advantage=1.0, reward=1.0, group_id="g")
    tree.trajectory("s1", b2, advantage=-1.0, reward=0.0, group_id="g")
    batch = RolloutBatchBuilder("search-step", vocab_size=256).add_tree(tree)
    doc = batch.to_json()
    nodes = doc["trees"][0]["nodes"]  # the compact form: per-position fields on the nodes, once per token
    assert [n["loss_mask"] for n in nodes] == [[0, 0, 0, 0], [1, 1], [0], [1, 1], [1]]
    assert [n["old_logprobs"] for n in nodes][3] == [-0.1, -0.2]
    assert "loss_mask" not in doc["trees"][0]["trajectories"][0] and "old_logprobs" not in doc["trees"][0]["trajectories"][0]
    forest = forest_from_json(doc)
    assert forest.loss_mask[:9].tolist() == [0, 0, 0, 0, 1, 1, 0, 1, 1]
    assert forest.old_logprobs[:9].tolist() == pytest.approx([0, 0, 0, 0, -0.5, -0.6, 0, -0.1, -0.2])
    with PlannerClient(server.http_url) as c:
        st = batch.submit(c, world_size=1, chunk_size=16, microbatch_tokens=64, no_windows=True)["status"]
    assert (st["trajectories"], st["unique_tokens"], st["expanded_tokens"]) == (2, 10, 17)


@pytest.mark.integration
def test_example_generator_plans_lock_step_phases_when_asked(server):
    from planner_service.transport import http_models

    if "lockstep" not in http_models.Topology.model_fields:
        pytest.skip("the HTTP topology has no lockstep field on this branch (the service wires it)")
    out = subprocess.run([sys.executable, "examples/generator_submit.py", "--url", server.http_url, "--steps", "1",
                          "--batch-prefix", "lockstep-", "--world-size", "2", "--lockstep"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "synthetic" in out.stderr
    with PlannerClient(server.http_url) as c:
        assert c.status("lockstep-0")["topology"]["lockstep"] is True
        assert c.fetch_plan("lockstep-0", 0, timeout=30).header.params.lockstep
