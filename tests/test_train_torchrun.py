"""`trainer.train` end to end: a real `harts serve`, a 2-rank torchrun on gloo, resume, SIGTERM, errors.

Every step is submitted twice under different batch ids: planned for world size 2 (`ws2-<i>`) and
world size 1 (`ws1-<i>`). The 2-rank run must end with the parameters of a plain single-process
loop (executor + AdamW) over the world-size-1 plans: that is the exactness of the SUM gradient sync.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.workloads import generate
from planner_service.server import ServerProcess
from trainer import checkpoint
from trainer.client import PlannerClient
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.optim import make_optimizer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "train-token"
C = 16
LR = 1e-3
SEED = 3
TOPOLOGY = {"microbatch_tokens": 64, "chunk_size": C}  # below the trees: sharing windows
#: Small batches with nonzero advantages: a group-sampled step and a tree-sampled one.
DOCS = [
    dict(scheme="group", tasks=2, seed=0, group_size=3),
    dict(scheme="tree", tasks=2, seed=2),
    dict(scheme="group", tasks=2, seed=2, group_size=3),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("train") / "planner.db", token=TOKEN).start()
    with PlannerClient(srv.http_url, token=TOKEN) as c:
        for i, knobs in enumerate(DOCS):
            doc = generate(**knobs, scale=0.01, turns=(2, 3), old_logprobs=True)
            for ws in (1, 2):
                doc["batch_id"] = f"ws{ws}-{i}"
                c.submit(doc, world_size=ws, **TOPOLOGY)
    yield srv
    srv.stop()


def _env() -> dict:
    return {**os.environ, "HARTS_TOKEN": TOKEN, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _train_args(server, *extra: str) -> list[str]:
    return ["--planner-url", server.http_url, "--chunk-size", str(C), "--seed", str(SEED), "--lr", str(LR),
            "--plan-timeout", "60", *extra]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(server):
    """Single-process loop over the world-size-1 plans: params after each step and grad norms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("tiny", seed=SEED)
        opt = make_optimizer(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        ex = Executor(model, ExecutorConfig(chunk_size=C))
        states, norms, losses = [_params(model)], [], []
        with PlannerClient(server.http_url, token=TOKEN) as c:
            for i in range(len(DOCS)):
                res = ex.run_step(c.fetch_plan(f"ws1-{i}", 0, timeout=30))
                assert res.windows > 0  # trees larger than B: the steps run sharing windows
                norms.append(float(torch.linalg.vector_norm(torch.stack(
                    [p.grad.norm() for p in model.parameters() if p.grad is not None]))))
                losses.append(res.loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                states.append(_params(model))
    finally:
        torch.set_num_threads(threads)
    return {"states": states, "norms": norms, "losses": losses}


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load(path: Path) -> dict[str, torch.Tensor]:
    model = build_model("tiny", seed=12345)  # other weights: the checkpoint must overwrite all of them
    checkpoint.load(path, model=model)
    return _params(model)


def _max_rel(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_ranks_equal_a_single_process_run_of_the_world_size_1_plans(server, reference, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    out = _run(["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}",
                "-m", "trainer.train", *_train_args(server, "--steps", "2", "--step-prefix", "ws2-",
                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--metrics-jsonl", str(metrics))])
    assert out.returncode == 0, out.stderr[-4000:]
    assert checkpoint.latest(ckpt) == ckpt / "step-00000002"
    assert checkpoint.read_meta(ckpt / "step-00000002")["step_ids"] == ["ws2-0", "ws2-1"]
    states = reference["states"]
    assert _max_rel(states[2], states[0]) > 1e-3  # training moved the weights well beyond the tolerance
    for step in (1, 2):
        assert _max_rel(_load(ckpt / f"step-{step:08d}"), states[step]) < 1e-5, step
    lines = _jsonl(metrics)
    assert [m["step"] for m in lines] == [1, 2] and [m["step_id"] for m in lines] == ["ws2-0", "ws2-1"]
    with PlannerClient(server.http_url, token=TOKEN) as c:
        stats = [c.fetch_plan(f"ws2-{i}", 0, timeout=30).header.stats for i in range(2)]
        assert all(len(c.fetch_plan(f"ws2-{i}", r, timeout=30).rank.microbatches) > 0 for i in range(2) for r in range(2))
    for m, st, norm, loss in zip(lines, stats, reference["norms"], reference["losses"]):
        assert m["world_size"] == 2
        # Token counts are summed over both ranks: the planner's step totals.
        assert (m["computed_tokens"], m["expanded_tokens"], m["microbatches"]) == (
            st.computed_tokens, st.expanded_tokens, st.microbatches)
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)  # SUM, not mean, of the ranks' gradients
        assert m["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-9)
        assert m["computed_tokens"] > 0 and m["compression"] == pytest.approx(m["expanded_tokens"] / m["computed_tokens"])
        assert m["tokens_per_s"] > 0 and m["seconds"] > 0
    assert out.stderr.count("trainer.train: step ") == 2  # per-step logs from rank 0 only


def test_resume_continues_the_step_counter_and_matches_an_uninterrupted_run(server, reference, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    first = _run(["-m", "trainer.train", *_train_args(server, "--steps", "1", "--step-prefix", "ws1-",
                                                       "--checkpoint-dir", str(ckpt))])
    assert first.returncode == 0, first.stderr[-4000:]
    second = _run(["-m", "trainer.train", *_train_args(server, "--steps", "3", "--step-prefix", "ws1-",
                                                        "--checkpoint-dir", str(ckpt), "--resume",
                                                        "--metrics-jsonl", str(metrics))])
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resumed from" in second.stderr
    assert [m["step"] for m in _jsonl(metrics)] == [2, 3]
    assert checkpoint.read_meta(checkpoint.latest(ckpt))["step_ids"] == ["ws1-0", "ws1-1", "ws1-2"]
    assert _max_rel(_load(ckpt / "step-00000003"), reference["states"][3]) < 1e-6

    other = _run(["-m", "trainer.train", *_train_args(server, "--steps", "2", "--step-prefix", "other-",
                                                       "--checkpoint-dir", str(ckpt), "--resume")])
    assert other.returncode == 1 and "Traceback" not in other.stderr
    assert "--resume" in other.stderr and "expected this run's first 2 steps ['other-0', 'other-1']" in other.stderr


def test_sigterm_finishes_the_step_and_checkpoints(server, reference, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.train", *_train_args(
            server, "--steps", "3", "--step-prefix", "ws1-", "--checkpoint-dir", str(ckpt),
            "--metrics-jsonl", str(metrics))], cwd=ROOT, env=_env(), stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while "ready; training steps" not in log_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, log_path.read_text()[-4000:]
        finally:
            proc.kill() if proc.poll() is None else None
    done = [m["step"] for m in _jsonl(metrics)]
    assert done in ([1], [2]), done  # stopped after the step that was running, not at the end of the run
    assert "SIGTERM: stopped after step" in log_path.read_text()
    assert checkpoint.read_meta(checkpoint.latest(ckpt))["step"] == done[-1]
    assert _max_rel(_load(checkpoint.latest(ckpt)), reference["states"][done[-1]]) < 1e-6


def test_world_size_mismatch_is_a_clear_error(server):
    out = _run(["-m", "trainer.train", *_train_args(server, "--steps", "1", "--step-prefix", "ws2-")])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "the plan is for world_size=2, but this run has 1 rank(s)" in out.stderr


def test_unreachable_planner_is_a_clear_error():
    out = _run(["-m", "trainer.train", "--planner-url", f"http://127.0.0.1:{_free_port()}", "--steps", "1",
                "--ready-timeout", "1"], timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "not reachable or not ready after 1 s" in out.stderr


def test_plan_for_another_vocabulary_is_a_clear_error(server):
    from tests.service_helpers import rollout_doc

    with PlannerClient(server.http_url, token=TOKEN) as c:
        c.submit(rollout_doc("vocab64", vocab=64), world_size=1, **TOPOLOGY)
    out = _run(["-m", "trainer.train", *_train_args(server, "--steps", "1", "--step-ids", "vocab64")])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "vocab_size: expected 256 (the model's), got 64" in out.stderr


def test_sigterm_while_waiting_for_a_plan_exits_at_once(server, tmp_path):
    metrics, log_path = tmp_path / "metrics.jsonl", tmp_path / "train.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.train", *_train_args(
            server, "--steps", "2", "--step-ids", "ws1-0,never-submitted", "--metrics-jsonl", str(metrics))],
            cwd=ROOT, env=_env(), stdout=log_file, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not (metrics.exists() and metrics.read_text().count("\n") == 1):
                assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-4000:]
                time.sleep(0.02)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, log_path.read_text()[-4000:]
            assert time.monotonic() - t0 < 10  # not after the 60 s plan timeout
        finally:
            proc.kill() if proc.poll() is None else None
    assert "SIGTERM while waiting for the plan of step 'never-submitted'" in log_path.read_text()


def test_missing_plan_times_out_with_a_clear_error(server):
    out = _run(["-m", "trainer.train", "--planner-url", server.http_url, "--chunk-size", str(C), "--steps", "1",
                "--step-ids", "never-submitted", "--plan-timeout", "1"], timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "step 'never-submitted' rank 0: no plan after 1 s" in out.stderr


def test_harts_train_runs_the_same_trainer(server, reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    out = _run(["-m", "harts_cli.main", "train", *_train_args(server, "--steps", "1", "--step-prefix", "ws1-",
                                                              "--checkpoint-dir", str(ckpt))])
    assert out.returncode == 0, out.stderr[-4000:]
    assert _max_rel(_load(ckpt / "step-00000001"), reference["states"][1]) < 1e-6
