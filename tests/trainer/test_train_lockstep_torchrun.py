"""`trainer.train` on the planner's lock-step plans: torchrun on gloo, parameters sharded through the step.

A real `harts serve` plans the same small batches three ways: lock-step for 2 and 4 ranks with a
small memory budget (sharing windows, recomputed window parents, and in the tree batch a window
opened above an unrelated open window), and free for 1 rank (the reference) and 2 ranks. torchrun
trains with `parallelism.reshard_after_forward = true`; the first moment AdamW checkpoints after
each step is (1 - beta1) x the step gradient (plus beta1 x the previous one), so it must equal
that of a plain single-process loop over the world-size-1 plans (relative difference <= 1e-6).
Given the free plan, the same trainer stops before any collective with an error naming the field.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harts_client.client import PlannerClient
from harts_client.synthetic import generate
from planner_service.server import ServerProcess
from trainer import checkpoint
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.optim import make_optimizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "lockstep-token"
C = 16
LR = 1e-3
SEED = 3
#: a tree-sampled batch (its 2-rank lock-step plan opens a window above an unrelated one) and a per-call one
DOCS = [dict(scheme="tree", tasks=2, seed=2), dict(scheme="percall", tasks=2, seed=1)]
LOCKSTEP = {"microbatch_tokens": 64, "chunk_size": C, "memory_tokens": 96, "lockstep": True}
FREE = {"microbatch_tokens": 64, "chunk_size": C}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("lockstep") / "planner.db", token=TOKEN).start()
    with PlannerClient(srv.http_url, token=TOKEN) as c:
        for i, knobs in enumerate(DOCS):
            doc = generate(**knobs, scale=0.01, turns=(2, 3), old_logprobs=True)
            for prefix, ws, topo in (("ls2", 2, LOCKSTEP), ("ls4", 4, LOCKSTEP), ("free1", 1, FREE), ("free2", 2, FREE)):
                doc["batch_id"] = f"{prefix}-{i}"
                c.submit(doc, world_size=ws, **topo)
    yield srv
    srv.stop()


def _slices(server, step: str, world: int):
    with PlannerClient(server.http_url, token=TOKEN) as c:
        return [c.fetch_plan(step, r, timeout=60) for r in range(world)]


def _opens_above_an_unrelated_window(rank) -> bool:
    """Whether some FORWARD opens while the open window on top of the stack is not one it imports from."""
    stack = []
    for s in rank.steps:
        if s.microbatch < 0:
            continue
        mb = rank.microbatches[s.microbatch]
        if s.kind == 0:
            sources = set(np.frombuffer(mb.import_microbatch, np.int32).tolist()) | {x.microbatch for x in mb.state_imports}
            if stack and stack[-1] not in sources:
                return True
            stack.append(mb.id)
        else:
            stack.pop()
    return False


@pytest.fixture(scope="module")
def reference(server):
    """Single-process loop over the world-size-1 plans: AdamW's first moment after each step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("tiny", seed=SEED)
        opt = make_optimizer(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        ex = Executor(model, ExecutorConfig(chunk_size=C))
        moments = []
        for i in range(len(DOCS)):
            ex.run_step(_slices(server, f"free1-{i}", 1)[0])
            opt.step()
            opt.zero_grad(set_to_none=True)
            moments.append({n: opt.state[p]["exp_avg"].double().clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)
    return moments


def _exp_avg(path: Path) -> dict[str, torch.Tensor]:
    model = build_model("tiny", seed=12345)
    opt = make_optimizer(list(model.parameters()), lr=1.0)
    checkpoint.load(path, model=model, optimizer=opt)
    return {n: opt.state[p]["exp_avg"].double().clone() for n, p in model.named_parameters()}


def _rel(got: dict, want: dict) -> float:
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    return (num / sum(float(want[k].pow(2).sum()) for k in want)) ** 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(server, world: int, prefix: str, ckpt: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HARTS_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master-port={_free_port()}",
            "-m", "trainer.train", "--planner.url", server.http_url, "--executor.chunk_size", str(C), "--job.seed", str(SEED),
            "--optimizer.lr", str(LR), "--planner.plan_timeout", "60", "--job.steps", str(len(DOCS)),
            "--job.step_prefix", f"{prefix}-", "--parallelism.reshard_after_forward", "true",
            "--checkpoint.dir", str(ckpt), "--checkpoint.every", "1"]
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_sharded_trainer_on_the_planners_lockstep_plans_equals_the_one_process_step(server, reference, world, tmp_path):
    prefix = f"ls{world}"
    slices = [_slices(server, f"{prefix}-{i}", world) for i in range(len(DOCS))]
    assert all(s.header.params.lockstep for step in slices for s in step)
    assert sum(mb.recompute for step in slices for s in step for mb in s.rank.microbatches) > 0
    assert sum(len(mb.import_row) > 0 for step in slices for s in step for mb in s.rank.microbatches) > 0
    if world == 2:
        assert any(_opens_above_an_unrelated_window(s.rank) for s in slices[0])
    out = _torchrun(server, world, prefix, tmp_path / "ckpt")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "memory per rank (plan.cluster_memory" in out.stderr
    assert f"W = {world}, float32 compute, lock-step: units gathered per forward and backward" in out.stderr
    for step in range(1, len(DOCS) + 1):
        rel = _rel(_exp_avg(tmp_path / "ckpt" / f"step-{step:08d}"), reference[step - 1])
        print(f"{world} ranks, step {step}: relative gradient difference {rel:.3g}")
        assert rel <= 1e-6, (step, rel)


def test_sharded_trainer_given_the_planners_free_plan_stops_before_any_collective(server, tmp_path):
    assert not _slices(server, "free2-0", 2)[0].header.params.lockstep
    out = _torchrun(server, 2, "free2", tmp_path / "ckpt")
    # the one traceback is torchrun's own report of its failed children, none is the trainer's
    assert out.returncode != 0 and out.stderr.count("Traceback") == 1
    assert "ChildFailedError" in out.stderr.split("Traceback", 1)[1]
    assert ("step 'free2-0': parallelism.reshard_after_forward is true, which needs a lock-step plan, got a free one; "
            "submit the step with topology.lockstep=true") in out.stderr
    assert out.stderr.count("needs a lock-step plan") == 2  # each rank, on its own: no rank waits in a collective
    assert "step 1/" not in out.stderr and not (tmp_path / "ckpt").exists()
