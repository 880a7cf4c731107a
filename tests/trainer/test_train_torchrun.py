"""`trainer.train` end to end: a real `harts serve`, a 2-rank torchrun on gloo, resume, SIGTERM, errors.

Every step is submitted twice under different batch ids: planned for world size 2 (`ws2-<i>`) and
world size 1 (`ws1-<i>`). The 2-rank run must end with the parameters of a plain single-process
loop (executor + AdamW) over the world-size-1 plans: that is the exactness of the SUM gradient sync.
The full-loop test runs the whole loop: the example generator feeds the planner and torchrun trains
with FSDP2 from examples/train_tiny_fsdp.toml. The last ones train with parameters sharded through
the step (`parallelism.reshard_after_forward = true`) on the planner's lock-step plans (topology
`lockstep`, a small memory budget: windows, recomputed window parents, a window opened above an
unrelated open one) on 2 and 4 ranks: AdamW's first moment after each step equals the
one-process loop's over the world-size-1 plans (relative difference <= 1e-6); given the
planner's free plan the trainer stops before any collective with an error naming the field.
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

import numpy as np
import pytest
import torch

from harts_client.synthetic import generate
from planner_service.server import ServerProcess
from trainer import checkpoint
from harts_client.client import PlannerClient
from trainer.executor import Executor, ExecutorConfig
from trainer.models import build_model
from trainer.optim import make_optimizer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
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


def _serve(path: Path, docs: list[dict], topologies: dict[str, tuple[int, dict]]):
    """A planner with every batch of `docs` submitted as `<prefix>-<i>` for each prefix -> (world size, topology)."""
    srv = ServerProcess(path, token=TOKEN).start()
    with PlannerClient(srv.http_url, token=TOKEN) as c:
        for i, knobs in enumerate(docs):
            doc = generate(**knobs, scale=0.01, turns=(2, 3), old_logprobs=True)
            for prefix, (ws, topology) in topologies.items():
                doc["batch_id"] = f"{prefix}-{i}"
                c.submit(doc, world_size=ws, **topology)
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _serve(tmp_path_factory.mktemp("train") / "planner.db", DOCS, {"ws1": (1, TOPOLOGY), "ws2": (2, TOPOLOGY)})
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


def _loop_reference(url: str, step_ids: list[str]) -> dict:
    """Single-process loop (executor + AdamW) over the given world-size-1 plans: params after each
    step, grad norms, losses and AdamW's first moment after each step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model("tiny", seed=SEED)
        opt = make_optimizer(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        ex = Executor(model, ExecutorConfig(chunk_size=C))
        out = {"states": [_params(model)], "norms": [], "losses": [], "exp_avg": []}
        with PlannerClient(url, token=TOKEN) as c:
            for sid in step_ids:
                res = ex.run_step(c.fetch_plan(sid, 0, timeout=30))
                assert res.windows > 0  # trees larger than B: the steps run sharing windows
                out["norms"].append(float(torch.linalg.vector_norm(torch.stack(
                    [p.grad.norm() for p in model.parameters() if p.grad is not None]))))
                out["losses"].append(res.loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                out["states"].append(_params(model))
                out["exp_avg"].append({n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def reference(server):
    """Single-process loop over the world-size-1 plans."""
    return _loop_reference(server.http_url, [f"ws1-{i}" for i in range(len(DOCS))])


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


def test_two_replicated_ranks_equal_a_single_process_run_of_the_world_size_1_plans(server, reference, tmp_path):
    """`--data-parallel replicate` (the earlier path: full replicas, one bucketed SUM all-reduce);
    the FSDP2 default is checked by the full-loop test below."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    out = _run(["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}",
                "-m", "trainer.train", *_train_args(server, "--steps", "2", "--step-prefix", "ws2-", "--data-parallel",
                "replicate", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--metrics-jsonl", str(metrics))])
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
    assert out.stderr.count("trainer.loop: step ") == 2  # per-step logs from rank 0 only


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
    assert "is planned for world_size 2, but this trainer runs 1 rank(s)" in out.stderr


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
            proc.send_signal(signal.SIGTERM)
            # exits within 30 s, so not at the end of its 60 s plan timeout
            assert proc.wait(30) == 0, log_path.read_text()[-4000:]
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


# ---- the full loop: example generator -> planner -> torchrun FSDP2 trainer from the example config

EXAMPLE = ROOT / "examples" / "train_tiny_fsdp.toml"


@pytest.fixture(scope="module")
def loop_server(tmp_path_factory):
    """A planner fed by examples/generator_submit.py: the same 3 steps planned for 2 ranks (g2-<i>) and 1 (g1-<i>)."""
    srv = ServerProcess(tmp_path_factory.mktemp("loop") / "planner.db", token=TOKEN).start()
    for ws in (1, 2):
        out = _run(["examples/generator_submit.py", "--url", srv.http_url, "--steps", "3", "--world-size", str(ws),
                    "--batch-prefix", f"g{ws}-", "--chunk-size", str(C), "--microbatch-tokens", "128"])
        assert out.returncode == 0, out.stderr[-3000:]
    yield srv
    srv.stop()


def _example_reference(server) -> dict:
    """One process over the world-size-1 plans with the example config's objective, schedule and clipping."""
    from trainer.config import load_config
    from trainer.distributed import DistContext
    from trainer.optim import lr_at, set_lr
    from trainer.parallelize import grad_norm_and_clip

    cfg = load_config(EXAMPLE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(cfg.model.name, seed=cfg.job.seed)
        params = list(model.parameters())
        o, ls = cfg.optimizer, cfg.lr_schedule
        opt = make_optimizer(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        ex = Executor(model, ExecutorConfig(chunk_size=C, objective=cfg.objective, want_entropies=True))
        out = {"states": [_params(model)], "norms": [], "losses": [], "exp_avg": []}
        with PlannerClient(server.http_url, token=TOKEN) as c:
            for i in range(3):
                set_lr(opt, lr_at(i, lr=o.lr, total_steps=2 if i < 2 else 3, warmup_steps=ls.warmup_steps,
                                  decay=ls.decay, decay_steps=ls.decay_steps, min_lr_ratio=ls.min_lr_ratio))
                res = ex.run_step(c.fetch_plan(f"g1-{i}", 0, timeout=30))
                out["norms"].append(grad_norm_and_clip(params, o.max_grad_norm, DistContext(), sharded=False))
                out["losses"].append(res.loss)
                opt.step()
                opt.zero_grad(set_to_none=True)
                out["states"].append(_params(model))
                out["exp_avg"].append({n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()})
    finally:
        torch.set_num_threads(threads)
    return out


def _rel_moment(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Relative difference of two AdamW first moments (float64)."""
    num = sum(float((got[k].double() - want[k].double()).pow(2).sum()) for k in want)
    return (num / sum(float(want[k].double().pow(2).sum()) for k in want)) ** 0.5


def _exp_avg(path: Path) -> dict[str, torch.Tensor]:
    """AdamW's first moment after the checkpoint's steps: after one step it is (1 - beta1) x the clipped gradient."""
    model = build_model("tiny", seed=12345)
    opt = make_optimizer(list(model.parameters()), lr=1.0)
    checkpoint.load(path, model=model, optimizer=opt)
    return {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}


def test_full_loop_example_config_torchrun_fsdp_equals_one_process_then_resumes_on_one_rank(loop_server, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer.executor import StepResult
    from trainer.models import load_model
    from harts_client.rollouts import latest_export

    ref = _example_reference(loop_server)
    ckpt, hf, metrics, tb = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "m" / "metrics.jsonl", tmp_path / "tb"
    paths = ["--planner.url", loop_server.http_url, "--checkpoint.dir", str(ckpt), "--checkpoint.export_dir", str(hf),
             "--metrics.jsonl", str(metrics), "--metrics.tensorboard_dir", str(tb), "--planner.plan_timeout", "60"]
    out = _run(["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}", "-m", "trainer.train",
                "--config", str(EXAMPLE), *paths, "--job.steps", "2", "--job.step_prefix", "g2-"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "(fsdp, 2 rank(s))" in out.stderr
    # The 2-rank FSDP2 step is the one-process step: AdamW's first moment after step 1 is (1 - beta1) x gradient.
    rel = _rel_moment(_exp_avg(ckpt / "step-00000001"), ref["exp_avg"][0])
    print(f"FSDP2 2-rank vs one process: relative gradient difference {rel:.3g}")
    assert rel <= 1e-6, f"relative gradient difference {rel:.3g}"
    assert _max_rel(_load(ckpt / "step-00000002"), ref["states"][2]) < 1e-5
    lines = _jsonl(metrics)
    assert [m["step"] for m in lines] == [1, 2]
    for m, norm, loss in zip(lines, ref["norms"], ref["losses"]):
        assert m["grad_norm"] == pytest.approx(norm, rel=1e-6) and m["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-9)
        for key in ("policy_loss", "lr", "advantage_mean", "advantage_std", "advantage_min", "advantage_max",
                    "computed_tokens", "expanded_tokens", "compression", "microbatches", "windows", "peak_memory_mib",
                    "tokens_per_s", "computed_tokens_per_s", "loss_tokens", "policy_version"):
            assert key in m, key
        assert m["advantage_max"] > 0 > m["advantage_min"] and m["peak_memory_mib"] > 0 and m["skipped"] == 0
        if "stats" in StepResult.__dataclass_fields__:  # an executor that sums LossTerms.stats
            assert 0 <= m["clip_fraction"] <= 1 and m["entropy"] > 0 and m["approx_kl_old"] >= 0
            assert m["ratio_min"] <= m["ratio_mean"] <= m["ratio_max"]
    assert lines[0]["lr"] < lines[1]["lr"]  # one warmup step of the example config
    # An export for the generators after step 2, carrying its policy version.
    assert latest_export(hf) == (hf / "step-00000002", 2)
    exported = load_model(hf / "step-00000002")
    for k, v in ref["states"][2].items():
        assert torch.allclose(exported.state_dict()[k], v.to(torch.bfloat16).float(), rtol=0, atol=0.02 * float(v.abs().max()) + 1e-6), k

    # Resume on 1 rank from the 2-rank sharded checkpoint; step 3 is planned for 1 rank. A line
    # logged after the checkpoint by a run that died must not survive; keep_last prunes.
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": 3, "from": "a crashed run"}) + "\n")
    out = _run(["-m", "trainer.train", "--config", str(EXAMPLE), *paths, "--job.steps", "3",
                "--job.step_ids", "g2-0,g2-1,g1-2", "--checkpoint.keep_last", "2"])
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from" in out.stderr
    lines = _jsonl(metrics)
    assert [m["step"] for m in lines] == [1, 2, 3] and "from" not in lines[-1]
    assert lines[-1]["grad_norm"] == pytest.approx(ref["norms"][2], rel=1e-6)
    assert _max_rel(_load(ckpt / "step-00000003"), ref["states"][3]) < 1e-5
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-00000002", "step-00000003"]
    assert latest_export(hf)[1] == 3  # the last step of a run is exported too
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


# ---- the planner's lock-step plans, parameters sharded through the step

#: a tree-sampled batch (its 2-rank lock-step plan opens a window above an unrelated one) and a per-call one
LOCKSTEP_DOCS = [dict(scheme="tree", tasks=2, seed=2), dict(scheme="percall", tasks=2, seed=1)]
LOCKSTEP = {"microbatch_tokens": 64, "chunk_size": C, "memory_tokens": 96, "lockstep": True}
FREE = {"microbatch_tokens": 64, "chunk_size": C}


@pytest.fixture(scope="module")
def lockstep_server(tmp_path_factory):
    """The same batches planned lock-step for 2 (ls2-<i>) and 4 ranks (ls4-<i>), free for 1 (free1-<i>) and 2 (free2-<i>)."""
    srv = _serve(tmp_path_factory.mktemp("lockstep") / "planner.db", LOCKSTEP_DOCS,
                 {"ls2": (2, LOCKSTEP), "ls4": (4, LOCKSTEP), "free1": (1, FREE), "free2": (2, FREE)})
    yield srv
    srv.stop()


def _slices(server, step: str, world: int) -> list:
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


def _sharded_run(server, world: int, prefix: str, ckpt: Path) -> subprocess.CompletedProcess:
    return _run(["-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master-port={_free_port()}",
                 "-m", "trainer.train", *_train_args(server, "--steps", str(len(LOCKSTEP_DOCS)), "--step-prefix", f"{prefix}-",
                 "--parallelism.reshard_after_forward", "true", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")],
                timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks"])
def test_sharded_trainer_on_the_planners_lockstep_plans_equals_the_one_process_step(lockstep_server, world, tmp_path):
    prefix = f"ls{world}"
    slices = [_slices(lockstep_server, f"{prefix}-{i}", world) for i in range(len(LOCKSTEP_DOCS))]
    assert all(s.header.params.lockstep for step in slices for s in step)
    assert sum(mb.recompute for step in slices for s in step for mb in s.rank.microbatches) > 0
    assert sum(len(mb.import_row) > 0 for step in slices for s in step for mb in s.rank.microbatches) > 0
    if world == 2:
        assert any(_opens_above_an_unrelated_window(s.rank) for s in slices[0])
    ref = _loop_reference(lockstep_server.http_url, [f"free1-{i}" for i in range(len(LOCKSTEP_DOCS))])
    out = _sharded_run(lockstep_server, world, prefix, tmp_path / "ckpt")
    assert out.returncode == 0, out.stderr[-4000:]
    assert "memory per rank (plan.cluster_memory" in out.stderr
    assert f"W = {world}, float32 compute, lock-step: units gathered per forward and backward" in out.stderr
    for step in range(1, len(LOCKSTEP_DOCS) + 1):
        rel = _rel_moment(_exp_avg(tmp_path / "ckpt" / f"step-{step:08d}"), ref["exp_avg"][step - 1])
        print(f"{world} ranks, step {step}: relative gradient difference {rel:.3g}")
        assert rel <= 1e-6, (step, rel)


@pytest.mark.slow
def test_sharded_trainer_given_the_planners_free_plan_stops_before_any_collective(lockstep_server, tmp_path):
    assert not _slices(lockstep_server, "free2-0", 2)[0].header.params.lockstep
    out = _sharded_run(lockstep_server, 2, "free2", tmp_path / "ckpt")
    # the one traceback is torchrun's own report of its failed children, none is the trainer's
    assert out.returncode != 0 and out.stderr.count("Traceback") == 1
    assert "ChildFailedError" in out.stderr.split("Traceback", 1)[1]
    assert ("step 'free2-0': parallelism.reshard_after_forward is true, which needs a lock-step plan, got a free one; "
            "submit the step with topology.lockstep=true") in out.stderr
    assert out.stderr.count("needs a lock-step plan") == 2  # each rank, on its own: no rank waits in a collective
    assert "step 1/" not in out.stderr and not (tmp_path / "ckpt").exists()
