"""Pieces of `trainer.train`: bucketed SUM gradient sync against its per-tensor reference on 2 gloo
ranks, parameter broadcast, DCP checkpoint round trips, config validation and the `harts train` CLI."""
from __future__ import annotations

import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harts_cli.main import build_parser
from trainer import checkpoint
from trainer.distributed import (
    DistContext,
    broadcast_parameters,
    buckets,
    sync_gradients,
    sync_gradients_ref,
)
from trainer.config import ConfigError, TrainerConfig, config_from_namespace, load_config, to_dict
from trainer.models import build_model
from trainer.optim import lr_at
from trainer.train import torchrun_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize(
    "sizes,dtypes,limit,expected",
    [
        ([4, 4, 4], ["f"] * 3, 32, [[0, 1], [2]]),
        ([4, 40, 4], ["f"] * 3, 32, [[0], [1], [2]]),
        ([1, 1, 1, 1], ["f", "f", "d", "d"], 1 << 20, [[0, 1], [2, 3]]),
        ([2, 2], ["f", "f"], 16, [[0, 1]]),
    ],
    ids=["fill", "oversized-alone", "dtype-split", "exact-fit"],
)
def test_buckets(sizes, dtypes, limit, expected):
    kinds = {"f": torch.float32, "d": torch.float64}
    tensors = [torch.zeros(n, dtype=kinds[k]) for n, k in zip(sizes, dtypes)]
    assert buckets(tensors, limit) == expected


def _shapes():
    return [(3, 5), (7,), (2, 2, 2), (11,), (4, 3)]


def _grads(rank: int) -> list[torch.Tensor | None]:
    """Seeded per-rank gradients; parameter 1 has none on rank 1, parameter 3 none anywhere."""
    g = torch.Generator().manual_seed(100 + rank)
    out = [torch.randn(s, generator=g) for s in _shapes()]
    out[3] = None
    if rank == 1:
        out[1] = None
    return out


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = DistContext(rank=rank, world_size=world, initialized=True)
        results = {}
        for name, fn, kw in (("fast", sync_gradients, {"bucket_bytes": 64}), ("ref", sync_gradients_ref, {})):
            params = [torch.zeros(s, requires_grad=True) for s in _shapes()]
            for p, g in zip(params, _grads(rank)):
                p.grad = None if g is None else g.clone()
            fn(params, ctx, **kw)
            results[name] = [None if p.grad is None else p.grad.numpy().copy() for p in params]
        model = build_model("tiny-dense", seed=rank)  # different weights per rank before the broadcast
        broadcast_parameters(model, ctx, bucket_bytes=4096)
        results["weights"] = {k: v.numpy().copy() for k, v in model.state_dict().items()}
        queue.put((rank, results))  # numpy, not tensors: a tensor in a queue dies with its process
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return out


@pytest.mark.integration
def test_bucketed_sync_equals_per_tensor_reference_and_the_sum(two_ranks):
    expect = []
    for a, b in zip(_grads(0), _grads(1)):
        expect.append(None if a is None and b is None else (a if a is not None else 0) + (b if b is not None else 0))
    for rank in (0, 1):
        fast, ref = two_ranks[rank]["fast"], two_ranks[rank]["ref"]
        for f, r, e in zip(fast, ref, expect):
            if e is None:
                assert f is None and r is None  # untouched everywhere: AdamW must skip it, as one process would
            else:
                assert torch.equal(torch.from_numpy(f), torch.from_numpy(r)) and torch.equal(torch.from_numpy(f), e)


@pytest.mark.integration
def test_broadcast_gives_every_rank_rank0_weights(two_ranks):
    w0, w1 = two_ranks[0]["weights"], two_ranks[1]["weights"]
    expect = build_model("tiny-dense", seed=0).state_dict()
    for k, v in expect.items():
        assert torch.equal(torch.from_numpy(w0[k]), v) and torch.equal(torch.from_numpy(w1[k]), v), k


def _trained(seed: int):
    model = build_model("tiny-dense", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    return model, opt


def test_checkpoint_round_trip_restores_model_optimizer_and_step(tmp_path):
    model, opt = _trained(0)
    path = checkpoint.save(tmp_path, step=7, model=model, optimizer=opt, meta={"step_ids": ["a"] * 7}, ctx=DistContext())
    assert checkpoint.latest(tmp_path) == path == tmp_path / "step-00000007"
    fresh, fresh_opt = _trained(1)
    meta = checkpoint.load(path, model=fresh, optimizer=fresh_opt)
    assert meta["step"] == 7 and meta["step_ids"] == ["a"] * 7
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(v, w), k
    s0, s1 = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert s0.keys() == s1.keys()
    for i in s0:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s0[i][name], s1[i][name]), (i, name)


def test_checkpoint_latest_and_broken_pointer(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    (tmp_path / "latest").write_text("step-00000003\n")
    with pytest.raises(checkpoint.CheckpointError, match="expected a complete checkpoint"):
        checkpoint.latest(tmp_path)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--job.steps", "0"], "job.steps: expected >= 1"),
        (["--steps", "3", "--step-ids", "a,b"], "job.step_ids: expected at least steps=3"),
        (["--optimizer.lr", "0"], "optimizer.lr: expected > 0"),
        (["--max-grad-norm", "-1"], "optimizer.max_grad_norm: expected >= 0"),
        (["--resume"], "checkpoint.resume: expected a checkpoint dir"),
        (["--checkpoint.every", "-1"], "checkpoint.every: expected >= 0"),
        (["--objective.aggregation", "mean"], "objective.aggregation: expected one of"),
        (["--data-parallel", "ddp"], "parallelism.data_parallel: expected one of"),
        (["--lr_schedule.decay", "step"], "lr_schedule.decay: expected one of"),
        (["--objective.clip_high", "wide"], "config: objective.clip_high: expected a number, got 'wide'"),
        (["--parallelism.reshard_after_forward", "true", "--data-parallel", "replicate"],
         "parallelism.reshard_after_forward: expected false or none with data_parallel='replicate'"),
        (["--parallelism.reshard_memory_fraction", "0"], "parallelism.reshard_memory_fraction: expected in (0, 1]"),
    ],
    ids=["steps", "too-few-ids", "lr", "clip", "resume-without-dir", "every", "aggregation", "dp", "decay", "type",
         "reshard-replicate", "fraction"],
)
def test_config_rejects_bad_values_naming_the_dotted_field(flags, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_config(None, flags)


def test_executor_section_is_the_executor_configs_one_definition():
    """The config file's executor section and ExecutorConfig share one definition of those fields,
    and the schema's backend names (spelled out to keep torch out of it) are the kernels'."""
    from kernels.gated_delta_rule import BACKENDS as KERNELS
    from kernels.tree_attention import BACKENDS as ATTENTION
    from trainer.config.schema import ATTENTION_BACKENDS, KERNEL_BACKENDS, ExecutorSection
    from trainer.executor import ExecutorConfig

    assert issubclass(ExecutorConfig, ExecutorSection)
    assert set(KERNEL_BACKENDS) == {"auto", *KERNELS} and set(ATTENTION_BACKENDS) == {"auto", *ATTENTION}
    section = load_config(None, ["--executor.chunk_size", "16", "--executor.attention_backend", "ref"]).executor
    ex = ExecutorConfig(**to_dict(section), validate="none")
    assert (ex.chunk_size, ex.attention_backend) == (16, "ref")
    with pytest.raises(ValueError, match="chunk_size: expected a power of two, got 12"):
        ExecutorConfig(chunk_size=12)
    with pytest.raises(ValueError, match="validate: expected one of"):
        ExecutorConfig(validate="some")


def test_step_dirs_prune_keeps_the_newest_and_the_one_latest_names(tmp_path):
    from trainer.step_dirs import latest_name, point_latest, prune, step_name

    for step in (1, 2, 3, 4):
        (tmp_path / step_name(step)).mkdir()
    point_latest(tmp_path, step_name(1))
    assert latest_name(tmp_path) == "step-00000001" and not (tmp_path / "latest.tmp").exists()
    assert [p.name for p in prune(tmp_path, 2)] == ["step-00000002"]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001", "step-00000003", "step-00000004"]
    assert prune(tmp_path, 0) == []


def test_reshard_after_forward_defaults_to_the_device_memory_rule():
    from trainer.config import ParallelismSection
    from trainer.parallelize import resolve_reshard

    cpu, gib = torch.device("cpu"), 1 << 30
    assert resolve_reshard(ParallelismSection(), 100 * gib, cpu) is False  # CPU without device_memory_gb
    assert resolve_reshard(ParallelismSection(device_memory_gb=141), 80 * gib, cpu) is True  # > 0.5 x 141 GiB
    assert resolve_reshard(ParallelismSection(device_memory_gb=141), 60 * gib, cpu) is False
    assert resolve_reshard(ParallelismSection(device_memory_gb=141, reshard_memory_fraction=0.25), 40 * gib, cpu) is True
    assert resolve_reshard(ParallelismSection(reshard_after_forward=True), 1, cpu) is True
    assert resolve_reshard(ParallelismSection(reshard_after_forward=False, device_memory_gb=1), 10 * gib, cpu) is False
    assert resolve_reshard(ParallelismSection(data_parallel="replicate"), 10 * gib, cpu) is False
    assert load_config(None, ["--parallelism.reshard_after_forward", "none"]).parallelism.reshard_after_forward is None


def test_step_ids_from_prefix_or_list():
    assert load_config(None, ["--steps", "2"]).step_id(1) == "step-1"
    assert load_config(None, ["--job.steps", "2", "--job.step_ids", "a,b,c"]).step_id(1) == "b"


def test_config_file_then_dotted_overrides(tmp_path):
    cfg = load_config(ROOT / "examples" / "train_tiny_fsdp.toml", ["--objective.clip_high", "0.28", "--steps", "7"])
    assert cfg.objective.clip_high == 0.28 and cfg.objective.clip_low == 0.2 and cfg.job.steps == 7
    assert cfg.lr_schedule.decay == "cosine" and cfg.parallelism.data_parallel == "fsdp"
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("job:\n  steps: 3\nobjective:\n  kl_coef: 0.05\n  aggregation: seq-mean-token-mean\n")
    y = load_config(yaml_file, ["--objective.kl_coef", "0.1"])
    assert (y.job.steps, y.objective.kl_coef, y.objective.aggregation) == (3, 0.1, "seq-mean-token-mean")
    (tmp_path / "typo.toml").write_text("[objective]\nclip_hihg = 0.3\n")
    with pytest.raises(ConfigError, match="unknown field objective.clip_hihg; expected one of clip_low, clip_high"):
        load_config(tmp_path / "typo.toml")
    with pytest.raises(ConfigError, match="expected a .toml, .yaml or .yml file"):
        (tmp_path / "x.ini").write_text("")
        load_config(tmp_path / "x.ini")


def test_example_config_documents_every_field_and_help_lists_them():
    """examples/train_tiny_fsdp.toml names every field of TrainerConfig; --help shows each with its docstring."""
    import tomllib

    doc = tomllib.loads((ROOT / "examples" / "train_tiny_fsdp.toml").read_text())
    text = (ROOT / "examples" / "train_tiny_fsdp.toml").read_text()
    help_text = subprocess.run([sys.executable, "-m", "trainer.train", "--help"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60).stdout
    for section, values in to_dict(TrainerConfig()).items():
        for name in values:
            in_file = name in doc.get(section, {}) or (section, name) == ("planner", "token") and "# token =" in text
            assert in_file, f"{section}.{name} missing from the example config"
            assert f"--{section}.{name}" in help_text, f"--{section}.{name} missing from --help"
    assert "Lower clip range epsilon" in help_text  # field docstrings reach --help


def test_lr_schedule_warmup_then_cosine_or_linear():
    kw = dict(lr=1.0, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_at(i, **kw, decay="constant") for i in (0, 1, 2, 9)] == [1 / 3, 2 / 3, 1.0, 1.0]
    cos = [lr_at(i, **kw, decay="cosine") for i in range(10)]
    assert cos[2] == 1.0 and all(a > b for a, b in zip(cos[2:], cos[3:])) and cos[-1] > 0.1
    assert lr_at(6, **kw, decay="cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(6, **kw, decay="linear") == pytest.approx(1.0 - 0.9 * 0.5)
    assert lr_at(50, **kw, decay="linear") == pytest.approx(0.1)


def test_harts_train_cli_maps_to_trainer_train_flags(tmp_path):
    from harts_cli.cmd_train import train_argv
    from trainer.train import add_arguments
    import argparse

    parser, _ = build_parser()
    args = parser.parse_args(["train", "--steps", "4", "--step-ids", "a,b,c,d", "--lr", "0.003", "--resume",
                              "--checkpoint-dir", str(tmp_path), "--nproc-per-node", "2", "--chunk-size", "16",
                              "--objective.clip_high", "0.28", "--config", "examples/train_tiny_fsdp.toml"])
    argv = train_argv(args)
    direct = argparse.ArgumentParser()
    add_arguments(direct)
    again = direct.parse_args(argv)
    assert config_from_namespace(again) == config_from_namespace(args)
    assert config_from_namespace(again).objective.clip_high == 0.28
    cmd = torchrun_command(argv, 2)
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--nproc_per_node=2" in cmd
    assert cmd[cmd.index("-m", 3) + 1] == "trainer.train"
