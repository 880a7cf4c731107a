"""Sharded DCP checkpoints across world sizes: FSDP2 on 2 gloo ranks, parameters sharded through the
step on a lock-step plan, saves after a real step; FSDP2 on 4 ranks and a plain single process,
each building only its storage on the meta device (no initialisation), load it and hold the same
weights and AdamW state."""
from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.executor_helpers import lockstep_plan
from tests.trainer.test_parallelize import C, _plan
from proto.harts.v1 import plan_pb2
from trainer import checkpoint
from trainer.models import build_model
from trainer.optim import make_optimizer

SEED = 9


def _full_state(model, opt) -> dict[str, np.ndarray]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v.detach().numpy().copy() for k, v in get_model_state_dict(model, options=opts).items()}
    for fqn, st in get_optimizer_state_dict(model, opt, options=opts)["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            out[f"optim/{fqn}/{name}"] = st[name].detach().numpy().copy()
    return out


def _worker(rank: int, world: int, port: int, path: str, save: bool, plan_bytes: bytes, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from trainer.config import ParallelismSection
    from trainer.distributed import DistContext
    from trainer.executor import Executor, ExecutorConfig
    from trainer.parallelize import GradSync, make_mesh, parallelize, run_slice

    try:
        ctx = DistContext(rank=rank, world_size=world, initialized=True)
        cfg = ParallelismSection(data_parallel="fsdp", reshard_after_forward=True)
        mesh = make_mesh(cfg, ctx)
        model = build_model("tiny", seed=SEED, fill=save, shard=lambda m: parallelize(m, mesh, cfg, ctx, reshard=True))
        params = list(model.parameters())
        opt = make_optimizer(params, lr=1e-2)
        if save:
            plan = plan_pb2.Plan.FromString(plan_bytes)
            sync = GradSync(model, ctx, every_backward=True)
            run_slice(Executor(model, ExecutorConfig(chunk_size=C, reach_all_units=True)),
                      plan_pb2.PlanSlice(header=plan.header, rank=plan.ranks[rank]), sync)
            sync.finish_step(params)
            opt.step()
            checkpoint.save(path, step=1, model=model, optimizer=opt, meta={"step_ids": ["s"]}, ctx=ctx)
        else:
            checkpoint.load(checkpoint.latest(path), model=model, optimizer=opt)
        state = _full_state(model, opt)
        queue.put((rank, state if rank == 0 else None))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, path: str, save: bool, plan_bytes: bytes) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(r, world, port, path, save, plan_bytes, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=180) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return out[0]


@pytest.mark.integration
def test_fsdp_checkpoint_of_2_ranks_resumes_at_4_ranks_and_in_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = _spawn(2, path, True, lockstep_plan(_plan()).SerializeToString())
    assert sorted(p.name for p in (tmp_path / "ckpt" / "step-00000001").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    fresh = build_model("tiny", seed=SEED)
    assert any(not np.array_equal(saved[f"model/{k}"], v.numpy()) for k, v in fresh.state_dict().items())  # it trained
    at4 = _spawn(4, path, False, b"")
    model = build_model("tiny", fill=False)
    opt = make_optimizer(list(model.parameters()), lr=1e-2)
    checkpoint.load(checkpoint.latest(path), model=model, optimizer=opt)
    at1 = _full_state(model, opt)
    assert saved.keys() == at4.keys() == at1.keys() and any(k.endswith("exp_avg_sq") for k in saved)
    for k in saved:
        assert np.array_equal(at4[k], saved[k]) and np.array_equal(at1[k], saved[k]), k
