"""A 2-rank torchrun run rides out a planner restart.

The planner is killed with SIGKILL while the ranks wait for the next step's plan, stays down for
20 s, and comes back on the same port and database. The run must finish with the parameters of
a single-process loop over the world-size-1 plans of the same steps, as an undisturbed run does
(tests/trainer/test_train_torchrun.py): the trainers' client retries until `planner.retry_seconds`.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from harts_client.client import PlannerClient
from harts_client.synthetic import generate
from planner_service.server import ServerProcess
from tests.trainer.test_train_torchrun import C, DOCS, LR, ROOT, SEED, TOKEN, TOPOLOGY, _env, _jsonl, _load, _max_rel, \
    _params
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.optim import make_optimizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOWN_S = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _docs(i: int) -> dict:
    return generate(**DOCS[i], scale=0.01, turns=(2, 3), old_logprobs=True)


def _reference(url: str, steps: int) -> list[dict]:
    """Parameters after each step of one process over the world-size-1 plans."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("tiny", seed=SEED)
        opt = make_optimizer(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        ex = Executor(model, ExecutorConfig(chunk_size=C))
        states = [_params(model)]
        with PlannerClient(url, token=TOKEN) as c:
            for i in range(steps):
                ex.run_step(c.fetch_plan(f"ws1-{i}", 0, timeout=30))
                opt.step()
                opt.zero_grad(set_to_none=True)
                states.append(_params(model))
    finally:
        torch.set_num_threads(threads)
    return states


def test_kill_9_of_the_planner_mid_run_changes_no_gradient(tmp_path):
    srv = ServerProcess(tmp_path / "planner.db", token=TOKEN, http_port=_free_port(), grpc_port=_free_port(),
                        log_path=tmp_path / "planner.log").start()
    with PlannerClient(srv.http_url, token=TOKEN) as c:
        for i in range(2):
            doc = _docs(i)
            doc["batch_id"] = f"ws1-{i}"
            c.submit(doc, world_size=1, **TOPOLOGY)
        doc = _docs(0)
        doc["batch_id"] = "ws2-0"
        c.submit(doc, world_size=2, **TOPOLOGY)  # step 2 (ws2-1) comes after the restart
    ckpt, metrics, log_path = tmp_path / "ckpt", tmp_path / "metrics.jsonl", tmp_path / "train.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}",
           "-m", "trainer.train", "--planner-url", srv.http_url, "--chunk-size", str(C), "--seed", str(SEED),
           "--lr", str(LR), "--plan-timeout", "120", "--steps", "2", "--step-prefix", "ws2-", "--data-parallel",
           "replicate", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--metrics-jsonl", str(metrics),
           "--planner.retry_seconds", "120"]
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 180
            while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # step 1 done: ranks wait for 2
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.05)
            srv.kill()  # SIGKILL
            time.sleep(DOWN_S)
            assert proc.poll() is None, log_path.read_text()[-4000:]  # the ranks wait it out
            srv.start()
            with PlannerClient(srv.http_url, token=TOKEN) as c:
                doc = _docs(1)
                doc["batch_id"] = "ws2-1"
                c.submit(doc, world_size=2, **TOPOLOGY)
            assert proc.wait(180) == 0, log_path.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    try:
        states = _reference(srv.http_url, 2)
    finally:
        srv.stop()
    assert [m["step"] for m in _jsonl(metrics)] == [1, 2]
    assert _max_rel(states[2], states[0]) > 1e-3
    for step in (1, 2):
        assert _max_rel(_load(ckpt / f"step-{step:08d}"), states[step]) < 1e-5, step
    assert "Traceback" not in log_path.read_text()
